"""The store against a real Redis, through a real store process and its gRPC API."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from conftest import StoreService, wait_aof_written
from harnessrl import procs, rpc
from harnessrl.clients import StoreClient
from harnessrl.rpc import health_check
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb

S, F = c.ROLLOUT_STATUS_SUCCEEDED, c.ROLLOUT_STATUS_FAILED


def make_group(run: str, task: str, n: int, stream: str = "train", max_attempts: int = 1
               ) -> list[c.Rollout]:
    gid = f"{run}/{task}"
    return [c.Rollout(rollout_id=f"{gid}/{i}", run_id=run, task_id=task, group_id=gid,
                      index_in_group=i, group_size=n, max_attempts=max_attempts,
                      task_json='{"x": 1}', stream=stream) for i in range(n)]


def call(rid: str, attempt: int, seq: int, ntok: int = 3, base: int = 0) -> c.Call:
    toks = [base + seq * 10 + j for j in range(ntok)]
    return c.Call(rollout_id=rid, attempt=attempt, seq=seq, api="chat.completions",
                  prompt_token_ids=[1, 2, 3], completion_token_ids=toks,
                  logprobs=[-0.5] * ntok, finish_reason="stop", policy_version=7,
                  engine="e0")


def finish(client: StoreClient, rid: str, attempt: int, reward: float = 1.0,
           status: int = S, will_retry: bool = False, error: str = "") -> c.Rollout:
    return client.finish_attempt(spb.FinishAttemptRequest(
        rollout_id=rid, attempt=attempt, status=status, reward=reward, will_retry=will_retry,
        error=error))


@pytest.fixture
def client(store_service) -> StoreClient:  # type: ignore[no-untyped-def]
    cl = StoreClient.connect(store_service.address, timeout=10)
    yield cl
    cl.close()


def test_serves_health_and_reflection(store_service) -> None:  # type: ignore[no-untyped-def]
    assert health_check(store_service.address, "harnessrl.v1.Store", peer="store")
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )
    with rpc.channel(store_service.address, "store") as ch:
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
    assert "harnessrl.v1.Store" in services and "grpc.health.v1.Health" in services


def test_rollout_lifecycle_and_idempotent_appends(client: StoreClient) -> None:
    ros = make_group("r1", "t1", 2)
    assert client.create_rollouts(ros).created == 2
    again = client.create_rollouts(ros)
    assert (again.created, again.existing) == (0, 2)
    rid = ros[0].rollout_id
    client.start_attempt(rid, 1, workdir="/tmp/w")
    client.start_attempt(rid, 1, workdir="/tmp/w")  # repeated start is harmless
    r = client.append_calls([call(rid, 1, 0), call(rid, 1, 1)])
    assert list(r.results) == [spb.APPEND_RESULT_STORED] * 2
    r = client.append_calls([call(rid, 1, 1), call(rid, 1, 2)])  # a resend: duplicate
    assert list(r.results) == [spb.APPEND_RESULT_DUPLICATE, spb.APPEND_RESULT_STORED]
    changed = call(rid, 1, 1, base=500)  # same key, other content: refused, first write kept
    r = client.append_calls([changed])
    assert list(r.results) == [spb.APPEND_RESULT_CONFLICT] and "another call" in r.reasons[0]
    got = client.get_rollout(rid, include_calls=True)
    assert [x.seq for x in got.calls] == [0, 1, 2]
    assert list(got.calls[1].completion_token_ids) == [10, 11, 12]
    assert got.attempts[0].num_calls == 3 and got.status == c.ROLLOUT_STATUS_RUNNING
    done = finish(client, rid, 1, reward=0.75)
    assert done.status == S and done.reward == 0.75 and done.has_reward
    assert finish(client, rid, 1, reward=0.1).reward == 0.75  # idempotent: first finish stays
    # No call can land in a finished attempt; the record is unchanged.
    r = client.append_calls([call(rid, 1, 3)])
    assert r.results[0] == spb.APPEND_RESULT_REJECTED and "not running" in r.reasons[0]
    assert len(client.get_rollout(rid, include_calls=True).calls) == 3


def test_rejects_bad_calls_per_call(client: StoreClient) -> None:
    ros = make_group("r2", "t", 1)
    client.create_rollouts(ros)
    rid = ros[0].rollout_id
    client.start_attempt(rid, 1)
    bad = call(rid, 1, 1)
    del bad.logprobs[-1]
    r = client.append_calls([call(rid, 1, 0), bad, call("nope", 1, 0), call(rid, 2, 0)])
    assert list(r.results) == [spb.APPEND_RESULT_STORED, spb.APPEND_RESULT_INVALID,
                               spb.APPEND_RESULT_REJECTED, spb.APPEND_RESULT_REJECTED]
    assert "one logprob per token" in r.reasons[1]
    assert "unknown rollout" in r.reasons[2]
    assert "not running" in r.reasons[3]


def test_explicit_status_codes(client: StoreClient) -> None:
    with pytest.raises(grpc.RpcError) as e:
        client.get_rollout("missing")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        client.get_run("missing")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        client.create_rollouts([c.Rollout(rollout_id="x", run_id="r", group_size=1)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ros = make_group("r3", "t", 1)
    client.create_rollouts(ros)
    with pytest.raises(grpc.RpcError) as e:
        client.start_attempt(ros[0].rollout_id, 2)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:
        client.report_reward(ros[0].rollout_id, 1, 1.0)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:
        finish(client, ros[0].rollout_id, 1, status=c.ROLLOUT_STATUS_RUNNING)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_record_calls_stream_answers_batches_in_order(client: StoreClient,
                                                            store_service) -> None:  # type: ignore[no-untyped-def]
    """The gateway's hot path: batches written back to back on one stream are answered in
    order, with AppendCalls' per-call semantics."""
    ros = make_group("rs", "t", 1)
    client.create_rollouts(ros)
    rid = ros[0].rollout_id
    client.start_attempt(rid, 1)
    aio = StoreClient.connect_async(store_service.address)
    try:
        stream = aio.record_calls()
        batches = [[call(rid, 1, 0), call(rid, 1, 1)],
                   [call(rid, 1, 1), call(rid, 1, 2)],  # seq 1 again: duplicate
                   [call(rid, 1, 3), call(rid, 2, 0), call("nope", 1, 0)]]
        for b in batches:  # all written before any answer is read
            await stream.write(spb.AppendCallsRequest(calls=b))
        answers = [await stream.read() for _ in batches]
        await stream.done_writing()
        assert await stream.read() is grpc.aio.EOF
    finally:
        await aio.close()
    ST, DUP, REJ = (spb.APPEND_RESULT_STORED, spb.APPEND_RESULT_DUPLICATE,
                    spb.APPEND_RESULT_REJECTED)
    assert [list(a.results) for a in answers] == [[ST, ST], [DUP, ST], [ST, REJ, REJ]]
    assert "not running" in answers[2].reasons[1] and "unknown" in answers[2].reasons[2]
    got = client.get_rollout(rid, include_calls=True)
    assert [x.seq for x in got.calls] == [0, 1, 2, 3]
    assert list(got.calls[1].completion_token_ids) == [10, 11, 12]


