"""Grades one run of the Node harness (examples/node_sdk/harness.mjs), as the grade.py of
docs/getting-started.md ("Train your own harness, end to end") does: reward 1 when the task's
`expected` text is in `answer.txt` (in the working directory), else 0. The task comes from
`HARNESSRL_TASK_JSON`; the last stdout line is `{"reward": x}`. Stdlib only: any Python 3
runs it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def grade(answer: str | None, expected: str) -> tuple[float, str]:
    if answer is None:
        return 0.0, "no answer.txt"
    if expected in answer:
        return 1.0, "correct"
    return 0.0, f"{expected!r} not in the answer"


def main() -> int:
    task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
    path = Path.cwd() / "answer.txt"
    answer = path.read_text(errors="replace") if path.exists() else None
    reward, reason = grade(answer, str(task["expected"]))
    print(json.dumps({"reward": reward, "reason": reason}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
