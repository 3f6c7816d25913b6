"""What a tampered rollout's reward becomes: the run's `tampered_rewards` (RunSpec).

A grader that finds the agent's code forged the outcome it measured (a must-fail canary test
that passed, a rewritten verdict) says so: `"tampered": true` on its JSON line (the
per-attempt grader's, or a group grader's reward), with `"evidence"`. The grader's own reward
is overridden, whatever it printed: a tampered rollout never keeps a positive reward.

- `TAMPERED_REWARDS_ZERO` (the default; `UNSPECIFIED` is it): reward 0.0.
- `TAMPERED_REWARDS_PENALTY`: reward -`tampered_penalty` (a positive number; 0 takes
  `DEFAULT_PENALTY`, 1.0).
- `TAMPERED_REWARDS_DROP`: no reward at all. The rollout is kept and shown (SUCCEEDED,
  tampered, with its evidence, `has_reward` false) and the trainer learns nothing from it, as
  from a failed rollout: it is left out of its group and the group's advantages come from the
  others (services/trainer/samples.py; a group left with too few rollouts is skipped).

A rollout the per-attempt grader found tampered stays tampered when its group grader then
rewards it (the group grader's reward is overridden the same way). The store refuses a
positive reward for a tampered rollout whatever a caller sends (services/store/rewards.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping

from harnessrl.errors import InvalidArgument
from harnessrl.v1 import common_pb2 as c, store_pb2 as spb
from services.controller.grading import Grade

log = logging.getLogger("harnessrl.controller")

DEFAULT_PENALTY = 1.0
MAX_PENALTY = 1e6
POLICY_NAMES = {c.TAMPERED_REWARDS_UNSPECIFIED: "zero", c.TAMPERED_REWARDS_ZERO: "zero",
                c.TAMPERED_REWARDS_PENALTY: "penalty", c.TAMPERED_REWARDS_DROP: "drop"}


def normalize(s: c.RunSpec) -> None:
    """Checks the run's setting and fills in its defaults (run_spec.normalize calls it);
    InvalidArgument says what is wrong."""
    if s.tampered_rewards not in c.TamperedRewards.values():
        raise InvalidArgument(f"unknown tampered_rewards {s.tampered_rewards} (ZERO, PENALTY "
                              "or DROP)")
    if s.tampered_rewards == c.TAMPERED_REWARDS_UNSPECIFIED:
        s.tampered_rewards = c.TAMPERED_REWARDS_ZERO
    p = s.tampered_penalty
    if s.tampered_rewards != c.TAMPERED_REWARDS_PENALTY and p:
        raise InvalidArgument("tampered_penalty is for tampered_rewards PENALTY (it is "
                              f"{c.TamperedRewards.Name(s.tampered_rewards)})")
    if not math.isfinite(p) or p < 0 or p > MAX_PENALTY:
        raise InvalidArgument(f"tampered_penalty must be a positive number up to "
                              f"{MAX_PENALTY:g} (the reward is minus it; 0: {DEFAULT_PENALTY})")
    if s.tampered_rewards == c.TAMPERED_REWARDS_PENALTY:
        s.tampered_penalty = p or DEFAULT_PENALTY


def policy_name(spec: c.RunSpec) -> str:
    """"zero", "penalty" or "drop" (the metric's label)."""
    return POLICY_NAMES.get(spec.tampered_rewards, "zero")


def _reward(spec: c.RunSpec) -> float | None:
    """A tampered rollout's reward under the run's setting; None: no reward (DROP)."""
    if spec.tampered_rewards == c.TAMPERED_REWARDS_DROP:
        return None
    if spec.tampered_rewards == c.TAMPERED_REWARDS_PENALTY:
        return -(spec.tampered_penalty or DEFAULT_PENALTY)
    return 0.0


def applied(grade: Grade, spec: c.RunSpec, log_extra: Mapping[str, object] | None = None
            ) -> Grade:
    """`grade` with the run's reward for a tampered rollout (unchanged when not tampered);
    a tampered one is logged as a warning with its evidence (`log_extra`: the attempt's)."""
    if not grade.ok or not grade.tampered:
        return grade
    log.warning("its grader found the attempt TAMPERED: %s",
                grade.evidence or "(no evidence given)", extra=dict(log_extra or {}))
    reward = _reward(spec)
    return dataclasses.replace(grade, reward=0.0 if reward is None else reward,
                               dropped=reward is None)


def group_rewards(answer: list[spb.GroupReward], stored: list[c.Rollout], spec: c.RunSpec
                  ) -> list[spb.GroupReward]:
    """A group grader's rewards with the run's reward for each tampered rollout: those the
    group grader found tampered, and those the per-attempt grader found so before."""
    before = {ro.rollout_id: ro for ro in stored if ro.tampered}
    for r in answer:
        if r.rollout_id in before and not r.tampered:
            r.tampered, r.tamper_evidence = True, before[r.rollout_id].tamper_evidence
        if r.tampered:
            reward = _reward(spec)
            r.reward, r.reward_dropped = (0.0, True) if reward is None else (reward, False)
    return answer
