"""Streaming through the gateway (stub engine): OpenAI's event format, no buffering, the call
recorded before `[DONE]`, a client that disconnects mid-stream recorded as aborted."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from harnessrl.v1 import common_pb2 as c
from services.trainer.samples import rollout_samples
from test_gateway import SIGNER, World, chat, shared_world


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[World]:
    with shared_world(tmp_path_factory.mktemp("world"), redis_url) as w:
        yield w


def test_streamed_chat_is_relayed_in_openai_format_and_recorded(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "Hello, world!"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert all(ch.choices[0].logprobs is None for ch in chunks if ch.choices)
    assert all("token_ids" not in (ch.choices[0].model_extra or {})
               and "prompt_token_ids" not in (ch.model_extra or {}) for ch in chunks if ch.choices)
    [call] = world.calls(rid)
    assert list(call.completion_token_ids) == [9906, 11, 1917, 0]
    assert list(call.prompt_token_ids) == list(range(100, 132))
    assert list(call.logprobs) == [-0.25, -0.5, -0.75, -1.0]
    assert call.completion_text == text and call.finish_reason == "stop" and not call.aborted
    assert json.loads(call.request_json)["stream"] is True


def test_streamed_tool_call_and_harness_asking_for_ids_and_logprobs(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with client.chat.completions.stream(
            model="tiny", messages=[{"role": "user", "content": "hi"}], tools=tools,
            logprobs=True, extra_body={"return_token_ids": True}) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    tc = final.choices[0].message.tool_calls[0]
    assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 1, "b": 2}
    assert final.choices[0].finish_reason == "tool_calls"
    chunks = [e.chunk for e in events if e.type == "chunk"]
    assert (chunks[0].model_extra or {})["prompt_token_ids"] == list(range(100, 132))
    assert [i for ch in chunks for i in (ch.choices[0].model_extra or {}).get("token_ids") or []
            ] == [27, 5018, 28]
    [call] = world.calls(rid)
    assert list(call.completion_token_ids) == [27, 5018, 28] and call.finish_reason == "tool_calls"
    msg = json.loads(call.response_message_json)
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}


def test_streamed_completions(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    chunks = list(client.completions.create(model="tiny", prompt="Say", stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "Hello, world!"
    assert all(ch.choices[0].logprobs is None for ch in chunks)
    [call] = world.calls(rid)
    assert call.api == "completions" and list(call.completion_token_ids) == [9906, 11, 1917, 0]
    assert list(call.prompt_token_ids) == list(range(100, 132))


def _raw_stream(world: World, key: str, body: dict) -> socket.socket:  # type: ignore[type-arg]
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", world.gateway.http_port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
              + key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def test_tokens_reach_the_client_as_generated_and_done_waits_for_the_store(
        world: World) -> None:
    """The stub pauses 3 s after its first token: the client must hold that token long
    before, so a gateway that buffers the stream cannot pass."""
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    t0 = time.monotonic()
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_body={"stub_pause_s": 3.0})
    got = ""
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            got = ch.choices[0].delta.content
            break
    assert got == "Hello" and time.monotonic() - t0 < 2.0
    assert world.calls(rid) == []  # still generating: nothing recorded yet
    rest = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert got + rest == "Hello, world!" and time.monotonic() - t0 >= 3.0
    [call] = world.calls(rid)  # recorded before [DONE] reached the client
    assert call.completion_text == "Hello, world!"


def test_client_disconnecting_mid_stream_leaves_an_aborted_call(world: World) -> None:
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    s = _raw_stream(world, key, {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                 "stream": True, "stub_pause_s": 5.0})
    data = b""
    while b"Hello" not in data:
        data += s.recv(4096)
    assert data.startswith(b"HTTP/1.1 200") and b"text/event-stream" in data
    s.close()  # gone after the first token
    deadline = time.monotonic() + 10
    while not world.calls(rid) and time.monotonic() < deadline:
        time.sleep(0.05)
    [aborted] = world.calls(rid)
    assert aborted.aborted and aborted.seq == 0 and aborted.finish_reason == "abort"
    assert list(aborted.completion_token_ids) == [9906] and list(aborted.logprobs) == [-0.25]
    # The harness's next call works and is numbered after the aborted one.
    assert chat(world.client(key)).choices[0].message.content == "Hello, world!"
    calls = world.calls(rid)
    assert [(x.seq, x.aborted) for x in calls] == [(0, True), (1, False)]
    # The trainer skips the aborted call.
    ro = c.Rollout(rollout_id=rid, reward=1.0, calls=calls)
    [sample] = rollout_samples(ro, advantage=1.0)[0]
    assert sample.call_seqs == [1]


def test_streams_and_plain_calls_interleave_on_one_rollout(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    threads = [threading.Thread(target=lambda: list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)))
        for _ in range(8)]
    for t in threads:
        t.start()
    chat(client)
    for t in threads:
        t.join()
    calls = world.calls(rid)
    assert sorted(x.seq for x in calls) == list(range(9))
    assert all(not x.aborted and x.completion_text == "Hello, world!" for x in calls)


def _run_rollout(world: World, run_id: str, spec: c.RunSpec) -> str:
    world.store.put_run(c.Run(run_id=run_id, spec=spec, status=c.RUN_STATUS_RUNNING))
    rid = f"{run_id}/t/0"
    world.store.create_rollouts([c.Rollout(rollout_id=rid, run_id=run_id, task_id="t",
                                           group_id=f"{run_id}/t", group_size=1,
                                           max_attempts=1, stream="-")])
    world.store.start_attempt(rid, 1)
    return rid


def test_the_run_governs_sampling_and_model_names(world: World) -> None:
    spec = c.RunSpec(name="r", model="tiny", sampling=c.SamplingPolicy(temperature=1.0,
                                                                          max_tokens=16))
    rid = _run_rollout(world, "run-s", spec)
    client = world.client(SIGNER.mint(rid, 1, 60))
    resp = client.chat.completions.create(  # the harness's own model name and settings
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], temperature=0,
        max_completion_tokens=500, extra_body={"top_k": 5})
    assert resp.choices[0].message.content == "Hello, world!"
    list(client.chat.completions.create(model="gpt-4o", stream=True, messages=[
        {"role": "user", "content": "hi"}]))
    plain, streamed = world.calls(rid)
    assert plain.model == "gpt-4o" and json.loads(plain.request_json)["temperature"] == 0
    assert json.loads(plain.sampling_override_json) == {
        "imposed": {"temperature": 1.0, "max_tokens": 16},
        "harness": {"temperature": 0, "max_completion_tokens": 500, "top_k": 5}}
    assert json.loads(streamed.sampling_override_json)["harness"] == {}
    # A policy the trainer cannot match is refused, loudly, before anything is generated.
    bad = _run_rollout(world, "run-t", c.RunSpec(name="r", model="tiny",
                                                 sampling=c.SamplingPolicy(temperature=0.7)))
    import openai
    with pytest.raises(openai.BadRequestError) as err:
        chat(world.client(SIGNER.mint(bad, 1, 60)))
    assert err.value.code == "unmatched_sampling" and "temperature=0.7" in str(err.value)
    assert world.calls(bad) == []
