"""Progress off a terminal (CI logs, nohup): plain lines with elapsed time and ETA."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

from rich.console import Console

from harnessrl.local.progress import phase
from harnessrl.local.train_job import STEPS, step_line

# An event longer than any terminal or log viewer is wide.
LONG_WHAT = "starting vLLM on /a/model/folder/" + "with-a-long-name/" * 40


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


def test_each_phase_event_is_one_line_off_a_terminal_whatever_its_length() -> None:
    """A console that wraps (rich's 80 columns off a terminal) given a phase whose lines are
    longer: each event stays one line."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80)
    with phase(console, LONG_WHAT, expected_s=100, every_s=0.2):
        time.sleep(0.5)
    lines = out.getvalue().splitlines()
    assert all(x.startswith(f"[harnessrl] {LONG_WHAT}") for x in lines), lines
    assert lines[0] == f"[harnessrl] {LONG_WHAT} (usually about 1m40s)"
    assert len(lines) >= 3 and " elapsed, ETA 1m" in lines[1]
    assert lines[-1].startswith(f"[harnessrl] {LONG_WHAT}: done in ")


def test_the_commands_console_prints_long_events_as_one_line_each_into_a_pipe() -> None:
    """`harnessrl`'s own console with its output going to a pipe (a log, CI) and no COLUMNS:
    a training step, a supervisor event and an error, printed the way `harnessrl up` prints
    them, stay one line each."""
    rows = [{"step": 2, "policy_version": 2, "reward_mean": 0.281, "step_time_s": 44.3}]
    step = step_line(rows[0], 24, time.monotonic() - 93, rows)
    assert len(step) > 80  # the line of the issue: `ETA 18m` went on a line of its own
    event = f"[harnessrl] supervisor: engine0 restarted ({LONG_WHAT})"
    failed = f"trainer exited with 1; log {LONG_WHAT}trainer.log"
    code = ("from harnessrl.local.cli import console\n"
            f"console.print({step!r}, markup=False, highlight=False)\n"
            f"console.print({event!r}, markup=False, highlight=False)\n"
            f"console.print('[red]' + {failed!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60, check=True).stdout
    assert out.splitlines() == [step, event, failed]


def test_up_counts_steps_against_the_trainers_default_when_given_no_steps() -> None:
    """`harnessrl up` without --steps shows "step N/STEPS"; the trainer then trains its own
    default (the local job does not import the trainer's config to learn it)."""
    from services.trainer.config import TrainerConfig

    assert STEPS == TrainerConfig.model_fields["steps"].default
