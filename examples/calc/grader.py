"""Grades one run of the calculator harness: reward 1 when the last integer in `answer.txt`
(in the working directory) equals the task's answer, else 0. The task comes from
`HARNESSRL_TASK_JSON`. The last stdout line is `{"reward": x}`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path


def grade(answer_text: str | None, expected: int) -> tuple[float, str]:
    if answer_text is None:
        return 0.0, "no answer.txt"
    numbers = re.findall(r"-?\d+", answer_text)
    if not numbers:
        return 0.0, "no number in the answer"
    if int(numbers[-1]) != expected:
        return 0.0, f"answered {numbers[-1]}, expected {expected}"
    return 1.0, "correct"


def main() -> int:
    task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
    path = Path.cwd() / "answer.txt"
    text = path.read_text(errors="replace") if path.exists() else None
    reward, reason = grade(text, int(task["answer"]))
    print(json.dumps({"reward": reward, "reason": reason}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
