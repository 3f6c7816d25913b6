"""Anthropic Messages through the gateway (stub engine), as the `anthropic` SDK uses it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from test_gateway import SIGNER, World, shared_world

TOOLS = [{"name": "add", "description": "add two numbers",
          "input_schema": {"type": "object", "properties": {"a": {"type": "number"}}}}]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[World]:
    with shared_world(tmp_path_factory.mktemp("world"), redis_url) as w:
        yield w


def client(world: World, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=world.gateway.base_url[:-3], api_key=key, max_retries=0,
                               timeout=30)


def test_messages_text_then_tool_use_and_tool_result(world: World) -> None:
    rid = world.rollout()
    ac = client(world, SIGNER.mint(rid, 1, 60))
    msg = ac.messages.create(model="tiny", max_tokens=32, system="Be brief.",
                             messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].type == "text" and msg.content[0].text == "Hello, world!"
    assert msg.stop_reason == "end_turn" and msg.role == "assistant"
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (32, 4)
    used = ac.messages.create(model="tiny", max_tokens=32, tools=TOOLS,  # type: ignore[arg-type]
                              messages=[{"role": "user", "content": "add 1 and 2"}])
    [block] = used.content
    assert block.type == "tool_use" and block.name == "add" and block.input == {"a": 1, "b": 2}
    assert used.stop_reason == "tool_use"
    final = ac.messages.create(model="tiny", max_tokens=32, tools=TOOLS, messages=[  # type: ignore[arg-type]
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": [b.model_dump() for b in used.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                      "content": "3"}]}])
    assert final.content[0].text == "Hello, world!"
    calls = world.calls(rid)
    assert [(x.seq, x.api) for x in calls] == [(0, "messages"), (1, "messages"), (2, "messages")]
    assert list(calls[0].completion_token_ids) == [9906, 11, 1917, 0]
    assert json.loads(calls[0].request_json)["system"] == "Be brief."  # the harness's request
    assert calls[1].finish_reason == "tool_calls"


def test_streamed_messages_with_tool_use(world: World) -> None:
    rid = world.rollout()
    ac = client(world, SIGNER.mint(rid, 1, 60))
    with ac.messages.stream(model="tiny", max_tokens=32,
                            messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello, world!" and final.stop_reason == "end_turn"
    with ac.messages.stream(model="tiny", max_tokens=32, tools=TOOLS,  # type: ignore[arg-type]
                            messages=[{"role": "user", "content": "add"}]) as stream:
        kinds = [e.type for e in stream]
        used = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert used.content[0].type == "tool_use" and used.content[0].input == {"a": 1, "b": 2}
    assert used.stop_reason == "tool_use" and used.usage.output_tokens == 3
    calls = world.calls(rid)
    assert [list(x.completion_token_ids) for x in calls] == [[9906, 11, 1917, 0], [27, 5018, 28]]
    assert not any(x.aborted for x in calls)


def test_errors_come_in_anthropic_shape(world: World) -> None:
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(world, "nope").messages.create(model="tiny", max_tokens=8,
                                              messages=[{"role": "user", "content": "hi"}])
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client(world, key).messages.create(model="claude-x", max_tokens=8,
                                           messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    url = world.gateway.base_url + "/messages"
    good = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for headers, body in [
        ({"x-api-key": key}, good),  # no anthropic-version
        ({"x-api-key": key, "anthropic-version": "2023-06-01"}, {**good, "max_tokens": None}),
        ({"x-api-key": key, "anthropic-version": "2023-06-01"},
         {**good, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
    ]:
        r = httpx.post(url, headers=headers, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
    assert world.calls(rid) == []
