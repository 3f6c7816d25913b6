"""Two gateway replicas on one store (real processes; the stub engine): a pause for a weight
push holds every replica's calls before it answers, an engine change made through one replica
is in effect on the other, and a replica that could not be reached is flagged stale and takes
no calls until it has caught up. (Tokens across replicas with vLLM:
tests/test_gateway_replicas_vllm.py.)"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from conftest import GatewayReplica, RestartableRedis, StoreService, StubEngineService, \
    TEST_SECRET, running_rollout, wait_aof_written
from harnessrl.clients import GatewayAdminClient, StoreClient
from harnessrl.credentials import CredentialSigner

SIGNER = CredentialSigner(TEST_SECRET.encode())


@dataclass
class Pair:
    store: StoreClient
    a: GatewayReplica
    b: GatewayReplica
    stub: StubEngineService

    def key(self) -> tuple[str, str]:
        return running_rollout(self.store)

    def completions_seen(self) -> list[float]:
        log = httpx.get(f"{self.stub.base_url}/stub/log").json()
        return [e["t"] for e in log if e["path"] == "/v1/chat/completions"]


def _chat(url: str, key: str, timeout: float = 30.0, pause_s: float = 0.0) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      timeout=timeout, json={
                          "model": "tiny", "stream": True, "stub_pause_s": pause_s,
                          "messages": [{"role": "user", "content": "hi"}]})


def _both_ready(pair: Pair, timeout_s: float = 20.0) -> None:
    """Each replica lists the other (they then check the store on every call)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ok = [httpx.get(f"http://127.0.0.1:{g.http_port}/health").status_code == 200
              for g in (pair.a, pair.b)]
        if all(ok):
            return
        time.sleep(0.2)
    raise AssertionError("the replicas did not both become ready")


@pytest.fixture
def pair(tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService
         ) -> Iterator[Pair]:
    engine = {"name": "e0", "base_url": stub_engine.base_url, "model": "tiny"}
    a = GatewayReplica(tmp_path / "a", store_service.address, engine)
    b = GatewayReplica(tmp_path / "b", store_service.address, engine)
    store = StoreClient.connect(store_service.address, timeout=10)
    p = Pair(store, a, b, stub_engine)
    _both_ready(p)
    yield p
    store.close()
    for g in (a, b):
        g.proc.signal(signal.SIGCONT)
        g.stop()


