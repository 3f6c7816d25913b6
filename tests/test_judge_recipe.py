"""The judge-only recipe (examples/cite) trained end to end with `harnessrl up --judge`: the
tiny model is the policy and, on the same engine, the judge (the group grader, run by the
controller). A 0.7M-parameter model does not judge well — not the point: the point is that the
loop runs on judge rewards alone, the judge's calls are not recorded as training calls, and a
group whose rewards differ is trained and pushed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parent.parent
CITE = REPO / "examples" / "cite"


def test_cite_recipe_trains_on_judge_rewards(tmp_path: Path, redis_url: str,
                                             key_prefix: str, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "harnessrl.local.cli", "up", "--harness",
         f"{sys.executable} {CITE / 'harness.py'}", "--tasks", str(CITE / "tasks.jsonl"),
         "--judge", "--judge-config", str(CITE / "judge.json"), "--steps", "2",
         "--tasks-per-step", "4", "--group-size", "4", "--concurrency", "8",
         "--state-dir", str(tmp_path / "state"), "--output-dir", str(out),
         "--redis-url", redis_url, "--key-prefix", key_prefix],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    groups = sorted((tmp_path / "state" / "rollouts").glob("*/groups/*/try-*"))
    unjudged = {g.relative_to(tmp_path): (g / "stderr.log").read_text()[-600:] for g in groups
                if not (g / "output.json").exists() and (g / "stderr.log").exists()}
    assert len(steps) == 2 and all(s["rollouts_failed"] == 0 for s in steps), (steps, unjudged)
    answers = [json.loads(a.read_text()) for a in (tmp_path / "state" / "rollouts").glob(
        "*/groups/*/try-1/output.json")]
    assert len(answers) == 8  # one judge answer per group
    for judged in answers:
        assert judged["judge"]["model"] == "tiny" and len(judged["rewards"]) == 4
        assert {"judge"} == set(judged["rewards"][0]["parts"])
        assert all(0.0 <= x["reward"] <= 1.0 for x in judged["rewards"])
        assert judged["judge"]["prompt_tokens"] > 0 and judged["judge"]["completion_tokens"] > 0
    print("JUDGE-COST " + json.dumps([{k: a["judge"][k] for k in (
        "calls", "prompt_tokens", "completion_tokens", "seconds")} for a in answers]))
    # a group whose judge rewards differ is trained and pushed. The tiny judge samples at
    # temperature 1 and ties often (about half the groups measured: all four answers given
    # the top score); of 8 groups at least one differs unless it ties 8 times in a row.
    differ = [a for a in answers if len({x["reward"] for x in a["rewards"]}) > 1]
    assert differ, "the judge tied every group: nothing to learn from (rerun: 1 in ~250)"
    for s in steps:
        assert s["trained"] == (s["groups_trained"] > 0), s
    assert sum(s["groups_trained"] for s in steps) >= 1
    assert steps[-1]["policy_version"] >= 1, "no push"
    # the store's recorded calls are the harnesses' alone: one call per rollout, no judge call
    r = redis.Redis.from_url(redis_url)
    rollouts = list(r.scan_iter(f"{key_prefix}ro:*"))
    calls = sum(r.hlen(k) for k in r.scan_iter(f"{key_prefix}calls:*"))
    assert len(rollouts) == 32 and calls == 32


def test_up_refuses_judge_combinations_it_cannot_run(tmp_path: Path) -> None:
    """--judge in collocated mode (its calls would wait behind the hold), with --group-grader,
    or with --eval-tasks and no per-attempt grader: refused before anything starts."""
    base = [sys.executable, "-m", "harnessrl.local.cli", "up", "--harness", "true", "--tasks",
            str(CITE / "tasks.jsonl"), "--state-dir", str(tmp_path / "state")]
    for extra, why in ((["--judge", "--mode", "collocated"], "collocated mode"),
                       (["--judge", "--group-grader", "x"], "not with --group-grader"),
                       (["--judge", "--eval-tasks", str(CITE / "tasks.jsonl")],
                        "evaluation runs no group grader")):
        p = subprocess.run(base + extra, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and why in " ".join((p.stdout + p.stderr).split()), p.stdout
