"""The gateway as a harness sees it (the official openai SDK) and as the store records it.

Real store, real Redis, real gateway process; the engine is the stub upstream (vLLM-shaped
responses without a model). The same paths against the real vLLM are in test_data_path.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from conftest import TEST_SECRET, GatewayService, StoreService, StubEngineService
from harnessrl.clients import GatewayAdminClient, StoreClient
from harnessrl.credentials import CredentialSigner
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.v1 import store_pb2 as spb

SIGNER = CredentialSigner(TEST_SECRET.encode())


class World:
    def __init__(self, tmp: Path, store: StoreService, engines: list[StubEngineService],
                 *gateway_flags: str) -> None:
        self.store_svc = store
        self.store = StoreClient.connect(store.address, timeout=10)
        self.engines = engines
        self.gateway = GatewayService(
            tmp / "gw", store.address,
            [{"name": f"e{i}", "base_url": e.base_url, "model": "tiny"}
             for i, e in enumerate(engines)], *gateway_flags)
        self.admin = GatewayAdminClient.connect(self.gateway.admin_address)
        self._n = 0

    def rollout(self, attempt: int = 1) -> str:
        self._n += 1
        rid = f"run/task{self._n}/0"
        self.store.create_rollouts([c.Rollout(rollout_id=rid, run_id="run", task_id="t",
                                              group_id=f"run/task{self._n}", group_size=1,
                                              max_attempts=3, stream="-")])
        for a in range(1, attempt + 1):
            self.store.start_attempt(rid, a)
            if a < attempt:
                self.finish(rid, a, retry=True)
        return rid

    def finish(self, rid: str, attempt: int = 1, retry: bool = False) -> None:
        status = c.ROLLOUT_STATUS_FAILED if retry else c.ROLLOUT_STATUS_SUCCEEDED
        self.store.finish_attempt(spb.FinishAttemptRequest(
            rollout_id=rid, attempt=attempt, status=status, reward=1.0, will_retry=retry))

    def client(self, key: str, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.base_url, api_key=key, max_retries=0, **kw)

    def calls(self, rid: str) -> list[c.Call]:
        return list(self.store.get_rollout(rid, include_calls=True).calls)

    def close(self) -> None:
        self.gateway.stop()
        self.store.close()
        self.admin.close()


@pytest.fixture
def world(tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService
          ) -> Iterator[World]:
    w = World(tmp_path, store_service, [stub_engine], "--max-body-bytes", "200000")
    yield w
    w.close()


@contextlib.contextmanager
def shared_world(tmp: Path, redis_url: str) -> Iterator[World]:
    """A store, a stub engine and a gateway for a whole test module (tests that only need
    fresh rollouts share them: each process start costs seconds)."""
    store = StoreService(tmp / "store", redis_url, f"t{uuid.uuid4().hex[:10]}:").start()
    stub = StubEngineService(tmp / "stub")
    w = World(tmp, store, [stub])
    try:
        yield w
    finally:
        w.close()
        stub.proc.stop()
        store.stop()


def chat(client: openai.OpenAI, **kw: object):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], **kw)


def test_chat_is_forwarded_recorded_and_returned_in_api_shape(world: World) -> None:
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    resp = chat(world.client(key), temperature=0.5)
    assert resp.choices[0].message.content == "Hello, world!"
    assert resp.choices[0].logprobs is None  # the harness did not ask: none added
    raw = resp.model_extra or {}
    assert "prompt_token_ids" not in raw
    [call] = world.calls(rid)
    assert list(call.completion_token_ids) == [9906, 11, 1917, 0]
    assert list(call.prompt_token_ids) == list(range(100, 132))
    assert list(call.logprobs) == [-0.25, -0.5, -0.75, -1.0]
    assert (call.seq, call.attempt, call.engine, call.api) == (0, 1, "e0", "chat.completions")
    assert call.completion_text == "Hello, world!" and call.finish_reason == "stop"
    assert json.loads(call.request_json)["temperature"] == 0.5
    assert call.latency_s > 0 and call.started_at > 0


def test_harness_that_asks_for_logprobs_gets_them(world: World) -> None:
    rid = world.rollout()
    resp = chat(world.client(SIGNER.mint(rid, 1, 60)), logprobs=True)
    assert [t.logprob for t in resp.choices[0].logprobs.content] == [-0.25, -0.5, -0.75, -1.0]


def test_tools_and_tool_calls_pass_through(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    tools = [{"type": "function", "function": {
        "name": "add", "description": "add two numbers", "parameters": {
            "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"]}}}]
    first = chat(client, tools=tools)
    tc = first.choices[0].message.tool_calls[0]
    assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 1, "b": 2}
    second = client.chat.completions.create(model="tiny", tools=tools, messages=[
        {"role": "user", "content": "hi"}, first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tc.id, "content": "3"}])
    assert second.choices[0].message.content == "Hello, world!"
    calls = world.calls(rid)
    assert [x.seq for x in calls] == [0, 1]
    assert json.loads(calls[0].request_json)["tools"] == tools
    assert json.loads(calls[0].response_message_json)["tool_calls"][0]["function"]["name"] == "add"
    assert calls[0].finish_reason == "tool_calls"


def test_completions_and_models(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    resp = client.completions.create(model="tiny", prompt="Say hello", max_tokens=4)
    assert resp.choices[0].text == "Hello, world!" and resp.choices[0].logprobs is None
    assert [m.id for m in client.models.list().data] == ["tiny"]
    [call] = world.calls(rid)
    assert call.api == "completions" and list(call.logprobs) == [-0.25, -0.5, -0.75, -1.0]


def _status(world: World, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict]:  # type: ignore[type-arg]
    r = httpx.post(world.gateway.base_url + path, headers=headers, content=body, timeout=30)
    return r.status_code, r.json()


def test_bad_input_gets_clear_errors_and_records_nothing(world: World) -> None:
    rid = world.rollout()
    other = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    good = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode()
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    cases = {
        "malformed json": (auth, b'{"model": "tiny", "messages": [', 400, "invalid_json"),
        "not an object": (auth, b"[1, 2]", 400, "invalid_json"),
        "unknown model": (auth, good.replace(b'"tiny"', b'"gpt-9"'), 404, "model_not_found"),
        "missing key": ({"content-type": "application/json"}, good, 401, "invalid_api_key"),
        "forged key": ({"authorization": "Bearer " + CredentialSigner(b"x" * 32).mint(rid, 1, 60)},
                       good, 401, "invalid_api_key"),
        "tampered key": ({"authorization": "Bearer " + key[:-3] + "AAA"}, good, 401,
                         "invalid_api_key"),
        "expired key": ({"authorization": "Bearer " + SIGNER.mint(rid, 1, -1)}, good, 401,
                        "invalid_api_key"),
        "garbage key": ({"authorization": "Bearer sk-123"}, good, 401, "invalid_api_key"),
        "stale attempt key": ({"authorization": "Bearer " + SIGNER.mint(rid, 2, 60)}, good, 401,
                              "invalid_api_key"),
        "over size limit": (auth, b'{"model": "tiny", "messages": [], "x": "' + b"a" * 300_000
                            + b'"}', 413, "body_too_large"),
        "n > 1": (auth, good[:-1] + b', "n": 2}', 400, "unsupported_n"),
    }
    for name, (headers, body, status, code) in cases.items():
        got_status, got = _status(world, "/chat/completions", headers, body)
        assert (got_status, got["error"]["code"]) == (status, code), name
        assert got["error"]["message"], name
    assert world.calls(rid) == [] and world.calls(other) == []
    # Still serving, and the key records into its own rollout only.
    chat(world.client(key))
    assert len(world.calls(rid)) == 1 and world.calls(other) == []


def test_key_of_finished_rollout_is_refused(world: World) -> None:
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    chat(world.client(key))
    world.finish(rid)
    with pytest.raises(openai.AuthenticationError):
        chat(world.client(key))
    # A gateway that never saw the rollout refuses it too (asks the store).
    rid2 = world.rollout()
    world.finish(rid2)
    with pytest.raises(openai.AuthenticationError):
        chat(world.client(SIGNER.mint(rid2, 1, 60)))
    assert len(world.calls(rid)) == 1 and world.calls(rid2) == []


def test_retried_attempt_gets_its_own_calls(world: World) -> None:
    rid = world.rollout(attempt=2)
    with pytest.raises(openai.AuthenticationError):
        chat(world.client(SIGNER.mint(rid, 1, 60)))
    chat(world.client(SIGNER.mint(rid, 2, 60)))
    [call] = world.calls(rid)
    assert call.attempt == 2


def test_policy_version_is_recorded_and_pause_holds_calls(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    world.admin.update_engine("e0", policy_version=5)
    chat(client)
    world.admin.pause(["e0"], drain=True)
    done = threading.Event()
    t = threading.Thread(target=lambda: (chat(client), done.set()))
    t.start()
    assert not done.wait(1.0), "a call went through a paused engine"
    world.admin.update_engine("e0", policy_version=6)
    world.admin.resume(["e0"])
    assert done.wait(10)
    t.join()
    assert [x.policy_version for x in world.calls(rid)] == [5, 6]
    engines = world.admin.list_engines().engines
    assert engines[0].served_calls == 2 and not engines[0].paused


def test_reported_reward_reaches_the_store(world: World) -> None:
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    r = httpx.post(world.gateway.base_url + "/harnessrl/reward", json={"reward": 0.25},
                   headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200
    att = world.store.get_rollout(rid).attempts[0]
    assert att.has_reported_reward and att.reported_reward == 0.25
    r = httpx.post(world.gateway.base_url + "/harnessrl/reward", json={"reward": "high"},
                   headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 400


def test_rollouts_stick_to_an_engine_and_avoid_marked_ones(tmp_path: Path,
                                                           store_service: StoreService) -> None:
    engines = [StubEngineService(tmp_path / f"s{i}") for i in range(2)]
    w = World(tmp_path, store_service, engines)
    try:
        rids = [w.rollout() for _ in range(4)]
        for _ in range(3):
            for rid in rids:
                chat(w.client(SIGNER.mint(rid, 1, 60)))
        used = {rid: {x.engine for x in w.calls(rid)} for rid in rids}
        assert all(len(e) == 1 for e in used.values()), used
        assert set().union(*used.values()) == {"e0", "e1"}
        w.admin.update_engine("e0", state=gpb.ENGINE_STATE_MARKED, reason="push failed")
        for rid in rids:
            chat(w.client(SIGNER.mint(rid, 1, 60)))
            assert w.calls(rid)[-1].engine == "e1"
        # An engine that dies is routed around without the harness noticing.
        w.admin.update_engine("e0", state=gpb.ENGINE_STATE_READY)
        engines[1].proc.kill()
        for rid in rids:
            chat(w.client(SIGNER.mint(rid, 1, 60)))
            assert w.calls(rid)[-1].engine == "e0"
    finally:
        w.close()
        for e in engines:
            e.proc.stop()


def test_calls_are_held_while_the_store_is_down(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60), timeout=60)
    chat(client)
    world.store_svc.kill()
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(chat(client)))
    t.start()
    time.sleep(2.0)
    assert not result, "the harness got a response that is not recorded anywhere"
    world.store_svc.start()
    t.join(30)
    assert result and result[0].choices[0].message.content == "Hello, world!"  # type: ignore[attr-defined]
    store = StoreClient.connect(world.store_svc.address)
    assert [x.seq for x in store.get_rollout(rid, include_calls=True).calls] == [0, 1]
    store.close()


def test_calls_are_held_while_the_store_hangs(tmp_path: Path, store_service: StoreService,
                                              stub_engine: StubEngineService) -> None:
    """A store that stops answering (SIGSTOP) without closing its connections: past the batch
    timeout the gateway replaces the stream and keeps the call held; once the store answers
    again the call is recorded exactly once and only then answered."""
    w = World(tmp_path, store_service, [stub_engine], "--record-batch-timeout-s", "0.5")
    try:
        rid = w.rollout()
        client = w.client(SIGNER.mint(rid, 1, 60), timeout=60)
        chat(client)
        pid = store_service.proc.proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGSTOP)
        try:
            result: list[object] = []
            t = threading.Thread(target=lambda: result.append(chat(client)))
            t.start()
            time.sleep(2.5)  # several batch timeouts and new streams
            assert not result, "the harness got a response that is not recorded anywhere"
        finally:
            os.kill(pid, signal.SIGCONT)
        t.join(30)
        assert result and result[0].choices[0].message.content == "Hello, world!"  # type: ignore[attr-defined]
        assert [x.seq for x in w.calls(rid)] == [0, 1]
        assert "store unreachable" in (tmp_path / "gw" / "gateway.log").read_text()
    finally:
        w.close()


def test_hold_past_the_bound_fails_loudly(tmp_path: Path, store_service: StoreService,
                                          stub_engine: StubEngineService) -> None:
    w = World(tmp_path, store_service, [stub_engine], "--hold-timeout-s", "1.5")
    try:
        rid = w.rollout()
        client = w.client(SIGNER.mint(rid, 1, 60))
        chat(client)
        store_service.kill()
        with pytest.raises(openai.InternalServerError) as e:
            chat(client)
        assert e.value.status_code == 503 and "not recorded" in str(e.value)
        store_service.start()
        store = StoreClient.connect(store_service.address)
        assert len(store.get_rollout(rid, include_calls=True).calls) == 1
        store.close()
    finally:
        w.close()


def test_harness_that_gives_up_on_a_held_call_does_not_wedge_the_gateway(world: World) -> None:
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    chat(world.client(key))
    world.store_svc.kill()
    impatient = world.client(key, timeout=0.5)
    for _ in range(4):  # each request is held, then its client disconnects
        with pytest.raises(openai.APITimeoutError):
            chat(impatient)
    world.store_svc.start()
    resp = chat(world.client(key, timeout=30))
    assert resp.choices[0].message.content == "Hello, world!"
    calls = world.calls(rid)
    assert calls[0].seq == 0 and len(calls) >= 2  # held calls may land; none is lost after
    seqs = [x.seq for x in calls]
    assert seqs == sorted(set(seqs))


def test_clients_that_disconnect_mid_call_do_not_wedge_the_gateway(world: World) -> None:
    import asyncio
    import random
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}"
               f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               f"{body}").encode()

    async def hit_and_run() -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", world.gateway.http_port)
        writer.write(request)
        await asyncio.sleep(random.uniform(0, 0.004))  # gone while the call is in flight
        writer.transport.abort()

    async def storm() -> None:
        for _ in range(30):
            await asyncio.gather(*(hit_and_run() for _ in range(32)))

    asyncio.run(storm())
    resp = chat(world.client(key, timeout=10))
    assert resp.choices[0].message.content == "Hello, world!"
    seqs = [x.seq for x in world.calls(rid)]
    assert seqs == sorted(set(seqs)) and len(seqs) >= 1


def test_http_edge_cases(world: World) -> None:
    import socket
    port = world.gateway.http_port
    with socket.create_connection(("127.0.0.1", port)) as s:  # garbage is refused, not hung
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", port)) as s:  # pipelined requests, in order
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1") < 2:
            data += s.recv(4096)
        assert data.index(b"HTTP/1.1 200") < data.index(b"HTTP/1.1 404")
    r = httpx.get(world.gateway.base_url.replace("/v1", "/v1/chat/completions"))
    assert r.status_code == 405
    chunked = httpx.post(world.gateway.base_url + "/chat/completions",
                         content=iter([b'{"model": "tiny", ', b'"messages": []}']),
                         headers={"authorization": "Bearer nope"})
    assert chunked.status_code == 401  # a chunked body is read whole, then the key checked


def test_idle_and_slow_clients_are_timed_out(tmp_path: Path, store_service: StoreService,
                                             stub_engine: StubEngineService) -> None:
    import socket
    w = World(tmp_path, store_service, [stub_engine], "--http-idle-timeout-s", "1",
              "--http-read-timeout-s", "1")
    try:
        port = w.gateway.http_port
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert idle.recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert idle.recv(4096) == b""  # closed by the gateway once idle
            assert 0.5 < time.monotonic() - t0 < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            t0 = time.monotonic()
            slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            data = b""
            try:
                for _ in range(20):  # dribbles a header every 0.2 s: never completes
                    slow.sendall(b"X-Dribble: 1\r\n")
                    time.sleep(0.2)
            except OSError:
                pass
            while chunk := slow.recv(4096):
                data += chunk
            assert data.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 5
        rid = w.rollout()  # a request that keeps its connection busy is not cut off
        resp = w.client(SIGNER.mint(rid, 1, 60)).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
            extra_body={"stub_pause_s": 2.0})
        assert "".join(ch.choices[0].delta.content or "" for ch in resp if ch.choices) == \
            "Hello, world!"
    finally:
        w.close()


def test_expect_100_continue(world: World) -> None:
    import socket
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nExpect: 100-continue\r\n").encode()
    with socket.create_connection(("127.0.0.1", world.gateway.http_port), timeout=10) as s:
        s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))
        assert s.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"  # before any body was sent
        s.sendall(body)
        data = b""
        while b"Hello, world!" not in data:
            data += s.recv(4096)
        assert data.startswith(b"HTTP/1.1 200")
    with socket.create_connection(("127.0.0.1", world.gateway.http_port), timeout=10) as s:
        s.sendall(head + b"Content-Length: 999999999\r\n\r\n")  # too large: refused at once
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    assert len(world.calls(rid)) == 1


def test_an_engine_that_comes_back_gets_traffic_again(tmp_path: Path,
                                                      store_service: StoreService) -> None:
    from harnessrl import procs
    engines = [StubEngineService(tmp_path / f"s{i}") for i in range(2)]
    w = World(tmp_path, store_service, engines, "--engine-probe-interval-s", "0.2")
    back = None
    try:
        port = engines[1].port
        engines[1].proc.kill()
        for _ in range(3):  # e1 is found unreachable and routed around
            rid = w.rollout()
            chat(w.client(SIGNER.mint(rid, 1, 60)))
            assert w.calls(rid)[-1].engine == "e0"
        back, _ = procs.start_service("stub", "harnessrl.testing.stub_engine",
                                      ["--model", "tiny", "--port", str(port)],
                                      tmp_path / "back", timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # its /health answers the probe: it serves again
            rid = w.rollout()
            chat(w.client(SIGNER.mint(rid, 1, 60)))
            if w.calls(rid)[-1].engine == "e1":
                break
            time.sleep(0.2)
        assert w.calls(rid)[-1].engine == "e1"
    finally:
        w.close()
        for e in engines:
            e.proc.stop()
        if back is not None:
            back.stop()