async def test_record_calls_stream_ends_unavailable_when_redis_is_down(tmp_path: Path) -> None:
    # appendfsync always: with everysec, Redis may hold back an AOF write for up to 2 s while
    # a background fsync runs (a loaded disk), and the kill -9 below would lose the rollout.
    url, redis_proc = procs.start_redis(tmp_path / "r", appendfsync="always")
    port = redis.Redis.from_url(url).connection_pool.connection_kwargs["port"]
    svc = StoreService(tmp_path / "store", url, "hrl-down:").start()
    try:
        sync = StoreClient.connect(svc.address)
        ros = make_group("rd", "t", 1)
        sync.create_rollouts(ros)
        rid = ros[0].rollout_id
        sync.start_attempt(rid, 1)
        aio = StoreClient.connect_async(svc.address)
        stream = aio.record_calls()
        await stream.write(spb.AppendCallsRequest(calls=[call(rid, 1, 0)]))
        assert list((await stream.read()).results) == [spb.APPEND_RESULT_STORED]
        redis_proc.kill()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.write(spb.AppendCallsRequest(calls=[call(rid, 1, 1)]))
            await stream.read()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "redis unavailable" in (err.value.details() or "")
        # Redis back (AOF): a new stream delivers the call the broken one could not.
        _, redis_proc = procs.start_redis(tmp_path / "r", port=port, appendfsync="always")
        stream = aio.record_calls()
        await stream.write(spb.AppendCallsRequest(calls=[call(rid, 1, 1)]))
        assert list((await stream.read()).results) == [spb.APPEND_RESULT_STORED]
        assert [x.seq for x in sync.get_rollout(rid, include_calls=True).calls] == [0, 1]
        await aio.close()
        sync.close()
    finally:
        svc.stop()
        redis_proc.stop()


