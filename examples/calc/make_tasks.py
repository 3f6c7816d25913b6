"""Writes the task file: `python -m examples.calc.make_tasks [--n 128] [--seed 7]`."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from harnessrl.model.calc_task import make_task

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=HERE / "tasks.jsonl")
    a = p.parse_args()
    rng = random.Random(a.seed)
    lines = [json.dumps(make_task(rng, f"calc-{i:03d}")) for i in range(a.n)]
    a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
