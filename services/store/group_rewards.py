"""A group grader's answer (`Store.SetGroupRewards`): the rewards of a group held back
(`GROUP_GRADING_WAITING`) land on its rollouts and the group is published, in one Redis
transaction, so a store that dies halfway leaves the group waiting (the controller asks again)
and a group is never published with only some of its rewards.

Rules: every rollout of the group must have ended. An answer (no `error`) gives one reward
per rollout that SUCCEEDED, no more and no fewer; each succeeded rollout's reward becomes
the group grader's (the per-attempt grader's is kept as `attempt_reward`), with its parts,
reason and tamper flag (`rewards.py`: a rollout the per-attempt grader found tampered stays
so, and gets no positive reward); the group is published to its stream once
(`GroupStream.end`). With `error` the group FAILS: each succeeded rollout becomes FAILED with the
reason (no reward; a tamper flag stays), and the group is published so, every rollout failed —
the trainer counts it (a sync step waits for every group, async admission for every consumed
one) and learns nothing from it; a group is never published with some of its rewards. A group
answered already (DONE or FAILED) is left as it is: a repeat is a no-op.
"""

from __future__ import annotations

import math

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from harnessrl.errors import FailedPrecondition, InvalidArgument, NotFound
from harnessrl.statuses import TERMINAL
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.store import rewards as reward_record
from services.store.group_stream import GroupStream

MAX_REASON_CHARS = reward_record.MAX_REASON_CHARS


def _checked(req: spb.SetGroupRewardsRequest) -> dict[str, spb.GroupReward]:
    if not req.group_id:
        raise InvalidArgument("group_id is required")
    rewards: dict[str, spb.GroupReward] = {}
    for r in req.rewards:
        if not r.rollout_id or r.rollout_id in rewards:
            raise InvalidArgument(f"rewards: rollout_id {r.rollout_id!r} empty or repeated")
        if not math.isfinite(r.reward):
            raise InvalidArgument(f"rewards: {r.rollout_id}'s reward is not a finite number")
        reward_record.check_group(r)
        rewards[r.rollout_id] = r
    if req.error and rewards:
        raise InvalidArgument("give rewards or an error, not both")
    return rewards


def _apply(ros: list[c.Rollout], req: spb.SetGroupRewardsRequest,
           rewards: dict[str, spb.GroupReward]) -> None:
    succeeded = {ro.rollout_id for ro in ros if ro.status == c.ROLLOUT_STATUS_SUCCEEDED}
    if not req.error and set(rewards) != succeeded:
        raise InvalidArgument(
            f"group {req.group_id}: want one reward per succeeded rollout "
            f"({sorted(succeeded)}), got {sorted(rewards)}")
    for ro in ros:
        if req.error:
            ro.group_grading = c.GROUP_GRADING_FAILED
            if ro.status == c.ROLLOUT_STATUS_SUCCEEDED:
                ro.status, ro.has_reward, ro.reward = c.ROLLOUT_STATUS_FAILED, False, 0.0
                ro.error = f"group grader failed: {req.error}"[:MAX_REASON_CHARS]
                ro.reward_reason = ""
                del ro.reward_parts[:]
            continue
        ro.group_grading = c.GROUP_GRADING_DONE
        if ro.rollout_id in rewards:
            r = rewards[ro.rollout_id]
            if ro.has_reward:
                ro.attempt_reward = ro.reward
            reward_record.record_group(ro, r)


async def set_group_rewards(r: aioredis.Redis, prefix: str, stream: GroupStream,
                            req: spb.SetGroupRewardsRequest) -> tuple[list[c.Rollout], bool]:
    """The group's rollouts as stored now, and whether this call published the group (the
    rollout records and the group's list are `redis_store`'s keys under `prefix`)."""
    rewards = _checked(req)
    ids = [i.decode() for i in await r.lrange(f"{prefix}grp:{req.group_id}", 0, -1)]
    if not ids:
        raise NotFound(f"group {req.group_id!r} not found")
    keys = [f"{prefix}ro:{i}" for i in ids]
    while True:
        async with r.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(*keys)
                datas = await pipe.mget(keys)
                if any(d is None for d in datas):
                    raise NotFound(f"group {req.group_id}: a rollout record is missing")
                ros = [c.Rollout.FromString(d) for d in datas]
                grading = {ro.group_grading for ro in ros}
                if grading == {c.GROUP_GRADING_NONE}:
                    raise FailedPrecondition(f"group {req.group_id}: its run has no group "
                                             "grader (the group is published as it ends)")
                if c.GROUP_GRADING_WAITING not in grading:
                    await pipe.unwatch()
                    return ros, False  # answered before: a repeat
                running = [ro.rollout_id for ro in ros if ro.status not in TERMINAL]
                if running or len(ros) < ros[0].group_size:
                    raise FailedPrecondition(f"group {req.group_id}: not every rollout has "
                                             f"ended (running: {running[:5]})")
                _apply(ros, req, rewards)
                pipe.multi()
                for key, ro in zip(keys, ros):
                    pipe.set(key, ro.SerializeToString())
                publish = await stream.end(ros[0], ids, pipe=pipe)
                results = await pipe.execute()
                return ros, publish and bool(results[-1])
            except WatchError:
                continue
