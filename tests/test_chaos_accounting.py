"""The chaos accounting's check of a "stale" drop (harnessrl/testing/chaos_accounting.py): in
async mode the trainer may drop a group as too stale, and the accounting holds that claim
against what the gateway recorded, not what the trainer says: the version the trainer names
must be the group's oldest recorded call version, and too old for the trainer's version.
The versions are read from Redis as the store keeps them (a real store process)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import StoreService
from harnessrl.clients import StoreClient
from harnessrl.testing import chaos_accounting as ca
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb

RUN = "acct-1"
RID = f"{RUN}/t0/0"  # run / group / index, as the chaos run's ids


def _calls(versions: list[tuple[int, bool]]) -> list[c.Call]:
    return [c.Call(rollout_id=RID, attempt=1, seq=i, policy_version=v, aborted=aborted,
                   api="chat.completions", model="tiny", prompt_token_ids=[1, 2],
                   completion_token_ids=[3], logprobs=[-0.5])
            for i, (v, aborted) in enumerate(versions)]


def test_the_recorded_call_versions_are_read_from_redis(store_service: StoreService,
                                                       key_prefix: str) -> None:
    store = StoreClient.connect(store_service.address, timeout=10)
    try:
        store.create_rollouts([c.Rollout(rollout_id=RID, run_id=RUN, task_id="t",
                                         group_id=RID[:-2], group_size=1, stream="-")])
        store.start_attempt(RID, 1)
        store.append_calls(_calls([(3, False), (1, True), (5, False)]))
        store.finish_attempt(spb.FinishAttemptRequest(
            rollout_id=RID, attempt=1, status=c.ROLLOUT_STATUS_SUCCEEDED, reward=1.0))
    finally:
        store.close()
    view = ca.read_redis(store_service.redis_url, key_prefix, "acct", {RID})
    assert sorted(view.versions[RID]) == [3, 5]  # the aborted call is not trained on


def _account(why: str, versions: list[int], trainer_at: int = 5) -> ca.Accounting:
    ro = c.Rollout(rollout_id=RID, run_id=RUN, group_id=RID[:-2], attempt=1,
                   status=c.ROLLOUT_STATUS_SUCCEEDED)
    view = ca.RedisView({RID: ro}, [RUN], [ca.Entry("1-0", RID[:-2], RUN, acked=True,
                                                    pending=False)], {RID: versions})
    claims = ca.Claims(dropped={RID: why}, dropped_at={RID: trainer_at})
    harness: dict[str, Any] = {}
    return ca.account({RID: 0}, view, claims, harness, [], run_end=0.0, mode="async",
                      max_staleness=1)


STALE = "stale: a call of policy version 2, trainer at 5, max_staleness 1"


def test_a_stale_drop_that_the_recorded_calls_bear_out_is_by_design() -> None:
    acc = _account(STALE, [2, 4])
    assert acc.problems == [] and acc.by_design == {"stale": 1}


@pytest.mark.parametrize("why,versions,trainer_at,problem", [
    (STALE, [4, 5], 5, "recorded the group's calls at versions [4, 5]"),  # calls were fresh
    ("stale: a call of policy version 4, trainer at 5, max_staleness 1", [4], 5,
     "within max_staleness"),
    ("stale: too old", [0], 5, "no known form"),
    # a trainer that says it was at 5 when its step started at 3 (where 3 - 2 = 1 is within
    # the bound): an off-by-two in its version
    (STALE, [2], 3, "the step that dropped it started at version 3"),
    ("stale: a call of policy version 2, trainer at 5, max_staleness 2", [2], 5,
     "not the run's 1"),
], ids=["fresh-calls", "within-bound", "unknown-reason", "wrong-version", "wrong-bound"])
def test_a_stale_drop_the_recorded_calls_do_not_bear_out_is_a_problem(
        why: str, versions: list[int], trainer_at: int, problem: str) -> None:
    acc = _account(why, versions, trainer_at)
    assert len(acc.problems) == 1 and problem in acc.problems[0], acc.problems
    assert acc.by_design == {}


@pytest.mark.parametrize("rewards,by_design,problems", [
    ((1.0, 1.0), {"zero_variance": 2}, 0), ((1.0, 0.0), {}, 2), ((1.0, 1.0 + 1e-12), {}, 2),
    ((1.0,), {}, 1)], ids=["equal", "different", "barely-different", "one-rollout"])
def test_a_zero_variance_drop_needs_equal_rewards_in_the_store(
        rewards: tuple[float, ...], by_design: dict[str, int], problems: int) -> None:
    """The trainer drops a group whose rewards are all equal (no learning signal) with no kill
    behind it: by design when the store's rewards bear it out, a problem when they differ."""
    group = f"{RUN}/t0"
    ros = {f"{group}/{i}": c.Rollout(rollout_id=f"{group}/{i}", run_id=RUN, group_id=group,
                                     attempt=1, status=c.ROLLOUT_STATUS_SUCCEEDED, reward=r,
                                     has_reward=True)
           for i, r in enumerate(rewards)}
    view = ca.RedisView(ros, [RUN], [ca.Entry("1-0", group, RUN, acked=True, pending=False)],
                        {rid: [0] for rid in ros})
    claims = ca.Claims(dropped={rid: ca.ZERO_VARIANCE for rid in ros},
                       dropped_at={rid: 0 for rid in ros})
    acc = ca.account({rid: 0 for rid in ros}, view, claims, {}, [], run_end=0.0, mode="sync",
                     max_staleness=0)
    assert len(acc.problems) == problems and acc.by_design == by_design, acc.problems
    assert acc.drops == []
