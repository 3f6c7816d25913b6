"""Chaos, long form: trains the example on the real stack while killing (kill -9) every service
in turn, the engine included, each in the phase it is meant to hit, several rounds; then
accounts for every rollout the run should have made (`harnessrl.testing.chaos_accounting`:
expected set from the seed and the task file, trained checked against Redis's
acknowledgements, each drop tied to a kill). Prints the kills with their recovery times (kill ->
serving again) and the drops with their kills on stderr, then one JSON line: kills done of
planned, recovery times, expected, rollouts in, trained, dropped by reason, by design (async:
stale, surplus), trained twice, lost, problems, steps, wall time. Exit 0 when every planned
kill was done and the accounting found no problem.

    python bench/chaos.py [--mode sync|async] [--seed 0] [--steps 8] [--rounds 2] [--no-engine]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harnessrl.testing.chaos import KILL_ORDER, run_chaos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="times each service is killed")
    ap.add_argument("--no-engine", action="store_true", help="do not kill vLLM")
    ap.add_argument("--gateway-replicas", type=int, default=2, help="gateways behind the "
                    "stack's balancer; 2 or more adds a rolling restart of them to each round")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--model-dir", default=None, help="default: an un-warmed tiny model built "
                    "in seconds (the accounting is measured, not learning)")
    a = ap.parse_args()
    from harnessrl.model import build_tiny_model  # torch: after --help

    order = KILL_ORDER + (() if a.no_engine else ("engine0",)) + \
        (("gateways",) if a.gateway_replicas > 1 else ())
    work = Path(a.workdir or tempfile.mkdtemp(prefix="chaos-"))
    model = Path(a.model_dir) if a.model_dir else \
        build_tiny_model(work / "model", warmup_steps=0)
    res = run_chaos(work, model, seed=a.seed, steps=a.steps, kill_order=order * a.rounds,
                    mode=a.mode, gap_s=(1.0, 8.0), timeout_s=3600,
                    gateway_replicas=a.gateway_replicas,
                    log=lambda m: print(m, file=sys.stderr, flush=True))
    err = sys.stderr
    for e in res.events:
        print("supervisor:", e, file=err)
    for k in res.kills:
        print(f"kill {k.label} ({k.phase}, trainer step {k.trainer_step}): back after "
              f"{'never' if k.recovery_s is None else f'{k.recovery_s:.2f}s'}", file=err)
    for d in res.acc.drops:
        print(f"drop {d['rollout']}: {d['reason']} <- {', '.join(d['kills']) or 'NO KILL'}",
              file=err)
    for p in res.acc.problems:
        print("PROBLEM:", p, file=err)
    print(f"workdir: {work}", file=err)
    print(json.dumps(res.line()))
    done = len(res.kills) == len(res.planned) and all(k.back is not None for k in res.kills)
    return 0 if done and res.acc.ok and res.trainer_exit == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
