"""A group grader's answer (`Store.SetGroupRewards`): the rewards of a group held back
(`GROUP_GRADING_WAITING`) land on its rollouts and the group is published, in one Redis
transaction, so a store that dies halfway leaves the group waiting (the controller asks again)
and a group is never published with only some of its rewards.

Rules: every rollout of the group must have ended. An answer (no `error`) gives one reward
per rollout that SUCCEEDED, no more and no fewer; each succeeded rollout's reward becomes
the group grader's (the per-attempt grader's is kept as `attempt_reward`), with its parts and
reason; the group is published to its stream once (the publish script's flag). With `error`
the group FAILS: each succeeded rollout becomes FAILED with the reason (no reward), and the
group is published so, every rollout failed — the trainer counts it (a sync step waits for
every group, async admission for every consumed one) and learns nothing from it; a group is
never published with some of its rewards. A group answered already (DONE or FAILED) is left as
it is: a repeat is a no-op.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from redis.exceptions import WatchError

from harnessrl.errors import FailedPrecondition, InvalidArgument, NotFound
from harnessrl.statuses import TERMINAL
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb

NO_STREAM = ("", "-")  # streams of runs that publish nothing

if TYPE_CHECKING:
    from services.store.redis_store import RolloutStore

MAX_REASON_CHARS = 2000


def check_parts(parts: "list[c.RewardPart]", where: str) -> None:
    names = [p.name for p in parts]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise InvalidArgument(f"{where}: reward parts need distinct, non-empty names")
    if any(not math.isfinite(p.value) for p in parts):
        raise InvalidArgument(f"{where}: reward parts must be finite numbers")


def _checked(req: spb.SetGroupRewardsRequest) -> dict[str, spb.GroupReward]:
    if not req.group_id:
        raise InvalidArgument("group_id is required")
    rewards: dict[str, spb.GroupReward] = {}
    for r in req.rewards:
        if not r.rollout_id or r.rollout_id in rewards:
            raise InvalidArgument(f"rewards: rollout_id {r.rollout_id!r} empty or repeated")
        if not math.isfinite(r.reward):
            raise InvalidArgument(f"rewards: {r.rollout_id}'s reward is not a finite number")
        check_parts(list(r.parts), f"rewards: {r.rollout_id}")
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
            ro.has_reward, ro.reward = True, r.reward
            ro.reward_reason = r.reason[:MAX_REASON_CHARS]
            del ro.reward_parts[:]
            ro.reward_parts.extend(r.parts)


async def set_group_rewards(store: "RolloutStore", req: spb.SetGroupRewardsRequest
                            ) -> tuple[list[c.Rollout], bool]:
    """The group's rollouts as stored now, and whether this call published the group."""
    rewards = _checked(req)
    ids = [i.decode() for i in await store.r.lrange(store._k("grp", req.group_id), 0, -1)]
    if not ids:
        raise NotFound(f"group {req.group_id!r} not found")
    keys = [store._k("ro", i) for i in ids]
    while True:
        async with store.r.pipeline(transaction=True) as pipe:
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
                gdone, ro0 = store._k("gdone", req.group_id), ros[0]
                pipe.multi()
                for key, ro in zip(keys, ros):
                    pipe.set(key, ro.SerializeToString())
                pipe.sadd(gdone, *ids)
                publish = ro0.stream not in NO_STREAM
                if publish:
                    await store._publish(
                        keys=[gdone, store._k("gpub", req.group_id),
                              store._stream_key(ro0.stream)],
                        args=[ro0.group_size, req.group_id, ro0.run_id, ro0.task_id],
                        client=pipe)
                results = await pipe.execute()
                return ros, publish and bool(results[-1])
            except WatchError:
                continue
