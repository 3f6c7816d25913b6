"""`--nproc N`: the trainer service starts its own N ranks on this node (what `torchrun
--nproc-per-node N` does, without the elastic agent), and ends them together.

`RankGroup` starts `argv` N times with the torchrun environment (`RANK`, `LOCAL_RANK`,
`WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and watches them. One voice:
rank 0 is the service (gRPC, ready file, talks to store/controller/gateway); the others follow it.

Ending cleanly, within a bound: as soon as one rank ends with an error or is killed (even by
`kill -9`), the others get SIGTERM and, `grace_s` later, SIGKILL; the group's exit code is that
rank's (a signal N: 128 + N). When every rank ends with 0 the group ends with 0; a rank still
running `grace_s` after rank 0 ended is killed (the group then fails). SIGTERM/SIGINT to the
launcher go to rank 0 only (it stops after the step in progress, with a checkpoint, and its
decision reaches the others); a second one kills the group. After a failure, starting the
service again resumes from the last checkpoint (`checkpoint.py`): nothing trained twice, nothing
lost.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from harnessrl.procs import free_port

log = logging.getLogger("harnessrl.trainer")


class RankGroup:
    """N processes of one sharded trainer on this node (see the module docstring)."""

    def __init__(self, argv: Sequence[str], nproc: int, grace_s: float = 30.0,
                 env: dict[str, str] | None = None, master_addr: str = "127.0.0.1") -> None:
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {nproc}")
        self.argv, self.nproc, self.grace_s = list(argv), nproc, grace_s
        self.env = dict(os.environ if env is None else env)
        self.master_addr = master_addr
        self.procs: list[subprocess.Popen[bytes]] = []
        self._terms = 0

    def start(self) -> "RankGroup":
        port = free_port()
        for rank in range(self.nproc):
            env = {**self.env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(self.nproc), "LOCAL_WORLD_SIZE": str(self.nproc),
                   "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(port)}
            self.procs.append(subprocess.Popen(self.argv, env=env))
        log.info("started %d trainer ranks: pids %s", self.nproc, [p.pid for p in self.procs])
        return self

    def wait(self, poll_s: float = 0.2, timeout_s: float | None = None) -> int:
        """Until every rank has ended; the group's exit code (see the module docstring).
        `timeout_s`: kill the group and raise TimeoutError after that long."""
        main_ended: float | None = None
        started = time.monotonic()
        while True:
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                self.kill()
                raise TimeoutError(f"trainer ranks still running after {timeout_s}s: killed")
            codes = [p.poll() for p in self.procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                log.error("trainer rank %d ended with %s: ending the other ranks", rank,
                          _describe(code))
                self.kill()
                return 128 - code if code < 0 else code
            if all(c == 0 for c in codes):
                return 0
            if codes[0] == 0:
                main_ended = main_ended or time.monotonic()
                if time.monotonic() - main_ended > self.grace_s:
                    log.error("trainer ranks %s still running %.0fs after rank 0 ended: "
                              "killed", [r for r, c in enumerate(codes) if c is None],
                              self.grace_s)
                    self.kill()
                    return 1
            time.sleep(poll_s)

    def kill(self) -> None:
        """SIGTERM every rank still running; SIGKILL those left after `grace_s`."""
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            p.terminate()
        deadline = time.monotonic() + self.grace_s
        for p in running:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def forward_stop(self, signum: int, frame: FrameType | None) -> None:
        """Signal handler: the first SIGTERM/SIGINT to rank 0 (graceful stop), then kill."""
        self._terms += 1
        if self._terms == 1 and self.procs and self.procs[0].poll() is None:
            log.info("signal %d: rank 0 stops after the step in progress", signum)
            self.procs[0].send_signal(signal.SIGTERM)
        else:
            self.kill()


def run_ranks(nproc: int, grace_s: float, argv: Sequence[str] | None = None) -> int:
    """The service's `--nproc N`: runs `python -m services.trainer <same args>` as N ranks."""
    cmd = [sys.executable, "-m", "services.trainer", *(sys.argv[1:] if argv is None else argv)]
    group = RankGroup(cmd, nproc, grace_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, group.forward_stop)
    group.start()
    return group.wait()


def _describe(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
