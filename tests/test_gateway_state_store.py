"""The gateway's per-attempt state in the store (services/store/call_log.py), through a real
store process and Redis: written with the calls, read by GetGatewayState, bounded, dropped
when the attempt ends."""

from __future__ import annotations

from array import array

import orjson
import pytest

from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from test_store import call, finish, make_group


@pytest.fixture
def client(store_service) -> StoreClient:  # type: ignore[no-untyped-def]
    cl = StoreClient.connect(store_service.address, timeout=10)
    yield cl
    cl.close()


def _started(client: StoreClient, run: str, max_attempts: int = 1) -> str:
    ros = make_group(run, "t", 1, max_attempts=max_attempts)
    client.create_rollouts(ros)
    client.start_attempt(ros[0].rollout_id, 1)
    return ros[0].rollout_id


def _seg(n: int, *drops: int) -> spb.GatewayCallState:
    """A segment state of n messages that ends the states `drops` (the gateway's choice: the
    one it extended, those pushed out of its tokens_per_rollout)."""
    return spb.GatewayCallState(segment=True, n_messages=n, digest=bytes([n]) * 16,
                                settings=b"s" * 16, drop_seqs=drops)


def _append(client: StoreClient, calls: list[c.Call], states: list[spb.GatewayCallState]
            ) -> list[int]:
    resp = client.stub.AppendCalls(spb.AppendCallsRequest(calls=calls, states=states))
    return list(resp.results)


def test_segments_are_kept_most_recent_first_replaced_and_bounded(client: StoreClient) -> None:
    rid = _started(client, "gs1")
    assert client.get_gateway_state(rid, 1).next_seq == 0
    # seq 0 starts a segment, seq 1 extends it (replaces it), seq 2 is a side conversation,
    # seq 3 is untracked (no state), seq 4 extends seq 1, seq 5 another that pushes seq 2 out
    # (a gateway keeping 2)
    assert _append(client, [call(rid, 1, 0)], [_seg(2)]) == [spb.APPEND_RESULT_STORED]
    got = client.get_gateway_state(rid, 1)
    assert got.next_seq == 1 and got.segments_sent
    [s0] = got.segments
    assert (s0.seq, s0.n_messages) == (0, 2)
    assert array("i", s0.ids).tolist() == [1, 2, 3, 0, 1, 2]  # prompt + completion ids
    _append(client, [call(rid, 1, 1), call(rid, 1, 2), call(rid, 1, 3)],
            [_seg(4, 0), _seg(2), spb.GatewayCallState()])
    got = client.get_gateway_state(rid, 1)
    assert got.next_seq == 4
    assert [s.seq for s in got.segments] == [2, 1]
    _append(client, [call(rid, 1, 4)], [_seg(6, 1)])
    assert [s.seq for s in client.get_gateway_state(rid, 1).segments] == [4, 2]
    _append(client, [call(rid, 1, 5)], [_seg(2, 2)])
    assert [s.seq for s in client.get_gateway_state(rid, 1).segments] == [5, 4]  # bounded
    _append(client, [call(rid, 1, 6)], [_seg(3, 5, 4)])  # one state may end several
    assert [s.seq for s in client.get_gateway_state(rid, 1).segments] == [6]
    # a caller whose copy is current gets no segments
    same = client.get_gateway_state(rid, 1, known_next_seq=7)
    assert same.next_seq == 7 and not same.segments_sent and not same.segments


def test_a_state_a_stored_call_extended_is_not_read_back(client: StoreClient) -> None:
    """The gateway names the states it let go a few at a time: until it does, the store still
    has the state a later call extended, and leaves it out of what it reads back."""
    rid = _started(client, "gs1b")
    later = call(rid, 1, 2)
    later.segment_start, later.segment, later.extends_seq = c.SEGMENT_START_CONTINUED, 0, 0
    _append(client, [call(rid, 1, 0), call(rid, 1, 1), later], [_seg(2), _seg(2), _seg(4)])
    got = client.get_gateway_state(rid, 1)
    assert [s.seq for s in got.segments] == [2, 1] and got.next_seq == 3
    assert got.segments[0].segment == 0


def test_a_resend_is_a_duplicate_and_another_call_on_a_taken_seq_a_conflict(
        client: StoreClient) -> None:
    rid = _started(client, "gs2")
    first = call(rid, 1, 0)
    assert _append(client, [first], [_seg(2)]) == [spb.APPEND_RESULT_STORED]
    assert _append(client, [first], [_seg(2)]) == [spb.APPEND_RESULT_DUPLICATE]
    other = call(rid, 1, 0, base=700)  # another replica's call with the same seq
    assert _append(client, [other], [_seg(4)]) == [spb.APPEND_RESULT_CONFLICT]
    # the gateway's aborted copy of a call stored complete (its client went away meanwhile)
    copy = c.Call()
    copy.CopyFrom(first)
    copy.aborted = True
    assert _append(client, [copy], [spb.GatewayCallState()]) == [spb.APPEND_RESULT_DUPLICATE]
    other.aborted = True  # an aborted call that is not a copy of the stored one
    assert _append(client, [other], [spb.GatewayCallState()]) == [spb.APPEND_RESULT_CONFLICT]
    got = client.get_rollout(rid, include_calls=True)
    assert [list(x.completion_token_ids) for x in got.calls] == [[0, 1, 2]]
    assert not got.calls[0].aborted
    assert [s.n_messages for s in client.get_gateway_state(rid, 1).segments] == [2]


