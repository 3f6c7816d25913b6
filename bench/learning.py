"""The learning check of tests/test_learning.py over several seeds: its pass rate, and what each
run's answers looked like step by step.

One stack (Redis, store, gateway, controller, one vLLM engine on the tiny model with gloo weight
transfer), then per seed the trainer service on the test's flags (`TRAINER_FLAGS`: 12 sync
steps of 4 tasks x 8 on the calc example, lr 6e-4, an evaluation of the held-out tasks
`examples/calc/heldout.jsonl` before the first step and after the last) with `--seed S`, one
after the other. Each run is checked as the test checks it (`learned`: held-out mean reward of
the final model minus the base model's >= `MARGIN`), on the same numbers.

Reported per seed: the per-step training reward curve, the held-out figures (base, final,
gain), pass or fail, the wall time, and per step what the recorded transcripts show of the
final answers (`answers`: the share of rollouts whose last reply stopped on `max_tokens`
(finish_reason "length": the answer lost `<|im_end|>`, docs/modes.md), copied ("The answer
is"), guessed ("I estimate"), anything else, and the mean length of the last reply in
characters). Per seed, the held-out gain's noise: the base evaluation's standard error of
avg@k (samples as Bernoulli draws) and of the gain.

Each finished seed is appended to OUT/runs.jsonl; `--resume` keeps the seeds that file holds
(same flags) and runs the others. Ends with OUT/results.json and one JSON line.

    python bench/learning.py --out /tmp/bench-learning            # seeds 0..4, ~8 min each
    python bench/learning.py --out /tmp/bench-learning --resume   # go on after a stop
    python bench/learning.py --seeds 1 --out /tmp/bench-learning  # one seed
    python bench/learning.py --seeds 1 --lr 1e-12 --steps 2 --out /tmp/bench-lr0  # planted fault
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from harnessrl import procs  # noqa: E402
from harnessrl.local.stack import Stack, StackConfig  # noqa: E402
from harnessrl.model.build import weights_digest  # noqa: E402
from test_learning import (MARGIN, TRAINER_FLAGS, WALL_LIMIT_S, learned,  # noqa: E402
                           learning_summary, start_trainer, store_evidence)


def answer_stats(rollouts: Path, run_name: str) -> dict[str, dict[str, Any]]:
    """Per controller run of `run_name` (its training steps and evaluations), what the final
    replies of its rollouts were, from the harness's transcripts."""
    per: dict[str, list[dict[str, Any]]] = defaultdict(list)
    # <rollouts>/<controller run>/<task>-<i>/attempt-<n>/work/transcript.jsonl
    last_attempt: dict[Path, Path] = {}
    for t in sorted(rollouts.glob(f"{run_name}-*/*/attempt-*/work/transcript.jsonl"),
                    key=lambda t: int(t.parts[-3].split("-")[1])):
        last_attempt[t.parents[2]] = t
    for rollout, t in sorted(last_attempt.items()):
        lines = [json.loads(x) for x in t.read_text().splitlines() if x.strip()]
        if lines:
            per[rollout.parent.name].append(lines[-1])
    out = {}
    for run, last in sorted(per.items()):
        content = [str(x.get("content") or "") for x in last]
        n = len(last)
        out[run] = {
            "n": n,
            "length": round(sum(x.get("finish_reason") == "length" for x in last) / n, 3),
            "copy": round(sum(c.startswith("The answer is") for c in content) / n, 3),
            "guess": round(sum(c.startswith("I estimate") for c in content) / n, 3),
            "other": round(sum(not c.startswith(("The answer is", "I estimate"))
                               for c in content) / n, 3),
            "chars_mean": round(statistics.fmean(len(c) for c in content), 1),
            "example": next((c[:80] for c in content
                             if not c.startswith(("The answer is", "I estimate"))), None)}
    return out


def noise(summary: dict[str, Any]) -> dict[str, float | None]:
    """Standard errors of the held-out figures, each sample a Bernoulli draw of its mean."""
    n = summary["heldout_samples"][0] if summary["heldout_samples"] else 0
    b, f = summary["heldout_base"], summary["heldout_final"]
    if not n or b is None:
        return {"base_se": None, "gain_se": None}
    se_b = math.sqrt(b * (1 - b) / n)
    se_f = math.sqrt(f * (1 - f) / n) if f is not None else 0.0
    return {"base_se": round(se_b, 4), "gain_se": round(math.hypot(se_b, se_f), 4)}


