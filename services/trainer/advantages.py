"""Group-relative advantages: one scalar per rollout, from the rewards of its group.

Estimators (rewards r_1..r_n of the n rollouts of one group, mean m = sum(r) / n):

- ``grpo``    (DeepSeekMath):  A_i = (r_i - m) / (std(r) + eps), ``std`` the sample standard
  deviation (divisor n - 1, as ``torch.std`` and the GRPO reference implementations use).
- ``dr_grpo`` (Dr. GRPO, "Understanding R1-Zero-like training"): A_i = r_i - m, no division by
  the standard deviation (which up-weights groups whose rewards barely differ).
- ``rloo``    (REINFORCE leave-one-out): A_i = r_i - mean of the other n - 1 rewards
  = n / (n - 1) * (r_i - m).

A zero-variance group (every reward identical, compared exactly) gets exactly zero advantage
from every estimator, without going through the floating-point mean (which can leave residues
of 1e-17 that ``grpo`` would blow up by 1/eps). Such a group carries no learning signal; callers
may drop it (``AdvantageConfig.filter_zero_variance``) so it does not dilute token-mean losses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Estimator(StrEnum):
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"


class AdvantageConfig(BaseModel):
    """How a group's rewards become advantages, and which groups are kept."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    estimator: Estimator = Field(Estimator.GRPO, description="advantage estimator: grpo, "
                                                             "dr_grpo or rloo (see advantages.py)")
    eps: float = Field(1e-6, ge=0, description="added to the standard deviation in grpo "
                                               "(A = (r - mean) / (std + eps))")
    filter_zero_variance: bool = Field(True, description="skip groups whose rewards are all "
                                                         "equal (zero advantage everywhere, "
                                                         "no learning signal)")
    min_rollouts: int = Field(2, ge=2, description="skip a group with fewer usable (succeeded, "
                                                   "rewarded) rollouts than this; at least 2, "
                                                   "a baseline needs another rollout")


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """True when every reward equals the first (exactly), or there are none."""
    return all(r == rewards[0] for r in rewards)


def group_advantages(
    rewards: Sequence[float], estimator: Estimator | str = Estimator.GRPO, eps: float = 1e-6
) -> list[float]:
    """Advantages of the rollouts of one group, in the order of `rewards` (at least 2)."""
    estimator = Estimator(estimator)
    n = len(rewards)
    if n < 2:
        raise ValueError(f"a group needs at least 2 rewards for a baseline, got {n}")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    if is_zero_variance(rewards):
        return [0.0] * n
    mean = math.fsum(rewards) / n
    if estimator is Estimator.GRPO:
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (n - 1))
        return [(r - mean) / (std + eps) for r in rewards]
    if estimator is Estimator.DR_GRPO:
        return [r - mean for r in rewards]
    total = math.fsum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]