def _resp(rid: str, prev: str, messages: list[dict[str, str]], keep: int = 1024
          ) -> spb.GatewayCallState:
    return spb.GatewayCallState(response_id=rid, previous_response_id=prev,
                                messages_json=orjson.dumps(messages), keep_responses=keep)


def test_a_responses_chain_resolves_from_its_entries(client: StoreClient) -> None:
    rid = _started(client, "gs3")
    m = [{"role": "user", "content": f"u{i}"} for i in range(3)]
    a = [{"role": "assistant", "content": f"a{i}"} for i in range(3)]
    _append(client, [call(rid, 1, 0), call(rid, 1, 1), call(rid, 1, 2)],
            [_resp("resp_0", "", [m[0], a[0]]), _resp("resp_1", "resp_0", [m[1], a[1]]),
             _resp("resp_2", "resp_1", [m[2], a[2]])])
    got = client.get_gateway_state(rid, 1, response_id="resp_2")
    assert got.response_found
    assert orjson.loads(got.messages_json) == [m[0], a[0], m[1], a[1], m[2], a[2]]
    mid = client.get_gateway_state(rid, 1, response_id="resp_1")
    assert orjson.loads(mid.messages_json) == [m[0], a[0], m[1], a[1]]
    assert not client.get_gateway_state(rid, 1, response_id="resp_nope").response_found
    # another rollout's responses are not visible
    other = _started(client, "gs3b")
    assert not client.get_gateway_state(other, 1, response_id="resp_2").response_found


def test_one_batch_mixes_chat_responses_and_stateless_calls(client: StoreClient) -> None:
    """Each call's keys and arguments in the append script depend on its state (the states it
    ends, a response or none): a batch mixing them, over two attempts, lands each where it
    belongs."""
    a, b = _started(client, "gs3c"), _started(client, "gs3d")
    _append(client, [call(a, 1, 0), call(a, 1, 1), call(b, 1, 0)], [_seg(2), _seg(2), _seg(2)])
    both = _resp("resp_a", "", [{"role": "user", "content": "u"}])
    both.MergeFrom(_seg(4, 0, 1))  # a Responses call that is a segment and ends two states
    assert _append(client, [call(b, 1, 1), call(a, 1, 2), call(a, 1, 3), call(b, 1, 2)],
                   [_seg(4, 0), both, spb.GatewayCallState(), _resp("resp_b", "", [])]) == \
        [spb.APPEND_RESULT_STORED] * 4
    got_a, got_b = client.get_gateway_state(a, 1, response_id="resp_a"), \
        client.get_gateway_state(b, 1, response_id="resp_b")
    assert [s.seq for s in got_a.segments] == [2] and got_a.next_seq == 4
    assert orjson.loads(got_a.messages_json) == [{"role": "user", "content": "u"}]
    assert [s.seq for s in got_b.segments] == [1] and got_b.next_seq == 3
    assert got_b.response_found and orjson.loads(got_b.messages_json) == []
    assert not client.get_gateway_state(a, 1, response_id="resp_b").response_found


def test_responses_kept_per_attempt_are_bounded(client: StoreClient) -> None:
    rid = _started(client, "gs4")
    prev = ""
    for i in range(4):
        _append(client, [call(rid, 1, i)],
                [_resp(f"resp_{i}", prev, [{"role": "user", "content": str(i)}], keep=2)])
        prev = f"resp_{i}"
    assert client.get_gateway_state(rid, 1, response_id="resp_1").response_found is False
    # resp_3 follows resp_2, whose predecessor was dropped: the chain is broken, not partial
    assert not client.get_gateway_state(rid, 1, response_id="resp_3").response_found


def test_the_state_goes_when_the_attempt_ends(client: StoreClient, store_service) -> None:  # type: ignore[no-untyped-def]
    import redis

    rid = _started(client, "gs5", max_attempts=2)
    _append(client, [call(rid, 1, 0)], [_seg(2)])
    _append(client, [call(rid, 1, 1)], [_resp("resp_x", "", [{"role": "user", "content": "q"}])])
    r = redis.Redis.from_url(store_service.redis_url)
    gw_keys = lambda: [k for k in r.keys(f"{store_service.key_prefix}gw*:{rid}:*")]  # noqa: E731
    assert len(gw_keys()) == 3 and all(r.ttl(k) > 0 for k in gw_keys())  # gws, gw, gwr
    finish(client, rid, 1, status=c.ROLLOUT_STATUS_FAILED, will_retry=True, error="boom")
    assert gw_keys() == []
    got = client.get_gateway_state(rid, 1, response_id="resp_x")
    assert not got.segments and not got.response_found
    assert got.next_seq == 2  # the calls stay
    client.start_attempt(rid, 2)
    assert client.get_gateway_state(rid, 2).next_seq == 0