def test_a_pause_holds_both_replicas_and_held_calls_finish_on_the_new_version(pair: Pair
                                                                              ) -> None:
    results: list[tuple[str, float, int]] = []  # (replica, sent at, status)
    stop = threading.Event()
    rollouts: dict[str, str] = {}

    def worker(name: str, url: str) -> None:
        rid, key = pair.key()
        rollouts[rid] = name
        while not stop.is_set():
            t = time.time()
            results.append((name, t, _chat(url, key, pause_s=0.2).status_code))

    threads = [threading.Thread(target=worker, args=(n, f"http://127.0.0.1:{g.http_port}/v1"))
               for n, g in (("a", pair.a), ("b", pair.b)) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    admin_a = GatewayAdminClient.connect(pair.a.admin_address)
    admin_b = GatewayAdminClient.connect(pair.b.admin_address)
    admin_a.pause(["e0"], drain=True)
    paused_at = time.time()
    time.sleep(1.5)  # both replicas keep receiving calls, and hold them
    admin_b.update_engine("e0", policy_version=1)  # the push, through the other replica
    resumed_at = time.time()
    admin_a.resume(["e0"])
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(60)
    admin_a.close()
    admin_b.close()
    assert results and all(status == 200 for _, _, status in results), results
    # nothing reached the engine through either replica between the pause and the resume
    assert [t for t in pair.completions_seen() if paused_at < t < resumed_at] == []
    held = {"a": 0, "b": 0}
    for rid, name in rollouts.items():
        for call in pair.store.get_rollout(rid, include_calls=True).calls:
            if paused_at < call.started_at < resumed_at:
                assert call.policy_version == 1, (name, call.seq)
            # a call that arrived before the push was done and ran on its version was held (it
            # may have arrived while the pause drained, before the Pause RPC answered)
            if call.started_at < resumed_at and call.policy_version == 1:
                held[name] += 1
    assert held["a"] >= 1 and held["b"] >= 1, held  # each replica held calls and served them


def test_an_unreachable_replica_is_flagged_stale_and_catches_up_before_taking_calls(
        pair: Pair) -> None:
    rid, key = pair.key()
    url_b = f"http://127.0.0.1:{pair.b.http_port}/v1"
    assert _chat(url_b, key).status_code == 200
    pair.b.proc.signal(signal.SIGSTOP)  # alive, its port open, answering nothing
    admin_a = GatewayAdminClient.connect(pair.a.admin_address)
    t0 = time.monotonic()
    admin_a.pause(["e0"], drain=True, drain_timeout_s=1.0)  # answers, having flagged b
    assert time.monotonic() - t0 < 15
    assert pair.store.get_state("gateway-replicas", "stale:" + b_name(pair)) is not None
    pair.b.proc.signal(signal.SIGCONT)
    # b reads the registry again (the engine is paused there too) before it takes calls
    held: dict[str, int] = {}
    t = threading.Thread(target=lambda: held.update(status=_chat(url_b, key).status_code))
    t.start()
    t.join(3.0)
    assert t.is_alive(), "a call through the stale replica reached the paused engine"
    deadline = time.monotonic() + 15
    while pair.store.get_state("gateway-replicas", "stale:" + b_name(pair)) is not None:
        assert time.monotonic() < deadline, "b never caught up"
        time.sleep(0.2)
    admin_a.resume(["e0"])
    t.join(30)
    assert held == {"status": 200}
    admin_a.close()
    assert "flagged stale" in pair.b.proc.log_tail(200)


def b_name(pair: Pair) -> str:
    import socket
    return f"{socket.gethostname()}:{pair.b.grpc_port}"


def test_a_replica_sent_sigterm_finishes_its_calls_while_the_other_takes_new_ones(
        pair: Pair) -> None:
    """A rolling restart's step: the terminated replica reports not ready, refuses new
    connections, answers the call in flight in full (recorded), and exits; the rollout's next
    call goes to the other replica; the restarted one joins again."""
    rid, key = pair.key()
    url_a, url_b = (f"http://127.0.0.1:{g.http_port}/v1" for g in (pair.a, pair.b))
    in_flight: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: in_flight.update(r=_chat(url_a, key, pause_s=3.0)))
    t.start()
    time.sleep(1.0)
    pair.a.proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while True:  # the listening socket closes at once: a Service's next connection goes to b
        try:
            httpx.get(f"http://127.0.0.1:{pair.a.http_port}/health", timeout=1)
        except httpx.ConnectError:
            break
        assert time.monotonic() < deadline, "the terminated replica kept accepting connections"
        time.sleep(0.05)
    assert t.is_alive(), "the call in flight ended before its response was due"
    t.join(30)
    assert pair.a.proc.proc is not None
    assert pair.a.proc.proc.wait(15) == 0
    r = in_flight["r"]
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    assert _chat(url_b, key).status_code == 200
    calls = pair.store.get_rollout(rid, include_calls=True).calls
    assert [call.seq for call in calls] == [0, 1]
    assert "stopped serving HTTP" in pair.a.proc.log_tail(50)
    pair.a.proc = pair.a.proc.respawn()
    pair.a.proc.wait_ready(30)
    _both_ready(pair)
    assert _chat(url_a, key).status_code == 200


def test_a_pause_is_not_done_while_another_replicas_calls_have_not_drained(pair: Pair) -> None:
    """A replica reached but not drained in time is not "unreachable": the pause fails there
    (UNAVAILABLE, which the client's retry policy sends again), as one gateway's would, so it
    answers only once that replica's call has finished; it does not flag the replica stale
    and answer while the call still runs on the engine."""
    rid, key = pair.key()
    url_b = f"http://127.0.0.1:{pair.b.http_port}/v1"
    done: dict[str, float] = {}

    def call() -> None:
        assert _chat(url_b, key, pause_s=4.0).status_code == 200
        done["at"] = time.monotonic()
    seen = len(pair.completions_seen())
    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 15  # the call is at the engine (on a loaded machine the
    while len(pair.completions_seen()) == seen:  # gateway may take over a second to send it;
        assert time.monotonic() < deadline  # paused before, it would wait for the resume)
        time.sleep(0.1)
    admin_a = GatewayAdminClient.connect(pair.a.admin_address)
    admin_a.pause(["e0"], drain=True, drain_timeout_s=1.0)
    answered = time.monotonic()
    t.join(30)
    assert "at" in done and answered >= done["at"] - 0.5, (answered, done)
    assert pair.store.get_state("gateway-replicas", "stale:" + b_name(pair)) is None
    assert "flagged stale" not in pair.a.proc.log_tail(200)
    admin_a.resume(["e0"])
    admin_a.close()