def test_tampered_flag_and_evidence_are_stored_and_never_with_a_positive_reward(
        client: StoreClient) -> None:
    """FinishAttempt's `tampered`, `tamper_evidence` and `reward_dropped` land on the rollout
    (GetRollout, ListRollouts, the stream); a tampered rollout's reward is never positive."""
    ros = make_group("tam", "t", 3, stream="tam")
    client.create_rollouts(ros)
    rids = [ro.rollout_id for ro in ros]
    for rid in rids:
        client.start_attempt(rid, 1)

    def tampered(rid: str, **kw: Any) -> spb.FinishAttemptRequest:
        return spb.FinishAttemptRequest(rollout_id=rid, attempt=1, status=S, **kw)

    for bad, why in ((tampered(rids[0], reward=1.0, tampered=True), "must not be positive"),
                     (tampered(rids[0], reward_dropped=True), "for a tampered rollout only"),
                     (tampered(rids[0], tamper_evidence="x"), "evidence without tampered")):
        with pytest.raises(grpc.RpcError) as e:
            client.finish_attempt(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
    assert client.get_rollout(rids[0]).status == c.ROLLOUT_STATUS_RUNNING  # nothing stored
    penalized = client.finish_attempt(tampered(rids[0], reward=-1.0, tampered=True,
                                               tamper_evidence="canary passed"))
    assert penalized.tampered and penalized.tamper_evidence == "canary passed"
    assert penalized.has_reward and penalized.reward == -1.0
    dropped = client.finish_attempt(tampered(rids[1], tampered=True, reward_dropped=True))
    assert dropped.status == S and dropped.tampered and not dropped.has_reward
    finish(client, rids[2], 1, reward=1.0)
    listed = {ro.rollout_id: ro for ro in client.list_rollouts("tam").rollouts}
    assert [(listed[r].tampered, listed[r].has_reward) for r in rids] == \
        [(True, True), (True, False), (False, True)]
    assert client.get_rollout(rids[0]).tamper_evidence == "canary passed"
    (group,) = client.read_groups("tam", max_groups=5).groups
    assert [ro.tampered for ro in group.rollouts] == [True, True, False]


def test_retry_attempts_keep_history_and_calls_of_final_attempt(client: StoreClient) -> None:
    ros = make_group("r4", "t", 1, max_attempts=2)
    client.create_rollouts(ros)
    rid = ros[0].rollout_id
    client.start_attempt(rid, 1)
    client.append_calls([call(rid, 1, 0)])
    ro = finish(client, rid, 1, status=F, will_retry=True, error="harness exited 3")
    assert ro.status == c.ROLLOUT_STATUS_RUNNING and ro.attempts[0].status == F
    client.start_attempt(rid, 2)
    client.report_reward(rid, 2, 0.5)
    client.append_calls([call(rid, 2, 0, base=100), call(rid, 2, 1, base=100)])
    ro = finish(client, rid, 2, reward=0.5)
    got = client.get_rollout(rid, include_calls=True)
    assert [a.num_calls for a in got.attempts] == [1, 2]
    assert got.attempts[1].has_reported_reward and got.attempts[1].reported_reward == 0.5
    assert [list(x.completion_token_ids)[0] for x in got.calls] == [100, 110]
    with pytest.raises(grpc.RpcError) as e:
        client.start_attempt(rid, 3)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_cancel_between_a_failed_attempt_and_its_retry(client: StoreClient) -> None:
    ros = make_group("r4c", "t", 1, max_attempts=3)
    client.create_rollouts(ros)
    rid = ros[0].rollout_id
    client.start_attempt(rid, 1)
    finish(client, rid, 1, status=F, will_retry=True, error="crashed")
    ro = finish(client, rid, 1, status=c.ROLLOUT_STATUS_CANCELLED, error="run cancelled")
    assert ro.status == c.ROLLOUT_STATUS_CANCELLED and len(ro.attempts) == 1
    with pytest.raises(grpc.RpcError) as e:
        client.start_attempt(rid, 2)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _complete_group(client: StoreClient, run: str, task: str, n: int, stream: str = "train"
                    ) -> list[c.Rollout]:
    ros = make_group(run, task, n, stream=stream)
    client.create_rollouts(ros)
    for i, ro in enumerate(ros):
        client.start_attempt(ro.rollout_id, 1)
        client.append_calls([call(ro.rollout_id, 1, 0)])
        finish(client, ro.rollout_id, 1, reward=i / n)
    return ros


def test_groups_stream_once_complete_and_redeliver_until_acked(store_service) -> None:  # type: ignore[no-untyped-def]
    cl = StoreClient.connect(store_service.address)
    ros = make_group("r5", "t", 3)
    cl.create_rollouts(ros)
    for ro in ros[:2]:
        cl.start_attempt(ro.rollout_id, 1)
        finish(cl, ro.rollout_id, 1)
    assert list(cl.read_groups(max_groups=5).groups) == []  # not complete yet
    cl.start_attempt(ros[2].rollout_id, 1)
    cl.append_calls([call(ros[2].rollout_id, 1, 0)])
    finish(cl, ros[2].rollout_id, 1, status=F, error="boom")
    finish(cl, ros[2].rollout_id, 1, status=F, error="boom")  # repeat publishes nothing more
    _complete_group(cl, "r5", "u", 2, stream="-")  # a group outside any stream
    groups = cl.read_groups(max_groups=5, block_ms=100).groups
    assert len(groups) == 1 and groups[0].group_id == "r5/t"
    assert sorted(r.status for r in groups[0].rollouts) == [S, S, F]
    assert len([r for r in groups[0].rollouts if r.calls]) == 1
    entry = groups[0].entry_id
    cl.close()
    # A reader that restarts (new connection, same consumer) gets the unacknowledged group.
    cl2 = StoreClient.connect(store_service.address)
    again = cl2.read_groups(max_groups=5).groups
    assert [g.entry_id for g in again] == [entry]
    assert cl2.ack_groups([entry]).acknowledged == 1
    assert list(cl2.read_groups(max_groups=5).groups) == []
    cl2.close()


def test_large_rollout_roundtrips_intact(client: StoreClient) -> None:
    ros = make_group("r6", "t", 1)
    client.create_rollouts(ros)
    rid = ros[0].rollout_id
    client.start_attempt(rid, 1)
    calls = []
    for seq in range(300):  # 300 calls, 100k+ completion tokens, growing prompts
        toks = [(seq * 7919 + j) % 50000 for j in range(340)]
        calls.append(c.Call(rollout_id=rid, attempt=1, seq=seq, prompt_token_ids=list(range(seq * 50)),
                            completion_token_ids=toks, logprobs=[-(j % 13) / 7 for j in range(340)],
                            policy_version=seq, request_json=b'{"messages": []}'))
    for i in range(0, 300, 50):
        res = client.append_calls(calls[i:i + 50])
        assert set(res.results) == {spb.APPEND_RESULT_STORED}
    got = client.get_rollout(rid, include_calls=True)
    assert len(got.calls) == 300
    assert sum(len(x.completion_token_ids) for x in got.calls) == 102000
    for sent, back in zip(calls, got.calls):
        assert back == sent  # float32 logprobs, ids and prompts bit for bit


def test_data_survives_kill_9_of_store(store_service, client: StoreClient) -> None:  # type: ignore[no-untyped-def]
    ros = _complete_group(client, "r7", "t", 2)
    store_service.kill()
    store_service.start()  # same port
    cl = StoreClient.connect(store_service.address)
    got = cl.list_rollouts("r7", include_calls=True).rollouts
    assert [r.rollout_id for r in got] == [r.rollout_id for r in ros]
    assert all(len(r.calls) == 1 and r.status == S for r in got)
    cl.close()


def test_runs_roundtrip(client: StoreClient) -> None:
    run = c.Run(run_id="run-x", status=c.RUN_STATUS_RUNNING, created_at=time.time(),
                spec=c.RunSpec(name="demo", group_size=4, harness_command=["python", "h.py"]))
    client.put_run(run)
    assert client.get_run("run-x") == run
    assert "run-x" in [r.run_id for r in client.list_runs().runs]


def test_own_redis_uses_aof_and_survives_kill_9(tmp_path: Path) -> None:
    url, proc = procs.start_redis(tmp_path / "r")
    try:
        r = redis.Redis.from_url(url)
        assert r.config_get("appendonly")["appendonly"] == "yes"
        r.set("survivor", "v")
        wait_aof_written(tmp_path / "r", "survivor")  # appendfsync everysec
        port = r.connection_pool.connection_kwargs["port"]
        proc.kill()
        url2, proc = procs.start_redis(tmp_path / "r", port=port)
        assert redis.Redis.from_url(url2).get("survivor") == b"v"
    finally:
        proc.stop()


def test_store_cli_help() -> None:
    out = subprocess.run(procs.python_module("services.store", "--help"), capture_output=True,
                         text=True, check=True).stdout
    assert "--redis-url" in out and "--key-prefix" in out
