"""Progress that reads well both in a terminal and in a log (CI, `nohup`, a pipe).

In a terminal a phase shows rich's spinner. Anywhere else rich prints nothing until the end, so
a phase prints plain lines instead: when it starts, every `every_s` seconds while it runs
(elapsed, and the ETA when the usual duration is known), and when it ends. Off a terminal each
event is one line, whatever its length: rich, which cannot ask a log for its width, would
otherwise wrap at 80 columns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console


def cli_console() -> Console:
    """The console of the `harnessrl` commands: rich's own in a terminal; anywhere else one
    that never wraps a line (tables still fit rich's 80 columns)."""
    console = Console()
    if not console.is_terminal:
        console.soft_wrap = True
    return console


def line(console: Console, text: str) -> None:
    """`text` as one plain line (no markup, no highlighting), never wrapped."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


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
    line(console, f"[harnessrl] {what}" + (f" (usually about {fmt_s(expected_s)})"
                                           if expected_s else ""))
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            el = time.monotonic() - t0
            line(console, f"[harnessrl] {what}: {fmt_s(el)} elapsed{eta_text(el, expected_s)}")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        line(console, f"[harnessrl] {what}: done in {fmt_s(time.monotonic() - t0)}")
