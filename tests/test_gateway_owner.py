"""Gateway replicas with rollout owners (services/gateway/ownership.py; real gateway processes
on one real store, the stub engine): each rollout's calls are served by the replica its id
hashes highest with, a call that reaches another replica is forwarded there (streams too),
every call is recorded once in order whichever replica it reached, a replica that joins takes
only its share, and a forwarded call's mark cannot be forged. (Token for token with vLLM:
tests/test_gateway_replicas_vllm.py.)"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import GatewayReplica, StoreService, StubEngineService, running_rollout
from harnessrl.clients import StoreClient
from services.gateway.rendezvous import choose


def _name(g: GatewayReplica) -> str:
    return f"{socket.gethostname()}:{g.grpc_port}"


def _chat(g: GatewayReplica, key: str, stream: bool, **headers: str) -> httpx.Response:
    return httpx.post(f"{g.url}/chat/completions", timeout=60, headers={
        "Authorization": f"Bearer {key}", **headers}, json={
        "model": "tiny", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})


def _forwarded(g: GatewayReplica) -> float:
    text = httpx.get(f"http://127.0.0.1:{g.http_port}/metrics").text
    m = re.search(r"^harnessrl_gateway_forwarded_calls_total (\S+)$", text, re.M)
    return float(m[1]) if m else 0.0


def _ready(replicas: list[GatewayReplica], timeout_s: float = 30.0) -> None:
    """Every replica answers /health 200 and lists every other (its view has them all)."""
    names = {_name(g) for g in replicas}
    store = StoreClient.connect(replicas[0].store_address, timeout=10)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            from harnessrl.v1 import gateway_pb2 as gpb
            recs = {e.key: gpb.GatewayReplica.FromString(e.value)
                    for e in store.list_state("gateway-replicas").entries
                    if not e.key.startswith("stale:")}
            listed = all(names - {n} <= set(recs[n].peers) for n in names if n in recs)
            ok = [httpx.get(f"http://127.0.0.1:{g.http_port}/health").status_code == 200
                  for g in replicas]
            if all(ok) and names <= set(recs) and listed:
                time.sleep(1.5)  # one more heartbeat: every view has every owner
                return
            time.sleep(0.2)
    finally:
        store.close()
    raise AssertionError("the replicas did not all become ready and list each other")


@pytest.fixture
def replicas(tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService
             ) -> Iterator[list[GatewayReplica]]:
    engine = {"name": "e0", "base_url": stub_engine.base_url, "model": "tiny"}
    started = [GatewayReplica(tmp_path / n, store_service.address, engine) for n in "ab"]
    for g in started:
        g.store_address = store_service.address  # type: ignore[attr-defined]
    _ready(started)
    yield started
    for g in started:
        g.stop()


def test_each_rollouts_calls_are_served_by_its_owner_whichever_replica_they_reach(
        replicas: list[GatewayReplica], store_service: StoreService) -> None:
    a, b = replicas
    names = {_name(a): a, _name(b): b}
    store = StoreClient.connect(store_service.address, timeout=10)
    rollouts = [running_rollout(store) for _ in range(8)]
    owners = {rid: names[choose(rid, names) or ""] for rid, _ in rollouts}
    assert {id(o) for o in owners.values()} == {id(a), id(b)}, "both own some (8 rollouts)"
    before = {id(g): _forwarded(g) for g in replicas}
    sent_to_non_owner = {id(a): 0, id(b): 0}
    for turn in range(4):
        for i, (rid, key) in enumerate(rollouts):
            g = replicas[(turn + i) % 2]  # alternating, so half of the calls reach a non-owner
            r = _chat(g, key, stream=turn % 2 == 1)
            assert r.status_code == 200, r.text[:300]
            if turn % 2:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
            else:
                assert r.json()["choices"][0]["message"]["content"]
            if owners[rid] is not g:
                sent_to_non_owner[id(g)] += 1
    for rid, _ in rollouts:
        calls = store.get_rollout(rid, include_calls=True).calls
        assert [c.seq for c in calls] == [0, 1, 2, 3], rid
    for g in replicas:
        assert _forwarded(g) - before[id(g)] == sent_to_non_owner[id(g)]
    store.close()


def test_a_forwarded_calls_mark_cannot_be_forged(replicas: list[GatewayReplica],
                                                store_service: StoreService) -> None:
    """A harness that sends the mark itself (to be served by a replica that does not own its
    rollout, on a stale cache) is refused by either replica."""
    store = StoreClient.connect(store_service.address, timeout=10)
    _, key = running_rollout(store)
    for g in replicas:
        r = _chat(g, key, stream=False, **{"x-harnessrl-forwarded": "0123456789ab.forged"})
        assert r.status_code == 401 and "mark" in r.text, r.text[:300]
    store.close()


def test_a_replica_that_joins_takes_only_its_share_and_calls_stay_in_order(
        tmp_path: Path, replicas: list[GatewayReplica], store_service: StoreService,
        stub_engine: StubEngineService) -> None:
    a, b = replicas
    store = StoreClient.connect(store_service.address, timeout=10)
    rollouts = [running_rollout(store) for _ in range(12)]
    for turn in range(2):
        for i, (_, key) in enumerate(rollouts):
            assert _chat(replicas[(turn + i) % 2], key, stream=False).status_code == 200
    engine = {"name": "e0", "base_url": stub_engine.base_url, "model": "tiny"}
    c = GatewayReplica(tmp_path / "c", store_service.address, engine)
    c.store_address = store_service.address  # type: ignore[attr-defined]
    try:
        three = [a, b, c]
        _ready(three)
        two_names = [_name(a), _name(b)]
        three_names = [*two_names, _name(c)]
        moved = [rid for rid, _ in rollouts if choose(rid, two_names) != choose(rid, three_names)]
        assert moved and all(choose(rid, three_names) == _name(c) for rid in moved)
        for turn in range(2, 5):
            for i, (_, key) in enumerate(rollouts):
                r = _chat(three[(turn + i) % 3], key, stream=turn % 2 == 0)
                assert r.status_code == 200, r.text[:300]
        for rid, _ in rollouts:
            calls = store.get_rollout(rid, include_calls=True).calls
            assert [x.seq for x in calls] == [0, 1, 2, 3, 4], rid
        assert _forwarded(c) > 0  # c forwarded the calls of rollouts a or b still own
    finally:
        c.stop()
        store.close()


def test_a_gone_replicas_rollouts_wait_two_heartbeats_before_they_move(
        tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService) -> None:
    """A replica that stops renewing (here: stopped; the same for one cut off from the store
    but not from its callers, which stops serving once its announcement is `replica_ttl_s`
    old) keeps its rollouts for two more heartbeats: a call for one waits at its peer, which
    serves it only once the gone replica's record is `ttl + 2 x heartbeat` old, so the two
    never serve one rollout at once. The peer's own rollouts are served meanwhile."""
    import os
    import signal

    from harnessrl.v1 import gateway_pb2 as gpb
    ttl, beat = 2.0, 0.5
    engine = {"name": "e0", "base_url": stub_engine.base_url, "model": "tiny"}
    flags = ("--replica-ttl-s", str(ttl), "--replica-heartbeat-s", str(beat))
    a, b = (GatewayReplica(tmp_path / n, store_service.address, engine, *flags) for n in "ab")
    store = StoreClient.connect(store_service.address, timeout=10)
    try:
        for g in (a, b):
            g.store_address = store_service.address  # type: ignore[attr-defined]
        _ready([a, b])
        names = [_name(a), _name(b)]
        rollouts = [running_rollout(store) for _ in range(16)]
        of_b = next(key for rid, key in rollouts if choose(rid, names) == _name(b))
        of_a = next(key for rid, key in rollouts if choose(rid, names) == _name(a))
        assert _chat(a, of_b, stream=False).status_code == 200  # forwarded to b
        assert b.proc.proc is not None
        os.kill(b.proc.proc.pid, signal.SIGSTOP)
        try:
            rec = gpb.GatewayReplica.FromString(next(
                e.value for e in store.list_state("gateway-replicas").entries
                if e.key == _name(b)))
            # past ttl and one of a's heartbeats: a counts b gone (no forward to it hangs)
            time.sleep(max(0.0, rec.renewed_at + ttl + beat + 0.1 - time.time()))
            assert _chat(a, of_a, stream=False).status_code == 200  # a's own: served at once
            r = _chat(a, of_b, stream=False)
            served_at = time.time()
            assert r.status_code == 200, r.text[:300]
            assert served_at >= rec.renewed_at + ttl + 2 * beat, \
                f"b's rollout served {served_at - rec.renewed_at:.2f}s after b's last renewal"
        finally:
            os.kill(b.proc.proc.pid, signal.SIGCONT)
    finally:
        store.close()
        for g in (a, b):
            g.stop()


