"""OpenAI Responses through the gateway (stub engine), as the `openai` SDK uses it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from test_gateway import SIGNER, World, shared_world

TOOLS = [{"type": "function", "name": "add", "description": "add two numbers",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[World]:
    with shared_world(tmp_path_factory.mktemp("world"), redis_url) as w:
        yield w


def test_responses_function_call_then_chain_by_previous_response_id(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    plain = client.responses.create(model="tiny", input="hi", instructions="Be brief.")
    assert plain.output_text == "Hello, world!" and plain.status == "completed"
    assert plain.usage is not None and plain.usage.output_tokens == 4
    first = client.responses.create(model="tiny", input="add 1 and 2", tools=TOOLS)  # type: ignore[arg-type]
    [fc] = first.output
    assert fc.type == "function_call" and fc.name == "add"
    assert json.loads(fc.arguments) == {"a": 1, "b": 2}
    second = client.responses.create(model="tiny", previous_response_id=first.id, tools=TOOLS,  # type: ignore[arg-type]
                                     input=[{"type": "function_call_output",
                                             "call_id": fc.call_id, "output": "3"}])
    assert second.output_text == "Hello, world!"
    calls = world.calls(rid)
    assert [x.api for x in calls] == ["responses"] * 3
    # The chained request reached the engine as the whole conversation.
    assert calls[2].finish_reason == "stop" and list(calls[1].completion_token_ids) == [27, 5018, 28]
    # Another rollout cannot continue this one's chain.
    other = world.client(SIGNER.mint(world.rollout(), 1, 60))
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="tiny", previous_response_id=first.id, input="x")


def test_streamed_responses(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    with client.responses.stream(model="tiny", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello, world!"
    with client.responses.stream(model="tiny", input="add", tools=TOOLS) as stream:  # type: ignore[arg-type]
        kinds = [e.type for e in stream]
        used = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert used.output[0].type == "function_call"
    assert json.loads(used.output[0].arguments) == {"a": 1, "b": 2}
    chained = client.responses.create(model="tiny", previous_response_id=used.id, input=[
        {"type": "function_call_output", "call_id": used.output[0].call_id, "output": "3"}])
    assert chained.output_text == "Hello, world!"
    calls = world.calls(rid)
    assert [list(x.completion_token_ids) for x in calls[:2]] == [[9906, 11, 1917, 0],
                                                                 [27, 5018, 28]]
    assert not any(x.aborted for x in calls) and len(calls) == 3
