"""A group's publish is in the same Redis transaction as its last rollout's terminal record
(services/store/redis_store.py `finish_attempt`): a store that dies right after that write (or
a FinishAttempt whose caller went away, cancelled at the next await) cannot leave a group that
has ended and is never published. Before, the publish was a separate step after the write; the
controller's idempotent retry was meant to repair it, but a controller restarted meanwhile sees
the rollout terminal and sends no FinishAttempt again, and the trainer then waited for the
group forever. The store's code runs in this process on a real Redis; the crash is the next
step after the write failing."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.store.redis_client import connect
from services.store.redis_store import RolloutStore


def _group(n: int) -> list[c.Rollout]:
    return [c.Rollout(rollout_id=f"pub-1/g0/{i}", run_id="pub-1", task_id="t", group_id="pub-1/g0",
                      group_size=n, max_attempts=1, stream="train") for i in range(n)]


def _entries(url: str, prefix: str) -> list[Any]:
    r: Any = redis.Redis.from_url(url)  # untyped replies: bytes throughout
    try:
        return [f for _, f in r.xrange(f"{prefix}stream:train")]
    finally:
        r.close()


async def test_a_store_that_dies_right_after_the_last_finish_has_published_the_group(
        redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RolloutStore(connect(redis_url), key_prefix)
    group = _group(2)
    await store.create_rollouts(group)
    for ro in group:
        await store.start_attempt(ro.rollout_id, 1, "")

    async def finish(rid: str) -> c.Rollout:
        return await store.finish_attempt(spb.FinishAttemptRequest(
            rollout_id=rid, attempt=1, status=c.ROLLOUT_STATUS_SUCCEEDED, reward=1.0))

    await finish(group[0].rollout_id)
    assert _entries(redis_url, key_prefix) == []  # one of two ended: nothing published

    async def died(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the store died here")
    monkeypatch.setattr(store.calls, "drop", died)  # the step right after the write
    with pytest.raises(ConnectionError):
        await finish(group[1].rollout_id)
    [entry] = _entries(redis_url, key_prefix)
    assert entry[b"group_id"] == b"pub-1/g0"
    monkeypatch.undo()
    # the controller's retry (the same finish again) publishes nothing twice
    assert (await finish(group[1].rollout_id)).status == c.ROLLOUT_STATUS_SUCCEEDED
    assert len(_entries(redis_url, key_prefix)) == 1
    await store.r.aclose()
