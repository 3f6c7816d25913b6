"""The learning proof's figures from its runs' own output: per seed the held-out pass@1 before
and after RL (the trainer's evaluations, `harnessrl up --eval-tasks`), the gain with its 95%
confidence interval (paired bootstrap over tasks; a seed run with `--no-eval-before` is paired
with the step-0 evaluation of another seed: the same warmed-up model), the same with samples
pooled over seeds, the training reward per step, and, for checkpoints copied out during the
runs, the exact probability of the right fix move on the held-out tasks
(`examples.swe.probe --exact`). Prints one JSON line and draws the curve (PNG).

    python -m examples.swe.curve --out OUT [--seeds 0 1] [--checkpoints DIR] [--png FILE]

OUT is `learning.py`'s --out (OUT/train-seedN/metrics.jsonl, OUT/model). DIR holds
checkpoints named `seedN-step-NNNNNN` (the trainer keeps only its last three, so copy them
out while it runs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.swe.learning import paired_bootstrap, task_rewards  # noqa: E402
from harnessrl.local.report import read_jsonl  # noqa: E402


def exact_p_right(model: Path, out: Path) -> float:
    """`probe --exact`'s held-out P(right fix move) of one model folder."""
    p = subprocess.run([sys.executable, "-m", "examples.swe.probe", str(model), "--out",
                        str(out), "--exact"], capture_output=True, text=True, check=True,
                       env=os.environ | {"OMP_NUM_THREADS": "1"})
    return float(json.loads(p.stdout.strip().splitlines()[-1])["p_right"])


def read_seed(out: Path, seed: int) -> dict[str, Any]:
    """A seed run's training rewards and time, and its evaluations' result files by step."""
    rows = read_jsonl(out / f"train-seed{seed}" / "metrics.jsonl")
    steps = [r for r in rows if r.get("kind") != "eval"]
    return {"rewards": [r.get("reward_mean") for r in steps],
            "train_s": round(sum(r.get("step_time_s") or 0.0 for r in steps)),
            "evals": {r["step"]: r["result"] for r in rows if r.get("kind") == "eval"}}


def pass1(rewards: dict[str, list[float]]) -> float:
    return sum(map(sum, rewards.values())) / sum(map(len, rewards.values()))


def summarize(out: Path, seed_list: list[int]) -> dict[str, Any]:
    """pass@1 before, and per seed after, with the gains (paired bootstrap over tasks)."""
    seeds = {s: read_seed(out, s) for s in seed_list}
    before_eval = next((v["evals"][0] for v in seeds.values() if 0 in v["evals"]), None)
    if before_eval is None:
        raise SystemExit("no seed evaluated the warmed-up model (step 0)")
    before = task_rewards(json.loads(Path(before_eval).read_text()))
    pooled: dict[str, list[float]] = {}
    summary: dict[str, Any] = {"pass@1_before": round(pass1(before), 4), "seeds": {}}
    for s, v in seeds.items():
        last = max(v["evals"], default=0)
        if last == 0:
            raise SystemExit(f"seed {s} has no evaluation after training")
        after = task_rewards(json.loads(Path(v["evals"][last]).read_text()))
        for tid, rw in after.items():
            pooled.setdefault(tid, []).extend(rw)
        summary["seeds"][s] = {"step": last, "pass@1_after": round(pass1(after), 4),
                               "gain": paired_bootstrap(before, after),
                               "train_s": v["train_s"], "reward_per_step": v["rewards"]}
    summary["pooled_gain"] = paired_bootstrap(before, pooled)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--checkpoints", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    a = ap.parse_args(argv)
    summary = summarize(a.out, a.seeds)
    exact: dict[int, dict[int, float]] = {}
    if a.checkpoints is not None:
        p0 = exact_p_right(a.out / "model", a.out)
        for s in a.seeds:
            exact[s] = {0: p0}
            for ck in sorted(a.checkpoints.glob(f"seed{s}-step-*")):
                step = int(re.sub(r".*-step-0*", "", ck.name) or 0)
                exact[s][step] = exact_p_right(ck, a.out)
        summary["exact_p_right"] = {s: {k: round(p, 4) for k, p in e.items()}
                                    for s, e in exact.items()}
    if a.png is not None:
        plot(summary, exact, a.png)
    print(json.dumps(summary))
    return 0


def plot(summary: dict[str, Any], exact: dict[int, dict[int, float]], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s, v in summary["seeds"].items():
        rewards = v["reward_per_step"]
        line = ax.plot(range(1, len(rewards) + 1), rewards, alpha=0.4, linestyle=":",
                       label=f"seed {s}: training reward (RL tasks)")[0]
        if s in exact:
            xs = sorted(exact[s])
            ax.plot(xs, [exact[s][x] for x in xs], color=line.get_color(), marker=".",
                    label=f"seed {s}: P(right fix), held-out (exact)")
        ax.plot([0, v["step"]], [summary["pass@1_before"], v["pass@1_after"]], marker="o",
                linestyle="--", color=line.get_color(),
                label=f"seed {s}: held-out pass@1 (k = 4)")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("swe example: mini-swe-agent, 30 held-out tasks")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
