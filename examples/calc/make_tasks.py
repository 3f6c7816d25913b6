"""Writes the task files.

`python -m examples.calc.make_tasks [--n 128] [--seed 7]` writes the training tasks
(`tasks.jsonl`); `python -m examples.calc.make_tasks --heldout` writes the held-out evaluation
tasks (`heldout.jsonl`: 64 tasks, seed 8, ids `heldout-NNN`, no expression that is in
`tasks.jsonl`), which `tests/test_learning.py` and `bench/learning.py` evaluate the base and
the trained model on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from harnessrl.model.calc_task import make_task

HERE = Path(__file__).resolve().parent


def heldout_tasks(n: int, seed: int, exclude: set[str], prefix: str = "heldout") -> list[dict]:
    """n tasks drawn by `seed`, none whose expression is in `exclude` nor repeated."""
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < n:
        t = make_task(rng, f"{prefix}-{len(out):03d}")
        if t["expression"] not in seen:
            seen.add(t["expression"])
            out.append(t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--heldout", action="store_true",
                   help="write the held-out tasks (defaults: --n 64 --seed 8, heldout.jsonl)")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if a.heldout:
        train = {json.loads(x)["expression"]
                 for x in (HERE / "tasks.jsonl").read_text().splitlines() if x.strip()}
        tasks = heldout_tasks(a.n or 64, 8 if a.seed is None else a.seed, train)
        out = a.out or HERE / "heldout.jsonl"
    else:
        rng = random.Random(7 if a.seed is None else a.seed)
        tasks = [make_task(rng, f"calc-{i:03d}") for i in range(a.n or 128)]
        out = a.out or HERE / "tasks.jsonl"
    out.write_text("\n".join(json.dumps(t) for t in tasks) + "\n")


if __name__ == "__main__":
    main()
