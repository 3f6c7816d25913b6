"""A call is serialised once (services/store/call_bytes.py): the gateway's recorder writes each
call's bytes (`AppendCallsRequestBytes`), the store keeps the bytes it received. What the
store keeps must be exactly what it kept when it parsed `AppendCallsRequest` and serialised
each call again, whichever message a caller writes; real store process and Redis."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import redis

from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.gateway.recorder import CallRecorder
from test_store import make_group


def _call(rid: str, seq: int, aborted: bool = False) -> c.Call:
    """A call with every kind of field the gateway sets (unicode, -inf, an optional set)."""
    return c.Call(
        rollout_id=rid, attempt=1, seq=seq, api="chat.completions", model="m-ü",
        prompt_token_ids=list(range(0, 3000, 7)) + [151643, 2**31 - 1],
        completion_token_ids=[9, 151645, 0], logprobs=[-0.25, -math.inf, 0.0],
        finish_reason="stop", policy_version=12, engine="e0", started_at=1.7e9 + 0.123,
        latency_s=0.0042, request_json=b'{"model":"m","messages":[{"role":"user"}]}',
        completion_text="héllo \u2603", response_message_json=b'{"role":"assistant"}',
        aborted=aborted, sampling_override_json=b'{"temperature":1.0}', segment=0,
        segment_start=c.SEGMENT_START_CONTINUED, reused_prompt_tokens=120, extends_seq=0)


def _old_way(call: c.Call) -> bytes:
    """What the store kept before: the call parsed from AppendCallsRequest, serialised."""
    wire = spb.AppendCallsRequest(calls=[call]).SerializeToString()
    return spb.AppendCallsRequest.FromString(wire).calls[0].SerializeToString()


@pytest.fixture
def rig(store_service, redis_url: str, key_prefix: str):  # type: ignore[no-untyped-def]
    client = StoreClient.connect(store_service.address, timeout=10)
    ros = make_group("cb", "t", 1)
    client.create_rollouts(ros)
    client.start_attempt(ros[0].rollout_id, 1)
    r = redis.Redis.from_url(redis_url)
    yield client, ros[0].rollout_id, store_service.address, \
        lambda seq: r.hget(f"{key_prefix}calls:{ros[0].rollout_id}:1", seq)
    r.close()
    client.close()


def test_the_two_requests_are_one_wire_format() -> None:
    call, state = _call("r", 3), spb.GatewayCallState(segment=True, n_messages=2,
                                                      drop_seqs=[1, 2], response_id="x")
    old = spb.AppendCallsRequest(calls=[call, call], states=[state, state])
    new = spb.AppendCallsRequestBytes(calls=[call.SerializeToString()] * 2,
                                      states=[state, state])
    assert new.SerializeToString() == old.SerializeToString()
    assert spb.AppendCallsRequest.FromString(new.SerializeToString()) == old
    assert list(spb.AppendCallsRequestBytes.FromString(old.SerializeToString()).calls) == \
        [call.SerializeToString()] * 2


def test_the_store_keeps_the_bytes_it_kept_before(rig) -> None:  # type: ignore[no-untyped-def]
    client, rid, address, stored = rig

    async def record(calls: list[c.Call]) -> None:
        store = StoreClient.connect_async(address)
        recorder = CallRecorder(store, hold_timeout_s=30)
        await asyncio.gather(*(recorder.record(x) for x in calls))
        await recorder.close()
        await store.channel.close()

    # the gateway's recorder (AppendCallsRequestBytes on RecordCalls)
    asyncio.run(record([_call(rid, 0), _call(rid, 1, aborted=True)]))
    # a caller writing AppendCallsRequest (unary AppendCalls)
    assert list(client.append_calls([_call(rid, 2)]).results) == [spb.APPEND_RESULT_STORED]
    for seq, aborted in ((0, False), (1, True), (2, False)):
        assert stored(seq) == _old_way(_call(rid, seq, aborted)), seq
    got = client.get_rollout(rid, include_calls=True).calls
    assert [x.seq for x in got] == [0, 1, 2] and got[0] == _call(rid, 0)
    # a resend through the other message is the same call; its aborted copy too
    assert list(client.append_calls([_call(rid, 0), _call(rid, 2, aborted=True)]).results) == \
        [spb.APPEND_RESULT_DUPLICATE] * 2
    changed = _call(rid, 1)
    changed.completion_text = "other"
    assert list(client.append_calls([changed]).results) == [spb.APPEND_RESULT_CONFLICT]


def test_a_call_that_does_not_parse_is_refused_as_before(  # type: ignore[no-untyped-def]
        rig) -> None:
    client, rid, _, stored = rig
    bad = bytearray(_call(rid, 0).SerializeToString())
    bad[bad.index("héllo".encode())] = 0xFF  # a string that is not UTF-8
    request = spb.AppendCallsRequestBytes(calls=[_call(rid, 1).SerializeToString(), bytes(bad)])
    unary = client.channel.unary_unary("/harnessrl.v1.Store/AppendCalls",
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=spb.AppendCallsResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        unary(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in (err.value.details() or "")
    assert stored(0) is None and stored(1) is None  # nothing of the request stored