class ScriptedRecorder:
    """A test double of CallRecorder: raises the errors given, one a call, then records (the
    seqs it was asked to record are kept)."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.seqs = list(errors), []  # type: ignore[var-annotated]

    async def record(self, call: c.Call, state: spb.GatewayCallState | None) -> None:
        self.seqs.append(call.seq)
        if self.errors:
            raise self.errors.pop(0)


class Segments:
    """A test double of TokenReuse: what the refreshes read (seqs of the segments loaded)."""

    def __init__(self) -> None:
        self.loaded: list[list[int]] = []

    def load(self, session: object, segments: list[spb.SegmentRecord]) -> None:
        self.loaded.append([s.seq for s in segments])


class Peers:
    """replicas.ReplicaSet's view when another replica served the rollout too (it moved here,
    or both served it while their views disagreed): this one's cache may be behind."""

    alone, epoch = False, 1

    def owns(self, rollout_id: str) -> bool:
        return False

    async def wait_ready(self, deadline: float) -> None:
        return None


def _replica(store_service, rid: str, recorder: ScriptedRecorder, next_seq: int):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from harnessrl.credentials import CredentialSigner, RolloutCredential
    from services.gateway.recording import Recording
    from services.gateway.sessions import Session, Sessions

    store = StoreClient.connect_async(store_service.address, timeout=10)
    tokens = Segments()
    sessions = Sessions(CredentialSigner(b"k" * 32), store, tokens=tokens, replicas=Peers())
    session = Session(RolloutCredential(rid, 1, 0.0), next_seq)
    session.tokens, session.epoch = [], 1  # its cache holds its own calls so far
    recording = Recording(recorder, sessions, tokens)  # type: ignore[arg-type]
    ex = SimpleNamespace(generated=None, plan=None, chain=None, session=session)
    return store, sessions, session, tokens, recording, ex


async def test_a_seq_a_replica_lost_and_a_peer_then_recorded_is_read(store_service) -> None:  # type: ignore[no-untyped-def]
    """Replica A takes seq 1 and fails to record it (the store keeps seq 1 free); peer B then
    records its call on seq 1 with no conflict. The store's next seq (2) is not past A's (2),
    yet A's next refresh reads B's segment, because A lost a seq the store has since filled."""
    from services.gateway.recorder import StoreFailed

    sync = StoreClient.connect(store_service.address, timeout=10)
    rid = _started(sync, "gs-lost")
    assert _append(sync, [call(rid, 1, 0)], [_seg(2)]) == [spb.APPEND_RESULT_STORED]
    store, sessions, a, tokens, recording, ex = _replica(
        store_service, rid, ScriptedRecorder(StoreFailed("store error")), 1)
    await sessions.refresh(a)
    assert tokens.loaded == []  # nothing new in the store: no segment read
    with pytest.raises(StoreFailed):
        await recording.record(ex, c.Call(rollout_id=rid, attempt=1, seq=a.take_seq()))
    await sessions.refresh(a)
    assert tokens.loaded == []  # seq 1 still free: nothing to read
    assert _append(sync, [call(rid, 1, 1)], [_seg(4, 0)]) == [spb.APPEND_RESULT_STORED]
    await sessions.refresh(a)
    assert tokens.loaded == [[1]] and a.next_seq == 2  # B's seq 1 read; A goes on at seq 2
    await sessions.refresh(a)
    assert tokens.loaded == [[1]]  # read once: the store is no further than A has seen
    await store.close()
    sync.close()


async def test_a_call_whose_seq_a_peer_took_is_recorded_under_the_next_free_one(
        store_service) -> None:  # type: ignore[no-untyped-def]
    """The store answers CONFLICT (a peer's call holds the seq): the replica reads the attempt
    again and records the call under the next free seq, and no seq counts as lost."""
    from services.gateway.recorder import SeqConflict

    sync = StoreClient.connect(store_service.address, timeout=10)
    rid = _started(sync, "gs-conflict")
    assert _append(sync, [call(rid, 1, 0), call(rid, 1, 1)], [_seg(2), _seg(4, 0)]) \
        == [spb.APPEND_RESULT_STORED] * 2  # seq 1 is the peer's, which this replica missed
    recorder = ScriptedRecorder(SeqConflict("seq 1 holds another call"))
    store, sessions, a, tokens, recording, ex = _replica(store_service, rid, recorder, 1)
    mine = c.Call(rollout_id=rid, attempt=1, seq=a.take_seq())
    await recording.record(ex, mine)
    assert recorder.seqs == [1, 2] and mine.seq == 2  # read again: seq 2 is the next free
    assert tokens.loaded == [[1]]  # the peer's segment came with the forced read
    assert a.next_seq == 3 and a.seen_next == 3 and not a.lost
    await store.close()
    sync.close()
