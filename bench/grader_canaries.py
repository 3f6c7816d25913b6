"""What tamper evidence costs a SWE grade: the recipe's grader (`examples/swe/grader.py`) on
its first train task's gold fix, graded as a rollout is (a new runner per grade), in three arms
interleaved in one run:
- `before`: no canaries, tests unsandboxed (the grader before #42);
- `canaries`: canaries planted and checked, tests unsandboxed;
- `full`: canaries and the nested sandbox (the default).

    python bench/grader_canaries.py [--grades 30] [--out bench/results/grader_canaries.json]

Prints p50/p90 (ms) per arm and each arm's ratio to `before`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.swe import grader  # noqa: E402
from examples.swe.swe_tasks import load_swe_tasks  # noqa: E402
from examples.swe.workspace import apply_patch, prepare_workspace  # noqa: E402

TASKS = Path(__file__).resolve().parent.parent / "examples/swe/tasks/train.jsonl"
ARMS = {"before": {"canaries": False, "sandbox": False},
        "canaries": {"canaries": True, "sandbox": False},
        "full": {"canaries": True, "sandbox": True}}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grades", type=int, default=30, help="grades per arm")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    a = ap.parse_args()
    task = load_swe_tasks(TASKS)[0]
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "repo"
        prepare_workspace(task, ws)
        apply_patch(ws, task.patch)
        for i in range(a.grades + 1):
            for arm, opts in ARMS.items():
                start = time.perf_counter()
                g = grader.grade(task, ws, **opts)
                took = (time.perf_counter() - start) * 1000
                if g.reward != 1.0 or g.tampered:
                    raise SystemExit(f"{arm}: the gold fix graded {g.reward} ({g.reason})")
                if i:  # the first round warms the file cache
                    times[arm].append(took)
            print(f"\r{i}/{a.grades}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    base = statistics.median(times["before"])
    figures = {arm: {"p50_ms": round(statistics.median(t), 1), "p90_ms": round(pct(t, 0.9), 1),
                     "ratio_p50": round(statistics.median(t) / base, 3)}
               for arm, t in times.items()}
    for arm, f in figures.items():
        print(f"{arm:9s} p50 {f['p50_ms']:7.1f} ms  p90 {f['p90_ms']:7.1f} ms  "
              f"x{f['ratio_p50']:.3f} of before")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"grades": a.grades, "arms": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
