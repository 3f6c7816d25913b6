"""Following a run from the command line (`harnessrl up --rollouts-only`, `run`, `eval`)."""

from __future__ import annotations

import time
from collections import Counter

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harnessrl.local import progress
from harnessrl.statuses import TERMINAL
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import controller_pb2 as cpb


def follow_run(controller_address: str, run_id: str, console: Console | None = None) -> c.Run:
    """Shows a progress bar fed by WatchRun until the run ends (plain lines every 10 s when
    `console` is no terminal); returns the final run."""
    console = console or progress.cli_console()
    from harnessrl.clients import ControllerClient

    ctl = ControllerClient.connect(controller_address)
    total = ctl.get_run(run_id).num_rollouts or None
    states: dict[str, int] = {}
    if not console.is_terminal:  # a log: a plain line every 10 s and at the end
        t0 = last = time.monotonic()
        for event in ctl.watch_run(run_id):
            if event.kind == cpb.RunEvent.KIND_RUN_DONE:
                break
            states[event.rollout.rollout_id] = event.rollout.status
            if time.monotonic() - last > 10:
                last = time.monotonic()
                counts = Counter(states.values())
                progress.line(console, f"[harnessrl] rollouts: "
                              f"{sum(counts[s] for s in TERMINAL)}/{total or '?'} done, running "
                              f"{counts[c.ROLLOUT_STATUS_RUNNING]}, failed "
                              f"{counts[c.ROLLOUT_STATUS_FAILED]}; {progress.fmt_s(last - t0)} "
                              f"elapsed")
    else:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                      MofNCompleteColumn(), TextColumn("{task.fields[detail]}"),
                      TimeElapsedColumn(), console=console) as bar_progress:
            bar = bar_progress.add_task("rollouts", total=total, detail="")
            for event in ctl.watch_run(run_id):
                if event.kind == cpb.RunEvent.KIND_RUN_DONE:
                    break
                states[event.rollout.rollout_id] = event.rollout.status
                counts = Counter(states.values())
                bar_progress.update(bar, completed=sum(counts[s] for s in TERMINAL),
                                    detail=f"running {counts[c.ROLLOUT_STATUS_RUNNING]}  "
                                           f"failed {counts[c.ROLLOUT_STATUS_FAILED]}")
    run = ctl.get_run(run_id)
    ctl.close()
    return run
