"""A rollout's reward record — its reward, parts, reason and tamper flag — checked and written
the same way for the per-attempt grader's (`FinishAttempt`, redis_store.py) and the group
grader's (`SetGroupRewards`, group_rewards.py).

Tampering (a grader found the agent's code forged the outcome, `Rollout.tampered`): the
controller decides the reward of a tampered rollout (its run's `tampered_rewards`); the store
holds the line whatever a caller sends: a tampered rollout's reward is never positive, a
reward is dropped (`reward_dropped`: no reward at all) only for a tampered one, and a rollout
once found tampered stays so (a group grader's answer does not clear the per-attempt grader's
finding).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from harnessrl.errors import InvalidArgument
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb

MAX_REASON_CHARS = 2000
MAX_EVIDENCE_CHARS = 2000


def check_parts(parts: Iterable[c.RewardPart], where: str) -> None:
    parts = list(parts)
    names = [p.name for p in parts]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise InvalidArgument(f"{where}: reward parts need distinct, non-empty names")
    if any(not math.isfinite(p.value) for p in parts):
        raise InvalidArgument(f"{where}: reward parts must be finite numbers")


def check(where: str, reward: float, parts: Iterable[c.RewardPart], tampered: bool,
          evidence: str, dropped: bool) -> None:
    """InvalidArgument when a reward record is malformed (see the module docstring)."""
    check_parts(parts, where)
    if dropped and not tampered:
        raise InvalidArgument(f"{where}: reward_dropped is for a tampered rollout only")
    if evidence and not tampered:
        raise InvalidArgument(f"{where}: tamper_evidence without tampered")
    if tampered and reward > 0:
        raise InvalidArgument(f"{where}: a tampered rollout's reward must not be positive "
                              f"(got {reward:g})")


def record(ro: c.Rollout, reward: float, reason: str, parts: Iterable[c.RewardPart],
           tampered: bool, evidence: str, dropped: bool) -> None:
    """Writes a (checked) reward record onto `ro`; InvalidArgument when `ro` was found
    tampered before and this record would give it a positive reward."""
    if ro.tampered and not tampered and reward > 0:
        raise InvalidArgument(f"rollout {ro.rollout_id} was found tampered: its reward must "
                              f"not be positive (got {reward:g})")
    ro.has_reward, ro.reward = not dropped, 0.0 if dropped else reward
    ro.reward_reason = reason[:MAX_REASON_CHARS]
    del ro.reward_parts[:]
    ro.reward_parts.extend(parts)
    if tampered:
        ro.tampered = True
        ro.tamper_evidence = evidence[:MAX_EVIDENCE_CHARS] or ro.tamper_evidence


def check_finish(req: spb.FinishAttemptRequest) -> None:
    check("FinishAttempt", req.reward, req.reward_parts, req.tampered, req.tamper_evidence,
          req.reward_dropped)


def record_finish(ro: c.Rollout, req: spb.FinishAttemptRequest) -> None:
    record(ro, req.reward, req.reward_reason, req.reward_parts, req.tampered,
           req.tamper_evidence, req.reward_dropped)


def check_group(r: spb.GroupReward) -> None:
    check(f"rewards: {r.rollout_id}", r.reward, r.parts, r.tampered, r.tamper_evidence,
          r.reward_dropped)


def record_group(ro: c.Rollout, r: spb.GroupReward) -> None:
    record(ro, r.reward, r.reason, r.parts, r.tampered, r.tamper_evidence, r.reward_dropped)
