"""The supervisor's events: one `Event` a line of `<state>/events.jsonl`, written by the
`Supervisor` (supervisor.py) and read back by `harnessrl status` (operate.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Event:
    """One supervisor event, as written to events.jsonl."""

    time: float
    service: str
    kind: str  # "died", "restarted", "restart_failed", "exited", "gave_up", "killed"
    exit_code: int | None = None
    detail: str = ""
    down_s: float | None = None  # "restarted": from seen dead to serving again

    def line(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.time))
        extra = f" exit {self.exit_code}" if self.exit_code is not None else ""
        down = f" after {self.down_s:.1f}s" if self.down_s is not None else ""
        return f"{when} {self.service} {self.kind}{extra}{down}{' - ' + self.detail if self.detail else ''}"