def test_a_replica_that_joins_reads_the_changes_made_before_its_peers_listed_it(
        tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService) -> None:
    """b starts; a pause is made through a before a's heartbeat lists b (so nothing is
    forwarded to b): once listed, b reads the registry again and holds its calls too.
    a announces itself as it starts and next reads the others 15 s later: b starts and the
    pause is made within that window (b's start takes 1-3 s), and the test checks it was."""
    engine = {"name": "e0", "base_url": stub_engine.base_url, "model": "tiny"}
    slow = ("--replica-heartbeat-s", "15", "--replica-ttl-s", "40")
    a = GatewayReplica(tmp_path / "a", store_service.address, engine, *slow)
    started = time.monotonic()
    store = StoreClient.connect(store_service.address, timeout=10)
    try:
        b = GatewayReplica(tmp_path / "b", store_service.address, engine,
                           "--replica-ttl-s", "40")
        try:
            pair = Pair(store, a, b, stub_engine)
            admin_a = GatewayAdminClient.connect(a.admin_address)
            admin_a.pause(["e0"], drain=True)
            import harnessrl.v1.gateway_pb2 as gpb
            a_rec = gpb.GatewayReplica.FromString(
                store.get_state("gateway-replicas", f"{_host()}:{a.grpc_port}") or b"")
            assert f"{_host()}:{b.grpc_port}" not in a_rec.peers, \
                f"a listed b before the pause ({time.monotonic() - started:.1f}s after a started)"
            paused_at = time.time()
            rid, key = pair.key()
            held: dict[str, int] = {}
            t = threading.Thread(target=lambda: held.update(status=_chat(b.url, key).status_code))
            t.start()
            t.join(max(0.0, started + 19.0 - time.monotonic()))  # a lists b at its next
            # heartbeat (15 s after it started); b then joins
            assert t.is_alive(), "a call through the joining replica reached the paused engine"
            assert httpx.get(f"http://127.0.0.1:{b.http_port}/health").status_code == 200
            resumed_at = time.time()
            admin_a.resume(["e0"])
            t.join(30)
            admin_a.close()
            assert held == {"status": 200}
            assert [x for x in pair.completions_seen() if paused_at < x < resumed_at] == []
        finally:
            b.stop()
    finally:
        a.stop()
        store.close()


def _host() -> str:
    import socket
    return socket.gethostname()


def test_the_flag_of_a_replica_gone_for_good_is_removed(pair: Pair) -> None:
    """`stale:<name>` of a replica with no record (it left; pod names change) goes at the
    replicas' next heartbeat; the flag of one whose record is still there (expired, not long
    gone: it may come back and must catch up) stays until its record goes."""
    from harnessrl.v1 import gateway_pb2 as gpb

    ns = "gateway-replicas"
    recent = gpb.GatewayReplica(name="pod-recent", admin_address="127.0.0.1:1",
                                started_at=time.time() - 60, renewed_at=time.time() - 12)
    pair.store.put_state(ns, "pod-recent", recent.SerializeToString())
    pair.store.put_state(ns, "stale:pod-recent", b"")
    pair.store.put_state(ns, "stale:pod-gone", b"")
    deadline = time.monotonic() + 10
    while pair.store.get_state(ns, "stale:pod-gone") is not None:
        assert time.monotonic() < deadline, "the flag of a replica with no record stayed"
        time.sleep(0.2)
    time.sleep(2.5)  # more heartbeats of both replicas
    assert pair.store.get_state(ns, "stale:pod-recent") is not None
    recent.renewed_at = time.time() - 120  # over 10 x replica_ttl_s: long gone
    pair.store.put_state(ns, "pod-recent", recent.SerializeToString())
    deadline = time.monotonic() + 10
    while pair.store.get_state(ns, "stale:pod-recent") is not None or \
            pair.store.get_state(ns, "pod-recent") is not None:
        assert time.monotonic() < deadline, "a long-gone replica's record or flag stayed"
        time.sleep(0.2)


def test_with_peers_a_store_outage_holds_the_state_read(
        tmp_path: Path, own_redis: RestartableRedis, key_prefix: str) -> None:
    """With peers each call first reads the attempt's state from the store
    (`Sessions.refresh`). The store's Redis down (the store answers UNAVAILABLE) holds that
    read, as one gateway holds its record, up to `hold_timeout_s`, instead of answering 503 at
    once: here Redis comes back after 3 s and the read returns the state."""
    import asyncio

    from services.gateway.sessions import Session, Sessions

    store_svc = StoreService(tmp_path / "store", own_redis.url, key_prefix).start()
    store = StoreClient.connect(store_svc.address, timeout=10)
    back = threading.Timer(3.0, own_redis.start)  # Redis back 3 s after it is killed
    try:
        rid, key = running_rollout(store)
        mark = f"aof-mark-{uuid.uuid4().hex}"  # written after the rollout's writes: once it
        redis.Redis.from_url(own_redis.url).set(mark, 1)  # is in the AOF (a prefix), they are
        wait_aof_written(own_redis.data_dir, mark)
        own_redis.kill()
        back.start()

        async def read() -> int:
            client = StoreClient.connect_async(store_svc.address, timeout=10)
            sessions = Sessions(SIGNER, client, hold_timeout_s=60)
            t0 = time.monotonic()
            st = await sessions._state(Session(SIGNER.verify(key), 0), -1, "")
            assert time.monotonic() - t0 >= 2.5  # held until Redis was back
            await client.close()
            return st.next_seq
        assert asyncio.run(read()) == 0
    finally:
        back.cancel()  # a test that failed early must not start Redis after its teardown
        if back.ident is not None:
            back.join()
        store.close()
        store_svc.stop()
