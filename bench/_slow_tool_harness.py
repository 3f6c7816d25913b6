"""The bundled calc harness (examples/calc/harness.py) with a slow tool step: every tool call,
and at least one step per rollout, sleeps a lognormal time (median HARNESSRL_BENCH_TOOL_MEDIAN_S,
sigma HARNESSRL_BENCH_TOOL_SIGMA; median 0: no sleep). The draws are seeded by the task and the
rollout's index in its group, so each mode sees the same distribution of latencies."""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "calc"))
import harness  # noqa: E402

MEDIAN = float(os.environ.get("HARNESSRL_BENCH_TOOL_MEDIAN_S", "2.0"))
SIGMA = float(os.environ.get("HARNESSRL_BENCH_TOOL_SIGMA", "1.2"))
task_id = json.loads(os.environ["HARNESSRL_TASK_JSON"]).get("id", "")
rng = random.Random(f"{task_id}:{os.environ.get('HARNESSRL_INDEX_IN_GROUP', '0')}")
steps = 0


def tool_step() -> None:
    global steps
    steps += 1
    if MEDIAN > 0:
        time.sleep(rng.lognormvariate(math.log(MEDIAN), SIGMA))


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