def test_a_peer_whose_clock_is_behind_is_not_taken_for_a_gone_owner(
        tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService) -> None:
    """A peer that keeps renewing its announcement, but with a clock more than
    `replica_ttl_s` behind (its renewed_at looks expired), is not counted as a gone owner
    whose rollouts wait (their calls would wait on every call, then 503): the replica stays
    alone and serves them, and logs the clock difference."""
    from harnessrl.v1 import gateway_pb2 as gpb
    ttl, beat = 2.0, 0.5
    engine = {"name": "e0", "base_url": stub_engine.base_url, "model": "tiny"}
    a = GatewayReplica(tmp_path / "a", store_service.address, engine, "--replica-ttl-s",
                       str(ttl), "--replica-heartbeat-s", str(beat), "--hold-timeout-s", "4")
    store = StoreClient.connect(store_service.address, timeout=10)
    stop = threading.Event()

    def renew_behind() -> None:  # a peer 2.5 s behind: past ttl, within ttl + 2 heartbeats
        while not stop.is_set():
            rec = gpb.GatewayReplica(name="skewed", admin_address="127.0.0.1:1",
                                     http_address="127.0.0.1:1", started_at=time.time() - 60,
                                     renewed_at=time.time() - 2.5)
            store.put_state("gateway-replicas", "skewed", rec.SerializeToString())
            stop.wait(beat * 0.8)

    renewer = threading.Thread(target=renew_behind, daemon=True)
    renewer.start()
    try:
        time.sleep(4 * beat)  # a has seen it renew
        rollouts = [running_rollout(store) for _ in range(16)]
        key = next(k for rid, k in rollouts if choose(rid, [_name(a), "skewed"]) == "skewed")
        t0 = time.monotonic()
        r = _chat(a, key, stream=False)
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0, (r.status_code, r.text)
        assert "clocks differ by more than replica_ttl_s" in a.proc.log_path.read_text()
    finally:
        stop.set()
        renewer.join(5)
        store.close()
        a.stop()
