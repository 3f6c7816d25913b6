"""The trainer's Prometheus series (rank 0, served on `metrics_bind`), set from each step's
metrics.jsonl row (`observe_step`).

- `harnessrl_trainer_step_phase_seconds{phase}`: generate, train, push and the whole step;
- `harnessrl_trainer_push_seconds`: weight pushes into the engines;
- `harnessrl_trainer_tokens_per_second`: tokens run through the model per second of training;
- `harnessrl_trainer_reward_mean`, `harnessrl_trainer_kl`, `harnessrl_trainer_entropy`,
  `harnessrl_trainer_loss`: of the last step (reward: its succeeded rollouts; the others: of its
  optimizer step, unchanged by a step that took none);
- `harnessrl_trainer_staleness`: policy versions between the trainer's weights and the oldest
  call of the last step (0 in sync mode);
- `harnessrl_trainer_step`, `harnessrl_trainer_policy_version`, `harnessrl_trainer_steps_total`.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from harnessrl.metrics import PHASE_BUCKETS

PHASES = Histogram("harnessrl_trainer_step_phase_seconds", "Wall time of a step's phases",
                   ["phase"], buckets=PHASE_BUCKETS)
PUSH = Histogram("harnessrl_trainer_push_seconds", "Wall time of a weight push",
                 buckets=PHASE_BUCKETS)
TOKENS_PER_S = Gauge("harnessrl_trainer_tokens_per_second",
                     "Tokens run through the model per second of the last step's training")
REWARD = Gauge("harnessrl_trainer_reward_mean", "Mean reward of the last step")
KL = Gauge("harnessrl_trainer_kl", "KL(behaviour || policy) estimate of the last optimizer step")
ENTROPY = Gauge("harnessrl_trainer_entropy", "Mean token entropy of the last optimizer step")
LOSS = Gauge("harnessrl_trainer_loss", "Loss of the last optimizer step")
STALENESS = Gauge("harnessrl_trainer_staleness",
                  "Policy versions between the trainer and the oldest call of the last step")
STEP = Gauge("harnessrl_trainer_step", "Steps done")
VERSION = Gauge("harnessrl_trainer_policy_version", "Policy version of the trainer's weights")
STEPS = Counter("harnessrl_trainer_steps", "Steps done by this process")
_PHASES = {"generate_s": "generate", "train_s": "train", "push_s": "push",
           "step_time_s": "step"}


def observe_step(row: dict[str, Any]) -> None:
    """Sets the series from one metrics.jsonl row (`records.Recorder.record`)."""
    for key, phase in _PHASES.items():
        PHASES.labels(phase).observe(row[key])
    if row["trained"]:
        PUSH.observe(row["push_s"])
    for gauge, key in ((TOKENS_PER_S, "tokens_per_s"), (REWARD, "reward_mean"), (KL, "kl"),
                       (ENTROPY, "entropy"), (LOSS, "loss"), (STALENESS, "staleness_max")):
        if row.get(key) is not None:
            gauge.set(row[key])
    STEP.set(row["step"])
    VERSION.set(row["policy_version"])
    STEPS.inc()
