"""The record stream (gateway -> store `RecordCalls`) broken at each point of a batch.

A harness must get the answer that is true: 200 once its call is in the store, 401 only when
the store refused the call because its attempt is over, 502 when the store answered that it
failed, 503 when the store did not take the call within the hold bound. A store that dies,
hangs or whose stream ends INTERNAL is not a bad key. And nothing is stored twice.

Real store (its Redis), stub engine and gateway processes; between gateway and store the
`FaultyLink` test double (`harnessrl/testing/faulty_link.py`) breaks the stream before the
batch reaches the store, after it did and before the answer reaches the gateway, or halfway
through the answer, as a killed store, a hung one, or a stream that ends INTERNAL. The real
store process killed mid-stream (what the issue saw: grpc's own INTERNAL "Internal error from
Core") is driven through the gateway's recorder directly.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import openai
import pytest
import redis

from conftest import GatewayService, StubEngineService, as_identity
from harnessrl import procs, rpc
from harnessrl.clients import StoreClient
from harnessrl.testing.faulty_link import FAULTS, POINTS, FaultyLink
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.gateway.recorder import CallRecorder, RecordFailed, RecordRejected
from test_gateway import SIGNER, chat


@dataclass
class Rig:
    store_proc: procs.ServiceProcess
    store_args: list[str]
    store_address: str
    metrics_url: str
    redis: redis.Redis
    prefix: str
    store: StoreClient
    link: FaultyLink
    patient: GatewayService  # holds a call up to 30 s; a batch unanswered for 0.5 s is resent
    strict: GatewayService  # holds a call 1.5 s; waits up to 10 s for a batch's answer
    n: int = 0

    def rollout(self) -> str:
        self.n += 1
        rid = f"rf/task{self.n}/0"
        self.store.create_rollouts([c.Rollout(rollout_id=rid, run_id="rf", task_id="t",
                                              group_id=f"rf/task{self.n}", group_size=1,
                                              max_attempts=1, stream="-")])
        self.store.start_attempt(rid, 1)
        return rid

    def client(self, gateway: GatewayService, rid: str) -> openai.OpenAI:
        """A client for the rollout, after one call through it (so the session and the
        record stream are up; retried while the gateway reconnects after a killed link)."""
        client = openai.OpenAI(base_url=gateway.base_url, api_key=SIGNER.mint(rid, 1, 600),
                               max_retries=0, timeout=60)
        chat(client.with_options(max_retries=5))
        return client

    def restart_store(self) -> None:
        """Starts the (killed) store again on its port."""
        self.store_proc, info = procs.start_service(
            "store", "services.store", ["--bind", self.store_address, *self.store_args],
            self.store_proc.workdir, timeout=30)
        self.metrics_url = f"http://127.0.0.1:{info['metrics_port']}/metrics"

    def seqs(self, rid: str) -> list[int]:
        """The sequence numbers stored for the rollout, read from Redis itself."""
        return sorted(int(k) for k in self.redis.hkeys(f"{self.prefix}calls:{rid}:1"))

    def appended(self) -> dict[str, float]:
        text = httpx.get(self.metrics_url, timeout=5).text
        return {m[1]: float(m[2]) for m in re.finditer(
            r'^harnessrl_store_calls_appended_total\{result="(\w+)"\} (\S+)$', text, re.M)}


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("record-faults")
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    pool = ThreadPoolExecutor(2)  # processes start (and stop) two at a time
    store_args = ["--redis-url", redis_url, "--key-prefix", prefix,
                  "--metrics-bind", "127.0.0.1:0"]
    started = pool.submit(procs.start_service, "store", "services.store",
                          ["--bind", "127.0.0.1:0", *store_args], tmp / "store", None, 30)
    stub = StubEngineService(tmp / "stub")
    store_proc, info = started.result()
    store_address = f"127.0.0.1:{info['grpc_port']}"
    # mTLS ended on both sides (the gateway's calls reach the store as the gateway's)
    link = FaultyLink(store_address, serve_as=as_identity("store"),
                      connect_as=as_identity("gateway")).start()
    engines: list[dict[str, object]] = [{"name": "e0", "base_url": stub.base_url,
                                         "model": "tiny"}]
    # (each its own replica set: as peers, one would forward the other's rollouts to itself)
    patient = pool.submit(GatewayService, tmp / "patient", link.address, engines,
                          "--hold-timeout-s", "30", "--record-batch-timeout-s", "0.5",
                          "--replica-namespace", "patient")
    strict = pool.submit(GatewayService, tmp / "strict", link.address, engines,
                         "--hold-timeout-s", "1.5", "--replica-namespace", "strict")
    rig = None
    try:
        rig = Rig(store_proc, store_args, store_address,
                  f"http://127.0.0.1:{info['metrics_port']}/metrics",
                  redis.Redis.from_url(redis_url), prefix,
                  StoreClient.connect(store_address, timeout=10), link, patient.result(),
                  strict.result())
        yield rig
    finally:
        stops = [pool.submit(gw.result().stop) for gw in (patient, strict)
                 if gw.exception() is None]
        for stop in stops:
            stop.result()
        pool.shutdown()
        if rig is not None:
            rig.store.close()
            rig.redis.close()
        link.stop()
        stub.proc.stop()
        (rig.store_proc if rig is not None else store_proc).stop()


@pytest.fixture
def link(rig: Rig) -> Iterator[FaultyLink]:
    rig.link.reset()
    yield rig.link
    rig.link.reset()


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("point", POINTS)
def test_a_broken_record_stream_is_held_and_the_call_recorded_once(
        rig: Rig, link: FaultyLink, point: str, fault: str) -> None:
    rid = rig.rollout()
    client = rig.client(rig.patient, rid)
    before = rig.appended()
    link.arm(point, fault, rid)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(chat, client)
        assert link.retried.wait(30), "the gateway never tried again"
        if fault != "internal":  # (an INTERNAL stream's resend passes at once)
            assert not pending.done()  # held, not answered
        link.reset()  # the store is back
        resp = pending.result()
    assert resp.choices[0].message.content == "Hello, world!"
    # Two responses, two calls in Redis: the held one recorded, and once.
    assert rig.seqs(rid) == [0, 1]
    if point != "before_send":  # the store had it before the break: the resend was a duplicate
        assert rig.appended()["duplicate"] - before.get("duplicate", 0) >= 1


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_that_stays_broken_gets_503_at_the_bound(rig: Rig, link: FaultyLink,
                                                         fault: str) -> None:
    rid = rig.rollout()
    client = rig.client(rig.strict, rid)
    link.arm("after_send", fault, rid, persistent=True)
    with pytest.raises(openai.APIStatusError) as err:
        chat(client)
    assert err.value.status_code == 503, err.value
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "store_unavailable"
    assert "call not recorded" in body["message"] and "last failure" in body["message"]
    assert rig.seqs(rid) == [0, 1]  # the store had taken it (after_send): once


def test_the_store_answers_are_the_only_refusals(rig: Rig, link: FaultyLink) -> None:
    # Its attempt over: the store refuses the call, 401 (as for that key at authentication).
    rid = rig.rollout()
    client = rig.client(rig.patient, rid)
    rig.store.finish_attempt(spb.FinishAttemptRequest(
        rollout_id=rid, attempt=1, status=c.ROLLOUT_STATUS_SUCCEEDED, reward=1.0))
    with pytest.raises(openai.AuthenticationError) as refused:
        chat(client)
    assert refused.value.body["code"] == "rollout_closed"  # type: ignore[index]
    assert "not running" in refused.value.message
    # The store fails to store it (its own error): 502 with the store's reason, at once.
    rid = rig.rollout()
    client = rig.client(rig.patient, rid)
    rig.redis.set(f"{rig.prefix}calls:{rid}:1", "not a hash")  # a broken rollout
    with pytest.raises(openai.APIStatusError) as failed:
        chat(client)
    assert failed.value.status_code == 502
    assert failed.value.body["code"] == "store_error"  # type: ignore[index]
    assert "WRONGTYPE" in failed.value.message
    other = rig.rollout()  # other rollouts are recorded as before
    assert chat(rig.client(rig.patient, other)).choices[0].message.content == "Hello, world!"
    assert rig.seqs(other) == [0, 1]


def test_a_batch_the_store_cannot_store_is_answered_in_the_stream(rig: Rig) -> None:
    good, broken = rig.rollout(), rig.rollout()
    rig.redis.set(f"{rig.prefix}calls:{broken}:1", "not a hash")

    async def run() -> list[spb.AppendCallsResponse]:
        store = StoreClient.connect_async(rig.store_address)
        stream = store.record_calls()
        answers = []
        for batch in ([_call(good, 0), _call(broken, 0), _call(good, 1)], [_call(good, 2)]):
            await stream.write(spb.AppendCallsRequest(calls=batch))
            answers.append(await stream.read())
        stream.cancel()
        await store.channel.close()
        return answers

    first, second = asyncio.run(run())
    recorded = (spb.APPEND_RESULT_STORED, spb.APPEND_RESULT_DUPLICATE)  # (Redis keeps what
    # the failed batch wrote before the broken key: appended again alone, it is a duplicate)
    assert first.results[0] in recorded and first.results[2] in recorded
    assert first.results[1] == spb.APPEND_RESULT_FAILED and "WRONGTYPE" in first.reasons[1]
    assert list(second.results) == [spb.APPEND_RESULT_STORED]  # the stream stayed open
    assert rig.seqs(good) == [0, 1, 2]


def test_a_malformed_call_is_a_server_error_not_a_bad_key(rig: Rig) -> None:
    rid = rig.rollout()
    bad = _call(rid, 0)
    del bad.logprobs[-1]

    async def run() -> None:
        store = StoreClient.connect_async(rig.store_address)
        recorder = CallRecorder(store, hold_timeout_s=30)
        with pytest.raises(RecordFailed) as err:
            await recorder.record(bad)
        assert not isinstance(err.value, RecordRejected) and err.value.status == 500
        assert "one logprob per token" in str(err.value)
        await recorder.close()
        await store.channel.close()

    asyncio.run(run())
    assert rig.seqs(rid) == []


def test_the_store_killed_mid_stream_is_held_not_refused(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """The issue's case: the store process dies (kill -9) while the record stream is idle, and
    the next batch is written to the dead stream: grpc fails that write with a status of its
    own making, INTERNAL "Internal error from Core". The call is held, and recorded once the
    store is back."""
    rid = rig.rollout()

    async def run() -> None:
        # (the channel reconnects within 0.2 s of the store's return, not grpc's default 1-120)
        channel = rpc.aio_channel(rig.store_address, "store", extra_options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 200)])
        store = _KillBeforeNextWrite(StoreClient(channel), rig.store_proc.kill)
        recorder = CallRecorder(store, hold_timeout_s=60)
        await recorder.record(_call(rid, 0))
        store.armed = True
        held = asyncio.ensure_future(recorder.record(_call(rid, 1)))
        while recorder.store_down_since is None and not held.done():
            await asyncio.sleep(0.01)  # until it meets the dead stream
        assert not held.done()  # held, not refused
        await asyncio.to_thread(rig.restart_store)
        await held
        await recorder.close()
        await channel.close()

    with caplog.at_level("WARNING", "harnessrl.gateway.recorder"):
        asyncio.run(run())
    assert "INTERNAL: Internal error from Core" in caplog.text  # the status, met
    assert rig.seqs(rid) == [0, 1]


class _KillBeforeNextWrite:
    """The real store client; once `armed`, the real store process is killed right before the
    next batch is written to its stream: the write comes once the channel knows the connection
    is gone and before the event loop has run, so before the stream could be told. (That is
    the window the issue's INTERNAL comes from; a write that races the death instead may still
    reach the socket, and its stream then ends UNAVAILABLE.)"""

    def __init__(self, store: StoreClient, kill: Callable[[], None]) -> None:
        self.store, self.kill, self.armed = store, kill, False

    def _kill_and_wait(self) -> None:
        self.kill()
        deadline = time.monotonic() + 30
        while self.store.channel.get_state() == grpc.ChannelConnectivity.READY:
            assert time.monotonic() < deadline, "the channel never saw the store die"
            time.sleep(0.005)  # blocks the loop on purpose

    def record_calls(self) -> Any:
        stream, link = self.store.record_calls(), self
        write = stream.write

        async def write_after_kill(request: spb.AppendCallsRequest) -> None:
            if link.armed:
                link.armed = False
                link._kill_and_wait()
            await write(request)
        stream.write = write_after_kill
        return stream


def _call(rid: str, seq: int) -> c.Call:
    return c.Call(rollout_id=rid, attempt=1, seq=seq, prompt_token_ids=[1, 2],
                  completion_token_ids=[3, 4], logprobs=[-0.5, -0.25])
