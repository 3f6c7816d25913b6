"""Bounded redelivery: a group that keeps failing goes to the stream's dead-letter stream after
`max_deliveries` deliveries instead of blocking the trainer; the completed-group stream is
trimmed only below what every retained checkpoint has consumed and what no consumer group
still needs. Real store process, real Redis."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from conftest import StoreService
from harnessrl.clients import StoreClient, dead_letters
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.trainer import checkpoint as ckpt


def publish(store: StoreClient, run_id: str, task: str, stream: str = "train",
            poison: bool = False, reward: float = 1.0, index: int = 0, size: int = 1) -> str:
    """One rollout of group `<run>/<task>`, with one call, finished; returns its id."""
    gid = f"{run_id}/{task}"
    rid = f"{gid}/{index}"
    store.create_rollouts([c.Rollout(rollout_id=rid, run_id=run_id, task_id=task, group_id=gid,
                                     index_in_group=index, group_size=size, stream=stream)])
    store.start_attempt(rid, 1)
    resp = store.append_calls([c.Call(
        rollout_id=rid, attempt=1, seq=0, prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5], logprobs=[0.5 if poison else -0.5, -0.1])])
    assert resp.results[0] == spb.APPEND_RESULT_STORED
    store.finish_attempt(spb.FinishAttemptRequest(rollout_id=rid, attempt=1, reward=reward,
                                                  status=c.ROLLOUT_STATUS_SUCCEEDED))
    return rid


def test_nack_and_restarts_dead_letter_after_max_deliveries(
        store_service: StoreService, redis_url: str, key_prefix: str) -> None:
    store = StoreClient.connect(store_service.address, timeout=10)
    try:
        publish(store, "r", "a")
        publish(store, "r", "b")
        got = store.read_groups(max_groups=10, max_deliveries=3).groups
        a, b = got[0].entry_id, got[1].entry_id
        assert [g.task_id for g in got] == ["a", "b"]
        # a: its samples cannot be built; each NackGroups(redeliver) is one more delivery
        for delivery in (2, 3):
            resp = store.nack_groups([a], f"bad samples ({delivery - 1})", 3, redeliver=True)
            assert [g.entry_id for g in resp.redelivered] == [a] and not resp.dead_letters
        resp = store.nack_groups([a], "bad samples (3)", 3, redeliver=True)
        assert not resp.redelivered
        [dead] = resp.dead_letters
        assert (dead.original_entry_id, dead.group_id, dead.run_id, dead.task_id,
                dead.deliveries, dead.reason) == (a, "r/a", "r", "a", 3, "bad samples (3)")
        # b: the trainer crashes on it; each restart reads it from the pending list again
        r = redis.Redis.from_url(redis_url)
        pend = r.xpending_range(f"{key_prefix}stream:train", "trainer", "-", "+", 10)
        assert [(p["message_id"].decode(), p["times_delivered"]) for p in pend] == [(b, 1)]
        for _restart in (1, 2):
            assert [g.entry_id for g in store.read_groups(max_groups=10,
                                                          max_deliveries=3).groups] == [b]
        assert store.read_groups(max_groups=10, max_deliveries=3).groups == []
        letters = dead_letters(store_service.address)
        assert [(d.original_entry_id, d.deliveries) for d in letters] == [(b, 3), (a, 3)]
        assert "delivered 3 times" in letters[0].reason
        assert r.xpending(f"{key_prefix}stream:train", "trainer")["pending"] == 0
        # a failed step counts against each of its groups without redelivering them
        publish(store, "r", "c")
        [g] = store.read_groups(max_groups=10, max_deliveries=2).groups
        resp = store.nack_groups([g.entry_id], "step failed", 2, redeliver=False)
        assert not resp.redelivered and not resp.dead_letters
        assert [x.entry_id for x in store.read_groups(max_groups=10,
                                                      max_deliveries=2).groups] == [g.entry_id]
        resp = store.nack_groups([g.entry_id], "step failed again", 2)
        assert [d.reason for d in resp.dead_letters] == ["step failed again"]
        # nothing is dead-lettered twice, unknown and acknowledged entries are left alone
        assert not store.nack_groups([a, "1-1"], "again", 1).dead_letters
        assert len(dead_letters(store_service.address)) == 3
    finally:
        store.close()


def test_trim_keeps_what_any_consumer_group_or_checkpoint_needs(
        store_service: StoreService, redis_url: str, key_prefix: str) -> None:
    store = StoreClient.connect(store_service.address, timeout=10)
    r = redis.Redis.from_url(redis_url)
    key = f"{key_prefix}stream:train"
    try:
        for t in "abcde":
            publish(store, "r", t)
        got = store.read_groups(max_groups=3).groups  # a, b, c delivered; d, e unread
        ids = [g.entry_id for g in got]
        store.ack_groups([ids[0], ids[2]])  # b stays pending
        resp = store.trim_groups()
        assert resp.trimmed == 1 and resp.min_entry_id == ids[1]  # only a: b is pending
        assert r.xlen(key) == 4
        store.ack_groups([ids[1]])
        resp = store.trim_groups(below_entry_id=ids[1])  # a checkpoint still needs b
        assert resp.trimmed == 0
        resp = store.trim_groups()  # d and e were never read: kept
        assert resp.trimmed == 2 and r.xlen(key) == 2
        # a second consumer group that read nothing keeps everything it has not read
        r.xgroup_create(key, "audit", id="0")
        rest = store.read_groups(max_groups=10).groups
        store.ack_groups([g.entry_id for g in rest])
        assert store.trim_groups().trimmed == 0 and r.xlen(key) == 2
        assert store.read_groups(consumer_group="audit", max_groups=10).groups  # still there
    finally:
        store.close()


def test_retained_consumed_floor(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert ckpt.retained_consumed_floor(root) == ""
    for step, consumed in ((2, ["5-0", "6-0"]), (3, ["9-1", "10-0"]), (4, ["8-3"])):
        d = root / ckpt.step_dir_name(step)
        d.mkdir(parents=True)
        (d / ckpt.STATE_FILE).write_text(json.dumps(
            {"step": step, "policy_version": step, "consumed_entries": consumed}))
    # the oldest retained checkpoint (step 2) needs nothing; resuming from it needs what
    # steps 3 and 4 consumed, the lowest of which is 8-3 (ids compare numerically)
    assert ckpt.retained_consumed_floor(root) == "8-3"


def test_trainer_dead_letters_a_poison_group_and_trains_the_rest(
        tmp_path: Path, store_service: StoreService) -> None:
    """The trainer's read of a step: a group whose samples cannot be built (a logprob > 0) is
    reported, redelivered, dead-lettered after `max_group_deliveries`, and the step goes on
    with the others; a restarted trainer gets the others again (pending), not the dead one."""
    from services.trainer.config import TrainerConfig
    from services.trainer.loop import Trainer
    from services.trainer.rollouts import run_id_for

    store = StoreClient.connect(store_service.address, timeout=10)
    cfg = TrainerConfig(output_dir=str(tmp_path / "trainer"), max_group_deliveries=3,
                        store_address=store_service.address, read_timeout_s=20)
    run_id = run_id_for("pfx", 1)
    try:
        for task, poison in (("t0", False), ("t1", True), ("t2", False)):
            for i, reward in enumerate((0.0, 1.0)):  # non-zero variance: samples are built
                publish(store, run_id, task, poison=poison and i == 1, reward=reward, index=i,
                        size=2)

        def trainer() -> Trainer:
            t = Trainer(cfg, None, store, None)
            t.state = ckpt.TrainState(run_prefix="pfx")
            t._attach_stream("pfx")
            return t

        groups = trainer().read_groups(run_id, 1, ["t0", "t1", "t2"])
        assert [g.task_id for g in groups] == ["t0", "t2"]
        [dead] = dead_letters(store_service.address)
        assert (dead.task_id, dead.deliveries) == ("t1", 3)
        assert "logprobs must be finite and <= 0" in dead.reason
        again = trainer().read_groups(run_id, 1, ["t0", "t2", "t1"])  # a restarted trainer
        assert [g.task_id for g in again] == ["t0", "t2"]
        assert len(dead_letters(store_service.address)) == 1
    finally:
        store.close()


def test_the_async_pool_reads_a_pending_group_once_per_trainer_life(
        store_service: StoreService, redis_url: str, key_prefix: str) -> None:
    """Each read of a pending entry counts as a delivery: a trainer that re-read its pending
    entries at every poll (every 0.2 s) made a group "delivered" hundreds of times, so its first
    failure dead-lettered it. Polls take new entries only; a restarted trainer reads its
    pending ones once."""
    from services.trainer.rollouts import StreamReader

    store = StoreClient.connect(store_service.address, timeout=10)
    r = redis.Redis.from_url(redis_url)
    stream = f"{key_prefix}stream:train"

    def deliveries() -> list[int]:
        return [p["times_delivered"] for p in r.xpending_range(stream, "trainer", "-", "+", 10)]

    try:
        publish(store, "pool", "a")
        publish(store, "pool", "b")
        reader = StreamReader(store, "train", "trainer", "trainer-0", "pool", 10,
                              max_deliveries=3)
        got = [g.task_id for _ in range(10) for g in reader.poll("pool", set())]
        assert got == ["a", "b"]
        assert deliveries() == [1, 1]
        publish(store, "pool", "c")
        assert [g.task_id for g in reader.poll("pool", set())] == ["c"]
        assert deliveries() == [1, 1, 1]
        # the trainer restarts: its first poll reads the pending entries once, then no more
        again = StreamReader(store, "train", "trainer", "trainer-0", "pool", 10,
                             max_deliveries=3)
        got = [g.task_id for _ in range(5) for g in again.poll("pool", set())]
        assert sorted(got) == ["a", "b", "c"]
        assert deliveries() == [2, 2, 2]
        assert dead_letters(store_service.address) == []
    finally:
        store.close()


def test_the_async_pool_reads_through_a_store_restart(store_service: StoreService) -> None:
    """A store killed and restarted under an async trainer: its polls read nothing meanwhile
    (the trainer used to die on UNAVAILABLE), then the groups published since."""
    from services.trainer.rollouts import StreamReader

    store = StoreClient.connect(store_service.address, timeout=10)
    try:
        publish(store, "pool", "a")
        reader = StreamReader(store, "train", "trainer", "trainer-0", "pool", 10)
        assert [g.task_id for g in reader.poll("pool", set())] == ["a"]
        store_service.kill()
        assert reader.poll("pool", set()) == []
        store_service.start(store_service.port)
        publish(store, "pool", "b")
        assert [g.task_id for g in reader.poll("pool", set())] == ["b"]
    finally:
        store.close()
