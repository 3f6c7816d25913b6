"""Evaluation during training: `Trainer.evaluate` (called by `train_sync` / `train_async`
before the first step and after each step) has rank 0's `Evaluator` run the evaluation due.

When (settings `eval.*`, config.EvalConfig): at step 0 before training (`before_training`),
after every `every`-th step and after the last (`at_end`); never after a stop request. Rank 0
alone evaluates (the other ranks wait at their next collective; the object group's timeout
covers `run_timeout_s`). After step s the engines serve the weights of step s: the eval comes
after the step's push and checkpoint. Async and collocated modes evaluate at the same point,
between steps: the pool's rollouts keep running meanwhile (the admission window bounds them,
and no call is held: collocated holds calls only while it trains and pushes), so the groups
they complete are on the same weights and fresh for the next step.

How: one controller run `<run prefix>-eval-step<NNNNNN>` (idempotent: a trainer restarted in
the middle re-attaches to it) of the eval tasks, `group_size` = `eval.k`, through the eval
harness and grader (default: the training run's), with the eval sampling settings imposed by
the gateway, published to no stream (`harnessrl.evaluation`): its groups never reach this or
any trainer. Its rollouts are read back from the store and scored with the unbiased pass@k
estimator (`harnessrl.passk`).

Recorded:

- `<output_dir>/eval/step-<NNNNNN>.json`: the `harnessrl eval` result (every task and sample,
  failures with their reasons), so `harnessrl eval --compare` compares any two;
- one line in `metrics.jsonl`:

      kind             "eval"
      step             int    steps trained before it (0: the initial weights)
      policy_version   int    the weights evaluated
      run_id           str    the controller run
      time             float  unix time it ended
      k, tasks, samples, samples_failed
                       int    samples per task, tasks, all samples, failed ones (harness
                              crash, grader error, timeout: counted as not passed, reward 0)
      pass@1 .. pass@k float  unbiased pass@j, mean over tasks
      avg@k            float  (the key names k, e.g. avg@4) mean reward of all samples
      calls_mean       float  model calls per sample
      eval_s           float  wall time of the run
      result           str    the JSON file above

  A resumed trainer drops lines of steps after its checkpoint, evaluations included (they are
  redone, on the same run ids); an evaluation due at the checkpoint's step and missing from the
  file (the trainer died during it) is run at start;
- TensorBoard and W&B: each number under `eval/<field>` at the step (tracking.py);
- `harnessrl report`: the eval curve and table.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from harnessrl.clients import StoreClient
from harnessrl.evaluation import build_result, eval_spec, sampling_policy
from harnessrl.tasks import load_task_file
from harnessrl.v1 import common_pb2 as c

from .checkpoint import TrainState
from .config import TrainerConfig
from .control import TrainerControl
from .outputs import append_jsonl, read_jsonl
from .rollouts import RunLauncher, run_sandbox
from .tracking import Trackers

log = logging.getLogger("harnessrl.trainer")


def due(cfg: TrainerConfig, step: int) -> bool:
    """Whether an evaluation follows `step` (0: before training)."""
    e = cfg.eval
    if not e.enabled:
        return False
    if step == 0:
        return e.before_training
    return (e.every > 0 and step % e.every == 0) or (e.at_end and step >= cfg.steps)


def eval_run_id(prefix: str, step: int) -> str:
    return f"{prefix}-eval-step{step:06d}"


def result_path(output: Path, step: int) -> Path:
    return output / "eval" / f"step-{step:06d}.json"


def recorded(metrics_file: Path, step: int) -> bool:
    return any(r.get("kind") == "eval" and r.get("step") == step
               for r in read_jsonl(metrics_file))


def eval_tasks(cfg: TrainerConfig) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    """(tasks in the file, the tasks evaluated: the first `eval.limit`, or all)."""
    tasks = load_task_file(cfg.eval.tasks_file)
    return len(tasks), tasks[:cfg.eval.limit] if cfg.eval.limit else tasks


class Evaluator:
    """Rank 0's evaluations: runs them through `launcher`, reads their rollouts from `store`,
    records them (the module docstring) in `output`, metrics.jsonl and the `trackers`."""

    def __init__(self, cfg: TrainerConfig, launcher: RunLauncher | None,
                 store: StoreClient | None, control: TrainerControl, output: Path,
                 trackers: Trackers | None) -> None:
        self.cfg, self.launcher, self.store = cfg, launcher, store
        self.control, self.output, self.trackers = control, output, trackers

    def evaluate_if_due(self, state: TrainState, checkpoint: Path | None
                        ) -> dict[str, Any] | None:
        """Runs and records the evaluation due after the trainer's current step (`state`;
        `checkpoint`: that step's, if written); returns its metrics.jsonl line (None when none
        is due or it is recorded already)."""
        cfg, step, policy_version = self.cfg, state.step, state.policy_version
        run_prefix = state.run_prefix
        if cfg.eval.enabled and step == 0 and not cfg.eval.before_training:
            eval_tasks(cfg)  # a bad task file stops the trainer now, not after `every` steps
        if not due(cfg, step) or recorded(cfg.metrics_file, step):
            return None
        assert self.launcher is not None and self.store is not None
        self.control.set_state("evaluating")
        e = cfg.eval
        in_file, tasks = eval_tasks(cfg)
        harness = e.harness_command or cfg.harness_command
        grader = e.grader_command or cfg.grader_command
        sampling = sampling_policy(e.temperature, e.top_p, e.max_tokens)
        spec = eval_spec(name=f"{cfg.run_name}-eval", tasks=tasks, k=e.k,
                         harness_command=harness, grader_command=grader,
                         model=cfg.served_model_name, sampling=sampling,
                         concurrency=cfg.concurrency, timeout_s=cfg.rollout_timeout_s,
                         grader_timeout_s=cfg.grader_timeout_s, max_attempts=cfg.max_attempts,
                         env=cfg.harness_env, backend=cfg.rollout_backend,
                         sandbox=run_sandbox(cfg), setup_command=cfg.setup_command,
                         setup_timeout_s=cfg.setup_timeout_s)
        run_id = eval_run_id(run_prefix, step)
        started, t0 = time.time(), time.perf_counter()
        log.info("step %d: evaluating policy version %d on %d tasks x %d (run %s)", step,
                 policy_version, len(tasks), e.k, run_id, extra={"step": step})
        run = self.launcher.run(run_id, spec)
        if run.status != c.RUN_STATUS_SUCCEEDED:
            raise RuntimeError(f"eval run {run_id} ended {c.RunStatus.Name(run.status)}: "
                               f"{run.error}")
        eval_s = time.perf_counter() - t0
        rollouts = self.store.list_rollouts(run_id).rollouts
        model = {"kind": "policy", "step": step, "policy_version": policy_version,
                 "served_name": cfg.served_model_name, "trainer_run": run_prefix,
                 "checkpoint": str(checkpoint) if checkpoint else None}
        result = build_result(
            model=model, tasks_file=Path(e.tasks_file).resolve(),
            tasks_in_file=in_file, task_ids=[tid for tid, _ in tasks],
            rollouts=rollouts, k=e.k, threshold=e.threshold, harness=harness, grader=grader,
            sampling=sampling, run_id=run_id, started_at=started,
            timings={"rollouts_s": eval_s}, limit=e.limit or None)
        path = result_path(self.output, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(path)
        row: dict[str, Any] = {
            "kind": "eval", "step": step, "policy_version": policy_version,
            "run_id": run_id, "time": time.time(), "k": e.k, "tasks": len(tasks),
            "samples": result["samples"], "samples_failed": result["samples_failed"],
            **result["metrics"], "calls_mean": result["calls_mean"], "eval_s": eval_s,
            "result": str(path)}
        append_jsonl(cfg.metrics_file, row)
        if self.trackers is not None:
            self.trackers.log_eval(row)
        log.info("step %d: eval %s", step, ", ".join(f"{k} {v:.3f}" for k, v in
                                                   result["metrics"].items()),
                 extra={"step": step, "run": run_id})
        return row
