"""Progress that reads well both in a terminal and in a log (CI, `nohup`, a pipe).

In a terminal a phase shows rich's spinner. Anywhere else rich prints nothing until the end, so
a phase prints plain lines instead: when it starts, every `every_s` seconds while it runs
(elapsed, and the ETA when the usual duration is known), and when it ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console


def fmt_s(s: float) -> str:
    s = max(0.0, s)
    return f"{s:.0f}s" if s < 90 else f"{int(s // 60)}m{int(s % 60):02d}s"


def eta_text(elapsed: float, expected_s: float | None) -> str:
    if expected_s is None:
        return ""
    left = expected_s - elapsed
    return f", ETA {fmt_s(left)}" if left > 0 else ", taking longer than usual"


@contextmanager
def phase(console: Console, what: str, expected_s: float | None = None,
          every_s: float = 15.0) -> Iterator[None]:
    """Shows `what` while the block runs; `expected_s`: its usual duration (for the ETA)."""
    if console.is_terminal:
        with console.status(what):
            yield
        return
    t0 = time.monotonic()
    console.print(f"[harnessrl] {what}" + (f" (usually about {fmt_s(expected_s)})"
                                           if expected_s else ""), markup=False, highlight=False)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            el = time.monotonic() - t0
            console.print(f"[harnessrl] {what}: {fmt_s(el)} elapsed{eta_text(el, expected_s)}",
                          markup=False, highlight=False)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        console.print(f"[harnessrl] {what}: done in {fmt_s(time.monotonic() - t0)}",
                      markup=False, highlight=False)
