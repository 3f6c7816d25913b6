"""Evaluation runs: k samples of each task through the harness, grader and controller of
training, never trained on. Shared by `harnessrl eval` (harnessrl/local/evaluate.py) and the
trainer's evaluation during training (services/trainer/evaluation.py).

An evaluation run is an ordinary controller run with `group_size` = k whose `stream` is "-":
its completed groups are published to no stream, so no trainer ever reads them (the trainer
reads only its own stream). Because of that, its `sampling` may be anything (temperature 0.6,
a nucleus): `harnessrl.sampling` refuses such settings only for runs that can be trained on.

The result (`build_result`) is one JSON object, the same from the command line and from the
trainer (`<output_dir>/eval/step-<N>.json`), so any two can be compared (`harnessrl eval
--compare A.json B.json`):

    format            "harnessrl.eval/1"
    model             what was evaluated: {"kind": "base" | "checkpoint" | "model_dir" |
                      "url" | "policy", "path" or "url", "served_name", ...}
    tasks_file, tasks_sha256, tasks_in_file, tasks_evaluated, limit, seed
    harness, grader   argv lists
    k, threshold      samples per task; a sample passes when its reward >= threshold
    sampling          {"temperature", "top_p", "max_tokens"}: imposed on every call by the
                      gateway; null: the harness's own setting
    metrics           {"pass@1": .., ..., "pass@k": .., "avg@k": ..}: unbiased pass@j for j in
                      1..k (harnessrl.passk) and the mean reward over all samples, a failed
                      sample counting 0 and as not passed
    samples, samples_failed, calls_mean
    run_id, timings   {"rollouts_s", ...: seconds}, started_at (unix time)
    tasks             per task: task_id, n, c, rewards (null for a failed sample), avg,
                      pass@1, samples (rollout_id, index, status, reward, passed, calls,
                      attempts, duration_s, error, workdir, grader: the grader's JSON
                      without its reward, when it could be read), failures ({rollout_id,
                      index, reason}: every sample that failed, named, with why)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harnessrl.passk import pass_at_k
from harnessrl.v1 import common_pb2 as c

FORMAT = "harnessrl.eval/1"
EVAL_STREAM = "-"
"""The stream of evaluation runs: none (nothing is published, nothing can be trained on)."""


def sampling_policy(temperature: float | None = None, top_p: float | None = None,
                    max_tokens: int | None = None) -> c.SamplingPolicy | None:
    """The run's sampling policy from optional settings (None when none is set)."""
    fields = {k: v for k, v in (("temperature", temperature), ("top_p", top_p),
                                ("max_tokens", max_tokens)) if v is not None}
    return c.SamplingPolicy(**fields) if fields else None  # type: ignore[arg-type]


def sampling_dict(policy: c.SamplingPolicy | None) -> dict[str, Any]:
    names = ("temperature", "top_p", "max_tokens")
    if policy is None:
        return dict.fromkeys(names)
    return {n: getattr(policy, n) if policy.HasField(n) else None  # type: ignore[arg-type]
            for n in names}


def eval_spec(*, name: str, tasks: Sequence[tuple[str, dict[str, Any]]], k: int,
              harness_command: Sequence[str], grader_command: Sequence[str], model: str,
              sampling: c.SamplingPolicy | None = None, concurrency: int = 8,
              timeout_s: float = 300.0, grader_timeout_s: float = 60.0, max_attempts: int = 1,
              env: dict[str, str] | None = None, backend: str = "",
              sandbox: c.SandboxSpec | None = None, setup_command: Sequence[str] = (),
              setup_timeout_s: float = 0.0) -> c.RunSpec:
    """The controller run of an evaluation: each task `k` times, published to no stream."""
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k})")
    spec = c.RunSpec(
        name=name, tasks=[c.Task(task_id=tid, data_json=json.dumps(data, sort_keys=True))
                          for tid, data in tasks],
        group_size=k, harness_command=list(harness_command),
        grader_command=list(grader_command),
        reward_source=(c.REWARD_SOURCE_GRADER_JSON if grader_command
                       else c.REWARD_SOURCE_HARNESS),
        concurrency=concurrency, timeout_s=timeout_s, grader_timeout_s=grader_timeout_s,
        max_attempts=max_attempts, env=dict(env or {}), stream=EVAL_STREAM, model=model,
        backend=backend)
    if sampling is not None:
        spec.sampling.CopyFrom(sampling)
    if sandbox is not None:
        spec.sandbox.CopyFrom(sandbox)
    spec.setup_command[:] = list(setup_command)
    spec.setup_timeout_s = setup_timeout_s if setup_command else 0.0
    return spec


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_grader_output(ro: c.Rollout) -> dict[str, Any] | None:
    """The grader's last stdout line (its JSON) minus the reward, read from the final
    attempt's workdir when this machine has it (the local job backend); else None."""
    if not ro.attempts or not ro.attempts[-1].workdir:
        return None
    path = Path(ro.attempts[-1].workdir) / "grader.stdout.log"
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
        obj = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    if not isinstance(obj, dict):
        return None
    obj.pop("reward", None)
    return obj


