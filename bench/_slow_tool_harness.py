"""The bundled calc harness (examples/calc/harness.py) with a slow tool step: every tool call,
and at least one step per rollout, sleeps a lognormal time (median HARNESSRL_BENCH_TOOL_MEDIAN_S,
sigma HARNESSRL_BENCH_TOOL_SIGMA; median 0: no sleep). The draws are paired across modes
(bench/_tool_draws.py): seeded by the bench's seed, the task id without the pool modes' prefix,
the rollout's index in its group and the count of draws of that (task, index) pair so far in
the run, each recorded in the bench's draws folder (HARNESSRL_BENCH_DRAWS_DIR)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "calc"))
sys.path.insert(0, str(REPO))
import harness  # noqa: E402

from bench._tool_draws import start_draw  # noqa: E402

draw = start_draw(os.environ)  # at start: the count follows the order rollouts start in
steps = 0


def tool_step() -> None:
    global steps
    steps += 1
    if draw is not None:
        time.sleep(draw.next_sleep())


_run_tool = harness.run_tool


def slow_run_tool(name: str, arguments: str) -> str:
    tool_step()
    return _run_tool(name, arguments)


harness.run_tool = slow_run_tool

if __name__ == "__main__":
    rc = harness.main()
    if steps == 0:  # the model called no tool: the rollout still has its tool step
        tool_step()
    sys.exit(rc)
