"""Progress off a terminal (CI logs, nohup): plain lines with elapsed time and ETA."""

from __future__ import annotations

import io
import time

from rich.console import Console

from harnessrl.local.progress import phase
from harnessrl.local.train_job import step_line


def test_a_phase_prints_start_ticks_with_eta_and_end_when_not_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with phase(console, "starting vLLM", expected_s=100, every_s=0.2):
        time.sleep(0.5)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[harnessrl] starting vLLM (usually about 1m40s)"
    assert any(x.startswith("[harnessrl] starting vLLM: ") and " elapsed, ETA 1m" in x
               for x in lines[1:-1]), lines
    assert lines[-1].startswith("[harnessrl] starting vLLM: done in ")


def test_a_training_step_is_one_line_with_elapsed_and_eta() -> None:
    started = time.monotonic() - 60
    rows = [{"step": 1, "policy_version": 1, "reward_mean": 0.5, "step_time_s": 30.0},
            {"step": 2, "policy_version": 2, "reward_mean": None, "step_time_s": 30.0}]
    line = step_line(rows[1], 10, started, rows)
    assert line == ("[harnessrl] training: step 2/10, reward -, version 2, 30.0s; "
                    "60s elapsed, ETA 4m00s")