def run_seed(stack: Stack, out: Path, model: Path, seed: int,
             extra: Sequence[str] = ()) -> dict[str, Any]:
    name = f"learn-s{seed}"
    started = time.monotonic()
    trainer, flags = start_trainer(stack, out / name, model, name,
                                   ["--seed", str(seed), *extra])
    try:
        trainer.proc.wait(WALL_LIMIT_S)
    except Exception:
        pass
    finally:
        if trainer.alive:
            trainer.stop()
    wall = time.monotonic() - started
    metrics = out / name / "out" / "metrics.jsonl"
    lines = ([json.loads(x) for x in metrics.read_text().splitlines()]
             if metrics.exists() else [])
    s = {**learning_summary(lines), **(store_evidence(stack, lines) if lines else {})}
    return {"seed": seed, "returncode": trainer.proc.returncode, "wall_s": round(wall, 1),
            "passed": trainer.proc.returncode == 0 and learned(s), **s, **noise(s),
            "model_weights": weights_digest(model),
            "answers": answer_stats(stack.state / "rollouts", name),
            "flags": flags}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(".harnessrl/bench-learning"))
    ap.add_argument("--lr", default=None,
                    help="the trainer's learning rate instead of the test's (a planted fault: "
                         "1e-12 learns nothing, and the check must fail)")
    ap.add_argument("--steps", default=None,
                    help="steps instead of the test's (with --lr 1e-12: a shorter planted "
                         "fault; the check compares the held-out evaluations only)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the seeds OUT/runs.jsonl holds, run the others")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    from harnessrl.model import build_tiny_model, default_model_dir

    model = build_tiny_model(default_model_dir())
    a.out.mkdir(parents=True, exist_ok=True)
    runs_file = a.out / "runs.jsonl"
    done = ([json.loads(x) for x in runs_file.read_text().splitlines() if x.strip()]
            if a.resume and runs_file.exists() else [])
    extra = (["--optimizer.lr", a.lr] if a.lr else []) + (["--steps", a.steps] if a.steps else [])
    want = {**TRAINER_FLAGS, **dict(zip(extra[::2], extra[1::2]))}
    done = [r for r in done if r["flags"] == {**want, "--seed": str(r["seed"])}]
    if not a.resume:
        runs_file.write_text("")
    seeds = [s for s in range(a.first_seed, a.first_seed + a.seeds)
             if s not in {r["seed"] for r in done}]
    results = list(done)
    if seeds:
        shutil.rmtree(a.out / "stack", ignore_errors=True)
        cfg = StackConfig(state_dir=a.out / "stack",
                          redis_url=f"redis://127.0.0.1:{procs.free_port()}/0",
                          key_prefix="bench-learning:", model_dir=model,
                          served_model_name="tiny", weight_transfer_backend="gloo")
        with Stack(cfg) as stack:
            # the trainer's identity and engine key, as tests/conftest.py gives the test's
            os.environ[procs.TLS_ROOT_ENV] = str(stack.tls)
            os.environ.update(stack.engine_env("trainer"))
            for seed in seeds:
                with open("/proc/loadavg") as f:
                    load = f.read().split()[:3]
                r = {**run_seed(stack, a.out, model, seed, extra), "load_before": load}
                with runs_file.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                results.append(r)
                print(f"seed {seed}: {'PASS' if r['passed'] else 'FAIL'} held-out "
                      f"{r['heldout_base']} -> {r['heldout_final']} (gain "
                      f"{r['heldout_gain']}, se {r['gain_se']}), curve {r['curve']}, "
                      f"{r['wall_s']} s", flush=True)
                for run, st in r["answers"].items():
                    print(f"    {run}: {st}", flush=True)
    results.sort(key=lambda r: r["seed"])
    line = {
        "margin": MARGIN, "lr": want["--optimizer.lr"], "steps": want["--steps"],
        "seeds": [r["seed"] for r in results],
        "passed": sum(r["passed"] for r in results), "runs": len(results),
        "pass_rate": round(sum(r["passed"] for r in results) / len(results), 3)
        if results else None,
        "heldout": {r["seed"]: [r["heldout_base"], r["heldout_final"], r["heldout_gain"]]
                    for r in results},
        "base_mean": (round(statistics.fmean(r["heldout_base"] for r in results
                                             if r["heldout_base"] is not None), 4)
                      if any(r["heldout_base"] is not None for r in results) else None),
        "curves": {r["seed"]: r["curve"] for r in results},
        "wall_s": {r["seed"]: r["wall_s"] for r in results}}
    (a.out / "results.json").write_text(json.dumps({**line, "runs": results}, indent=1))
    print(json.dumps(line))


if __name__ == "__main__":
    main()
