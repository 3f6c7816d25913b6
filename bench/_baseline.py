"""An earlier commit's store and gateway beside today's, for `bench/gateway_overhead.py`.

`worktree(ref)` checks `ref` out into a temporary git worktree (removed afterwards, also on
failure); `start` runs a Redis of its own, that checkout's store and its gateway (the child
processes import `harnessrl` and `services` from the worktree: PYTHONPATH) with the flags both
versions take, and a running attempt, so the bench drives it with the loads it sends today's.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench._services import running_attempt, start_gateway, start_store
from harnessrl import procs
from harnessrl.identity import INSECURE_ENV, TLS_DIR_ENV

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="hrl-bench-baseline-"))
    src, git = tmp / "src", ["git", "-C", str(REPO)]
    try:
        r = subprocess.run([*git, "worktree", "add", "--detach", str(src), ref],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"--baseline {ref}: `git worktree add` failed (this needs a git "
                               f"checkout holding {ref}; --baseline '' skips the arm): "
                               f"{r.stderr.strip()}")
        yield src
    finally:
        if src.exists() and subprocess.run([*git, "worktree", "remove", "--force", str(src)],
                                           capture_output=True).returncode:
            shutil.rmtree(src, ignore_errors=True)
            subprocess.run([*git, "worktree", "prune"], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def start(src: Path, workdir: Path, secret: str, engines: list[dict[str, object]],
          rollout_id: str, started: list[procs.ServiceProcess]
          ) -> tuple[dict[str, procs.ServiceProcess], str, str]:
    """Redis, the store and gateway of checkout `src` (each appended to `started`); returns
    them by name, the gateway's chat completions URL and the key of `rollout_id`'s attempt."""
    # In plaintext (explicit insecure mode, loopback), as a checkout that predates
    # authentication (e4c7192 does) serves whatever it is given; today's arm is mTLS, so
    # `vs_baseline` includes what authentication costs.
    env = {"PYTHONPATH": str(src), TLS_DIR_ENV: "", INSECURE_ENV: "1"}
    redis_url, redis_proc = procs.start_redis(workdir / "redis")
    started.append(redis_proc)
    store_proc, store_addr = start_store(workdir, redis_url, env)
    started.append(store_proc)
    key = running_attempt(store_addr, rollout_id, secret, ident=None)
    gw_proc, gw = start_gateway(workdir, store_addr, secret, engines, env=env)
    started.append(gw_proc)
    return ({"gateway": gw_proc, "store": store_proc, "redis": redis_proc},
            f"http://127.0.0.1:{gw['http_port']}/v1/chat/completions", key)
