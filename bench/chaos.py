"""Chaos, long form: trains the example on the real stack while killing (kill -9) every service
in turn, the engine included, at seeded random points, several rounds; prints one JSON line:
kills, rollouts in, trained, dropped by reason, trained twice (must be 0), lost (must be 0), the
recovery time after each kill (kill -> serving again), steps, wall time.

    python bench/chaos.py [--seed 0] [--steps 8] [--rounds 2] [--no-engine]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harnessrl.model import build_tiny_model
from harnessrl.testing.chaos import run_chaos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="times each service is killed")
    ap.add_argument("--no-engine", action="store_true", help="do not kill vLLM")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--model-dir", default=None, help="default: an un-warmed tiny model built "
                    "in seconds (the accounting is measured, not learning); every group is "
                    "then trained, equal rewards included")
    a = ap.parse_args()
    order = ("store", "gateway", "controller", "redis", "trainer") + \
        (() if a.no_engine else ("engine0",))
    work = Path(a.workdir or tempfile.mkdtemp(prefix="chaos-"))
    model = Path(a.model_dir) if a.model_dir else \
        build_tiny_model(work / "model", warmup_steps=0)
    res = run_chaos(work, model, seed=a.seed, steps=a.steps, kill_order=order * a.rounds,
                    gap_s=(3.0, 15.0), timeout_s=3600,
                    trainer_flags=() if a.model_dir else ("--no-advantage.filter-zero-variance",),
                    log=lambda m: print(m, file=sys.stderr, flush=True))
    for e in res.events:
        print("supervisor:", e, file=sys.stderr)
    print(json.dumps(res.line()))
    return 0 if res.lost == 0 and res.trained_twice == 0 and res.trainer_exit == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
