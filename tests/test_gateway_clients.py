"""Clients as they are deployed, against the gateway and a real vLLM (the tiny model): each
recorded call's completion ids decode to exactly the text and tool-call arguments the client
received.

- The official SDKs' forms that tests/test_gateway_apis.py leaves open: chat completions and
  completions not streamed, Responses function calls and Anthropic tool use both streamed and
  not (each form until it has made a tool call: the model samples).
- A prompt of 31,000 tokens (the tiny model has 32,768 positions, the engine that context).
- A third-party agent framework, the OpenAI Agents SDK (`openai-agents`), run unchanged as a
  harness under the controller (examples/agents_sdk), configured by the environment only.

One store, one gateway and one controller for the module; the session's vLLM.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from conftest import REPO, TEST_SECRET, GatewayService, StoreService
from harnessrl import procs
from harnessrl.clients import ControllerClient, StoreClient
from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb
from test_gateway_apis import (ANTHROPIC_TOOLS, QUESTION, SYSTEM, TOOLS, Env, _anthropic,
                               _received)

pytestmark = pytest.mark.vllm

TRIES = 4  # a sampled model: tries per form to see it call a tool


@dataclass
class World:
    env: Env
    controller: ControllerClient


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, redis_url: str, vllm_engine,  # type: ignore[no-untyped-def]
          tiny_model_dir: Path) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("clients")
    store_svc = StoreService(tmp / "store", redis_url, f"t{uuid.uuid4().hex[:10]}:").start()
    gateway = GatewayService(tmp / "gw", store_svc.address, [
        {"name": "engine0", "base_url": vllm_engine.base_url, "model": vllm_engine.model_name}])
    ready = tmp / "controller.ready"
    controller = procs.ServiceProcess("controller", procs.python_module(
        "services.controller", "--bind", "127.0.0.1:0", "--store-address", store_svc.address,
        "--gateway-url", gateway.base_url, "--workdir-root", str(tmp / "rollouts"),
        "--ready-file", str(ready)), tmp, env={"HARNESSRL_SECRET": TEST_SECRET},
        ready_file=ready).start()
    ctl = ControllerClient.connect(f"127.0.0.1:{controller.wait_ready()['grpc_port']}")
    store = StoreClient.connect(store_svc.address, timeout=10)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    yield World(Env(store, gateway, vllm_engine.model_name, tok), ctl)
    ctl.close()
    store.close()
    controller.stop()
    gateway.stop()
    store_svc.stop()


def until_tool_call(form: str, attempt: Callable[[], bool]) -> None:
    """Runs `attempt` (which checks one call and says whether it was a tool call) until a tool
    call came, at most TRIES times."""
    for _ in range(TRIES):
        if attempt():
            return
    pytest.fail(f"{form}: no tool call in {TRIES} sampled tries")


def test_openai_chat_not_streamed_tool_call_then_text(world: World) -> None:
    env = world.env

    def attempt() -> bool:
        rid, key = env.key()
        client = env.openai(key)
        resp = client.chat.completions.create(model=env.model, messages=QUESTION, tools=TOOLS,  # type: ignore[arg-type]
                                              max_tokens=64, temperature=1.0)
        msg = resp.choices[0].message
        tcs = [(t.function.name, t.function.arguments) for t in msg.tool_calls or []]
        [call] = env.calls(rid)
        env.check(call, msg.content, tcs)
        assert call.api == "chat.completions" and call.finish_reason == resp.choices[0].finish_reason
        if not tcs:
            return False
        nxt = client.chat.completions.create(model=env.model, tools=TOOLS, max_tokens=32, messages=[  # type: ignore[arg-type]
            *QUESTION, msg.model_dump(exclude_none=True),
            *({"role": "tool", "tool_call_id": t.id, "content": "816"} for t in msg.tool_calls or [])])
        reply = nxt.choices[0].message
        env.check(env.calls(rid)[1], reply.content,
                  [(t.function.name, t.function.arguments) for t in reply.tool_calls or []])
        return True

    until_tool_call("chat, not streamed", attempt)


def test_openai_completions_not_streamed(world: World) -> None:
    env = world.env
    rid, key = env.key()
    resp = env.openai(key).completions.create(model=env.model, prompt="What is 3 + 4?",
                                              max_tokens=24, temperature=1.0)
    [call] = env.calls(rid)
    env.check(call, resp.choices[0].text, [])  # the end-of-text id is recorded, not returned
    assert len(call.completion_token_ids) == resp.usage.completion_tokens  # type: ignore[union-attr]
    assert env.tok.decode(call.prompt_token_ids) == "What is 3 + 4?"


RESPONSES_TOOLS = [{"type": "function", "name": "calculator",
                    "description": TOOLS[0]["function"]["description"],  # type: ignore[index]
                    "parameters": TOOLS[0]["function"]["parameters"]}]  # type: ignore[index]


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_openai_responses_function_calls(world: World, streamed: bool) -> None:
    env = world.env

    def attempt() -> bool:
        rid, key = env.key()
        kw: dict[str, Any] = dict(model=env.model, instructions=SYSTEM, tools=RESPONSES_TOOLS,
                                  input="What is 970 - 154?", max_output_tokens=64)
        if streamed:
            with env.openai(key).responses.stream(**kw) as stream:
                resp = stream.get_final_response()
        else:
            resp = env.openai(key).responses.create(**kw)
        calls = [(o.name, o.arguments) for o in resp.output if o.type == "function_call"]
        [call] = env.calls(rid)
        env.check(call, resp.output_text, calls)
        assert call.api == "responses" and not call.aborted
        return bool(calls)

    until_tool_call(f"responses, {'streamed' if streamed else 'not streamed'}", attempt)


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_anthropic_tool_use(world: World, streamed: bool) -> None:
    env = world.env

    def attempt() -> bool:
        rid, key = env.key()
        ac = _anthropic(env, key)
        kw: dict[str, Any] = dict(model=env.model, max_tokens=64, system=SYSTEM,
                                  tools=ANTHROPIC_TOOLS,
                                  messages=[{"role": "user", "content": "What is 970 - 154?"}])
        if streamed:
            with ac.messages.stream(**kw) as stream:
                msg = stream.get_final_message()
        else:
            msg = ac.messages.create(**kw)
        text, tools = _received(msg.content)
        [call] = env.calls(rid)
        env.check(call, text, tools)
        assert call.api == "messages" and not call.aborted
        return bool(tools)

    until_tool_call(f"messages, {'streamed' if streamed else 'not streamed'}", attempt)


def long_prompt(tok: PreTrainedTokenizerFast, tokens: int = 31_000) -> str:
    """The project's README (prose, tables, code), repeated and cut after `tokens` tokens: near
    the tiny model's 32,768 positions whatever the README says today."""
    text = (REPO / "README.md").read_text() * 40
    offsets = tok(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    assert len(offsets) > tokens, "the README repeated is too short for the long prompt"
    return text[:offsets[tokens - 1][1]]


def test_a_long_prompt_near_the_context_limit_is_served(world: World) -> None:
    env = world.env
    prompt = long_prompt(env.tok)
    assert len(prompt) > 30_000
    rid, key = env.key()
    resp = env.openai(key).chat.completions.create(
        model=env.model, messages=[{"role": "user", "content": prompt}], max_tokens=8,
        temperature=1.0)
    [call] = env.calls(rid)
    env.check(call, resp.choices[0].message.content, [])
    assert 31_000 <= len(call.prompt_token_ids) == resp.usage.prompt_tokens <= 32_768 - 8  # type: ignore[union-attr]
    assert prompt in env.tok.decode(call.prompt_token_ids)


def _tail(workdir: Path) -> str:
    path = workdir / "stderr.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


AGENTS_HARNESS = REPO / "examples" / "agents_sdk" / "harness.py"
CALC_GRADER = REPO / "examples" / "calc" / "grader.py"


def test_openai_agents_sdk_runs_unchanged_under_the_controller(world: World) -> None:
    """The Agents SDK's calls (Responses API, function tools, the whole conversation resent
    each turn) are recorded with token ids; what it received is what the ids decode to."""
    env = world.env
    tasks = [json.loads(line) for line in
             (REPO / "examples" / "calc" / "tasks.jsonl").read_text().splitlines()[:2]]
    spec = c.RunSpec(
        name="agents-sdk", model=env.model, group_size=2, concurrency=4, timeout_s=300,
        harness_command=[sys.executable, str(AGENTS_HARNESS)],
        grader_command=[sys.executable, str(CALC_GRADER)],
        env={"OPENAI_DEFAULT_MODEL": env.model, "OPENAI_AGENTS_DISABLE_TRACING": "1"},
        sampling=c.SamplingPolicy(temperature=1.0, max_tokens=64),
        tasks=[c.Task(data_json=json.dumps(t)) for t in tasks])
    # sandboxed: the harness imports the calc example, which its command does not name
    spec.sandbox.read_only_paths.append(str(REPO / "examples" / "calc"))
    run = world.controller.create_run(spec)
    events = list(world.controller.watch_run(run.run_id, timeout=600))
    assert events[-1].kind == cpb.RunEvent.KIND_RUN_DONE
    rollouts = world.controller.list_rollouts(run.run_id, include_calls=True).rollouts
    assert len(rollouts) == 4
    turns = tool_turns = 0
    for ro in rollouts:
        attempt = ro.attempts[-1]
        workdir = Path(attempt.workdir)
        assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED, (attempt.error, _tail(workdir))
        received = [json.loads(line) for line in
                    (workdir / "work" / "transcript.jsonl").read_text().splitlines()]
        assert len(received) == len(ro.calls) >= 1
        for call, got in zip(ro.calls, received):
            assert call.api == "responses" and not call.aborted
            env.check(call, got["text"], [(f["name"], f["arguments"])
                                          for f in got["function_calls"]])
            assert json.loads(call.sampling_override_json)["imposed"]["max_tokens"] == 64
            turns += 1
            tool_turns += bool(got["function_calls"])
            print(ro.rollout_id, got)
        if len(ro.calls) > 1:  # later turns resend the conversation: the prompt grows
            assert len(ro.calls[1].prompt_token_ids) > len(ro.calls[0].prompt_token_ids)
        assert ro.has_reward and ro.reward in (0.0, 1.0)  # graded by examples/calc/grader.py
    # the SDK ran its tool and sent the result back (the warmed-up model calls it most turns)
    assert tool_turns >= 1 and turns >= 4