def _failure_reason(ro: c.Rollout) -> str:
    if ro.error:
        return ro.error
    if ro.status == c.ROLLOUT_STATUS_CANCELLED:
        return "cancelled"
    if ro.status == c.ROLLOUT_STATUS_SUCCEEDED:
        return ""
    return f"ended {c.RolloutStatus.Name(ro.status)}"


def sample_record(ro: c.Rollout, threshold: float,
                  grader: Callable[[c.Rollout], dict[str, Any] | None] | None = None
                  ) -> dict[str, Any]:
    ok = ro.status == c.ROLLOUT_STATUS_SUCCEEDED and ro.has_reward
    last = ro.attempts[-1] if ro.attempts else None
    rec: dict[str, Any] = {
        "rollout_id": ro.rollout_id, "index": ro.index_in_group,
        "status": c.RolloutStatus.Name(ro.status).removeprefix("ROLLOUT_STATUS_"),
        "reward": ro.reward if ok else None, "passed": bool(ok and ro.reward >= threshold),
        "calls": last.num_calls if last else 0, "attempts": len(ro.attempts),
        "duration_s": (round(last.finished_at - last.started_at, 3)
                       if last and last.finished_at and last.started_at else None),
        "error": "" if ok else _failure_reason(ro),
        "workdir": last.workdir if last else "",
    }
    if grader is not None and ok:
        rec["grader"] = grader(ro)
    return rec


def task_outcomes(task_ids: Sequence[str], rollouts: Sequence[c.Rollout], k: int,
                  threshold: float,
                  grader: Callable[[c.Rollout], dict[str, Any] | None] | None = None
                  ) -> list[dict[str, Any]]:
    """Per task (in `task_ids` order): its samples, c of n passed, pass@1..k. A task with
    fewer than k rollouts in the store (the run was cut short) counts its missing samples as
    failed, named "missing"."""
    by_task: dict[str, list[c.Rollout]] = {t: [] for t in task_ids}
    for ro in rollouts:
        if ro.task_id in by_task:
            by_task[ro.task_id].append(ro)
    out = []
    for tid in task_ids:
        ros = sorted(by_task[tid], key=lambda r: r.index_in_group)
        samples = [sample_record(r, threshold, grader) for r in ros]
        have = {s["index"] for s in samples}
        samples += [{"rollout_id": "", "index": i, "status": "MISSING", "reward": None,
                     "passed": False, "calls": 0, "attempts": 0, "duration_s": None,
                     "error": "missing: no such rollout in the store", "workdir": ""}
                    for i in range(k) if i not in have]
        samples.sort(key=lambda s: s["index"])
        n, passed = len(samples), sum(s["passed"] for s in samples)
        rewards = [s["reward"] for s in samples]
        row: dict[str, Any] = {
            "task_id": tid, "n": n, "c": passed, "rewards": rewards,
            "avg": sum(r or 0.0 for r in rewards) / n if n else 0.0,
            "pass@1": pass_at_k(n, passed, 1) if n else 0.0, "samples": samples,
            "failures": [{"rollout_id": s["rollout_id"], "index": s["index"],
                          "reason": s["error"]} for s in samples if s["reward"] is None]}
        out.append(row)
    return out


def metrics(outcomes: Sequence[dict[str, Any]], k: int) -> dict[str, float]:
    """pass@1..pass@k (means over tasks of the unbiased estimator) and avg@k."""
    if not outcomes:
        raise ValueError("no tasks evaluated")
    m = {f"pass@{j}": sum(pass_at_k(t["n"], t["c"], j) for t in outcomes) / len(outcomes)
         for j in range(1, k + 1)}
    m[f"avg@{k}"] = sum(t["avg"] for t in outcomes) / len(outcomes)
    return m


def build_result(*, model: dict[str, Any], tasks_file: str | Path, tasks_in_file: int,
                 task_ids: Sequence[str], rollouts: Sequence[c.Rollout], k: int,
                 threshold: float, harness: Sequence[str], grader: Sequence[str],
                 sampling: c.SamplingPolicy | None, run_id: str, started_at: float,
                 timings: dict[str, float], limit: int | None = None, seed: int | None = None,
                 grader_output: Callable[[c.Rollout], dict[str, Any] | None] | None = None,
                 **extra: Any) -> dict[str, Any]:
    """The evaluation's JSON object (see the module docstring)."""
    outcomes = task_outcomes(task_ids, rollouts, k, threshold, grader_output)
    samples = [s for t in outcomes for s in t["samples"]]
    return {
        "format": FORMAT, "model": model, "tasks_file": str(tasks_file),
        "tasks_sha256": file_sha256(tasks_file), "tasks_in_file": tasks_in_file,
        "tasks_evaluated": len(outcomes), "limit": limit, "seed": seed,
        "harness": list(harness), "grader": list(grader), "k": k, "threshold": threshold,
        "sampling": sampling_dict(sampling), "metrics": metrics(outcomes, k),
        "samples": len(samples),
        "samples_failed": sum(1 for s in samples if s["reward"] is None),
        "calls_mean": sum(s["calls"] for s in samples) / len(samples) if samples else 0.0,
        "run_id": run_id, "started_at": started_at,
        "timings": {k_: round(v, 3) for k_, v in timings.items()},
        **extra, "tasks": outcomes}
