"""The gateway's APIs as real SDKs use them, against a real vLLM (the tiny model): what each
client received is exactly what the recorded completion token ids decode to.

One store, one gateway and the session's vLLM for the whole module (vLLM takes 60-95 s to
start on 2 cores).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from transformers import PreTrainedTokenizerFast

from conftest import GatewayService, StoreService, TEST_SECRET, running_rollout
from harnessrl.clients import StoreClient
from harnessrl.credentials import CredentialSigner
from harnessrl.v1 import common_pb2 as c

pytestmark = pytest.mark.vllm

SIGNER = CredentialSigner(TEST_SECRET.encode())
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
SYSTEM = "You are a careful assistant. Use the calculator tool, then give the answer."
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with integers and "
    "+ - *.", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}}}]
QUESTION = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is 970 - 154?"}]


@dataclass
class Env:
    store: StoreClient
    gateway: GatewayService
    model: str
    tok: PreTrainedTokenizerFast

    def key(self) -> tuple[str, str]:
        return running_rollout(self.store)

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.base_url, api_key=key, max_retries=0,
                             timeout=120)

    def calls(self, rid: str) -> list[c.Call]:
        return list(self.store.get_rollout(rid, include_calls=True).calls)

    def check(self, call: c.Call, content: str | None, tool_calls: list[tuple[str, str]]
              ) -> None:
        """The recorded ids decode to exactly the text (or tool calls) the client got."""
        assert len(call.logprobs) == len(call.completion_token_ids) > 0
        assert all(lp <= 0.0 for lp in call.logprobs) and len(call.prompt_token_ids) > 0
        full = self.tok.decode(call.completion_token_ids, skip_special_tokens=False)
        if tool_calls:
            parsed = [json.loads(m) for m in TOOL_CALL.findall(full)]
            assert [(p["name"], p["arguments"]) for p in parsed] == [
                (name, json.loads(args)) for name, args in tool_calls]
        else:
            text = self.tok.decode(call.completion_token_ids, skip_special_tokens=True)
            assert text == (content or ""), (text, content)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, redis_url: str, vllm_engine,  # type: ignore[no-untyped-def]
        tiny_model_dir: Path) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("apis")
    store_svc = StoreService(tmp / "store", redis_url, f"t{uuid.uuid4().hex[:10]}:").start()
    gateway = GatewayService(tmp / "gw", store_svc.address, [
        {"name": "engine0", "base_url": vllm_engine.base_url, "model": vllm_engine.model_name}])
    store = StoreClient.connect(store_svc.address, timeout=10)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    yield Env(store, gateway, vllm_engine.model_name, tok)
    store.close()
    gateway.stop()
    store_svc.stop()


def test_openai_streamed_chat_with_tools_is_recorded_token_for_token(env: Env) -> None:
    tool_runs = 0
    for _ in range(4):  # sampled: most turns call the tool, some answer in text
        rid, key = env.key()
        with env.openai(key).chat.completions.stream(
                model=env.model, messages=QUESTION, tools=TOOLS, max_tokens=64,
                temperature=1.0) as stream:
            final = stream.get_final_completion()
        msg = final.choices[0].message
        tcs = [(t.function.name, t.function.arguments) for t in msg.tool_calls or []]
        tool_runs += bool(tcs)
        [call] = env.calls(rid)
        env.check(call, msg.content, tcs)
        assert call.finish_reason == final.choices[0].finish_reason and not call.aborted
        assert json.loads(call.response_message_json)["content"] == (msg.content or None)
    assert tool_runs >= 1


def test_openai_streamed_completions_are_recorded_token_for_token(env: Env) -> None:
    rid, key = env.key()
    chunks = list(env.openai(key).completions.create(
        model=env.model, prompt="What is 3 + 4?", max_tokens=24, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    [call] = env.calls(rid)
    assert env.tok.decode(call.completion_token_ids, skip_special_tokens=True) == text
    assert len(call.logprobs) == len(call.completion_token_ids) == chunks[-1].usage.completion_tokens
    assert env.tok.decode(call.prompt_token_ids) == "What is 3 + 4?"


ANTHROPIC_TOOLS = [{"name": "calculator", "description": TOOLS[0]["function"]["description"],  # type: ignore[index]
                    "input_schema": TOOLS[0]["function"]["parameters"]}]  # type: ignore[index]


def _anthropic(env: Env, key: str):  # type: ignore[no-untyped-def]
    import anthropic
    return anthropic.Anthropic(base_url=env.gateway.base_url[:-3], api_key=key, max_retries=0,
                               timeout=120)


def _received(content) -> tuple[str, list[tuple[str, str]]]:  # type: ignore[no-untyped-def]
    text = "".join(b.text for b in content if b.type == "text")
    tools = [(b.name, json.dumps(b.input)) for b in content if b.type == "tool_use"]
    return text, tools


def test_anthropic_messages_streamed_and_not_with_tool_use(env: Env) -> None:
    tool_runs = 0
    for streamed in (False, True, False, True):
        rid, key = env.key()
        ac = _anthropic(env, key)
        kw = dict(model=env.model, max_tokens=64, system=SYSTEM, tools=ANTHROPIC_TOOLS,
                  messages=[{"role": "user", "content": "What is 970 - 154?"}])
        if streamed:
            with ac.messages.stream(**kw) as stream:  # type: ignore[arg-type]
                msg = stream.get_final_message()
        else:
            msg = ac.messages.create(**kw)  # type: ignore[arg-type]
        text, tools = _received(msg.content)
        tool_runs += bool(tools)
        [call] = env.calls(rid)
        env.check(call, text, tools)
        assert call.api == "messages" and not call.aborted
        assert msg.usage.output_tokens == len(call.completion_token_ids)
        assert msg.usage.input_tokens == len(call.prompt_token_ids)
        assert msg.stop_reason == ("tool_use" if tools else "end_turn") or \
            msg.stop_reason == "max_tokens"
        if tools:  # the tool result goes back as Anthropic sends it: the next turn works
            block = next(b for b in msg.content if b.type == "tool_use")
            nxt = ac.messages.create(model=env.model, max_tokens=32, system=SYSTEM,
                                     tools=ANTHROPIC_TOOLS, messages=[  # type: ignore[arg-type]
                                         kw["messages"][0],  # type: ignore[index]
                                         {"role": "assistant", "content": msg.content},
                                         {"role": "user", "content": [{
                                             "type": "tool_result", "tool_use_id": block.id,
                                             "content": "816"}]}])
            calls = env.calls(rid)
            env.check(calls[1], *_received(nxt.content))
            assert "816" in env.tok.decode(calls[1].prompt_token_ids)
    assert tool_runs >= 1
    # count_tokens: the prompt length the engine's template gives, as recorded
    count = _anthropic(env, key).messages.count_tokens(
        model=env.model, system=SYSTEM, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "What is 970 - 154?"}])
    assert count.input_tokens == len(env.calls(rid)[0].prompt_token_ids)


def test_anthropic_stop_sequences(env: Env) -> None:
    rid, key = env.key()
    msg = _anthropic(env, key).messages.create(
        model=env.model, max_tokens=64, stop_sequences=["<tool_call>", "\n"], system=SYSTEM,
        tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": "What is 970 - 154?"}])
    [call] = env.calls(rid)
    if msg.stop_reason == "stop_sequence":  # the ids hold what was sampled, stop string included
        assert msg.stop_sequence in ("<tool_call>", "\n")
        full = env.tok.decode(call.completion_token_ids, skip_special_tokens=False)
        assert full.startswith(_received(msg.content)[0]) and msg.stop_sequence in full
    else:
        assert msg.stop_reason in ("end_turn", "max_tokens")


def test_openai_responses_streamed_and_chained(env: Env) -> None:
    rid, key = env.key()
    client = env.openai(key)
    tools = [{"type": "function", "name": "calculator",
              "description": TOOLS[0]["function"]["description"],  # type: ignore[index]
              "parameters": TOOLS[0]["function"]["parameters"]}]  # type: ignore[index]
    with client.responses.stream(model=env.model, instructions=SYSTEM, tools=tools,  # type: ignore[arg-type]
                                 input="What is 970 - 154?", max_output_tokens=64) as stream:
        first = stream.get_final_response()
    calls_ = [o for o in first.output if o.type == "function_call"]
    env.check(env.calls(rid)[0], first.output_text,
              [(o.name, o.arguments) for o in calls_])
    follow = [{"type": "function_call_output", "call_id": o.call_id, "output": "816"}
              for o in calls_] or "Thanks. And 3 + 4?"
    second = client.responses.create(model=env.model, instructions=SYSTEM, tools=tools,  # type: ignore[arg-type]
                                     previous_response_id=first.id, input=follow,
                                     max_output_tokens=32)
    c0, c1 = env.calls(rid)
    env.check(c1, second.output_text, [(o.name, o.arguments) for o in second.output
                                       if o.type == "function_call"])
    # The chained prompt is the first prompt, the first answer, then the new input.
    assert list(c1.prompt_token_ids[:len(c0.prompt_token_ids)]) == list(c0.prompt_token_ids)
    assert second.usage is not None and second.usage.input_tokens == len(c1.prompt_token_ids)


def test_run_sampling_policy_reaches_the_engine(env: Env) -> None:
    run_id = f"run-{uuid.uuid4().hex[:6]}"
    env.store.put_run(c.Run(run_id=run_id, status=c.RUN_STATUS_RUNNING, spec=c.RunSpec(
        name="r", model=env.model, sampling=c.SamplingPolicy(temperature=1.0, max_tokens=3))))
    rid = f"{run_id}/t/0"
    env.store.create_rollouts([c.Rollout(rollout_id=rid, run_id=run_id, task_id="t",
                                         group_id=f"{run_id}/t", group_size=1, max_attempts=1,
                                         stream="-")])
    env.store.start_attempt(rid, 1)
    resp = env.openai(SIGNER.mint(rid, 1, 600)).chat.completions.create(
        model="my-harness-model", messages=QUESTION, max_tokens=64, temperature=0.0)
    [call] = env.calls(rid)
    assert len(call.completion_token_ids) <= 3 and resp.usage.completion_tokens <= 3  # type: ignore[union-attr]
    assert call.model == "my-harness-model"


def test_turns_keep_the_tokens_sampled_where_retokenizing_would_merge_them(env: Env) -> None:
    """Token in, token out with the real engine. The model is made to sample digits one token
    at a time (`allowed_token_ids`: "1" and "2"); the tiny tokenizer has every number below 1000
    as one token, so re-tokenizing the conversation would turn each turn's three digit tokens
    into one. The recorded turns keep the tokens sampled, and the trainer's sample of the
    conversation is the last call's prompt + completion. With tools (the engine's template
    renders them, its tool parser reads the answer) and a tool turn in the history."""
    from services.trainer.samples import rollout_samples

    rid, key = env.key()
    client = env.openai(key)
    digits = [env.tok.convert_tokens_to_ids(d) for d in ("1", "2")]
    history: list[dict[str, str]] = [{"role": "user", "content": "Count."}]
    for turn in range(3):
        kw = dict(model=env.model, messages=history, max_tokens=3, tools=TOOLS,
                  extra_body={"allowed_token_ids": digits})
        if turn == 1:
            chunks = client.chat.completions.create(stream=True, **kw)  # type: ignore[call-overload]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content  # type: ignore[call-overload]
        assert text is not None and len(text) == 3 and set(text) <= {"1", "2"}
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
        if turn == 0:  # a tool's answer the harness adds (as if the model had asked)
            history.insert(-1, {"role": "tool", "tool_call_id": "call_0", "content": "816"})
    calls = env.calls(rid)
    assert [call.segment_start for call in calls] == [
        c.SEGMENT_START_FIRST, c.SEGMENT_START_CONTINUED, c.SEGMENT_START_CONTINUED]
    im_end = env.tok.convert_tokens_to_ids("<|im_end|>")
    for prev, call in zip(calls, calls[1:]):
        earlier = list(prev.prompt_token_ids) + list(prev.completion_token_ids)
        assert len(prev.completion_token_ids) == 3  # three digit tokens, cut at max_tokens
        assert call.reused_prompt_tokens == len(earlier) and call.extends_seq == prev.seq
        # the earlier tokens exactly, the turn closed as the template closes it (<|im_end|>
        # and the newline, the model having been cut short), then the new user turn
        tool = "<|im_start|>tool\n<tool_response>\n816\n</tool_response><|im_end|>\n" \
            if call.seq == 1 else ""
        new = env.tok.encode("<|im_end|>\n" + tool + "<|im_start|>user\nMore.<|im_end|>\n"
                             "<|im_start|>assistant\n")
        assert new[0] == im_end
        assert list(call.prompt_token_ids) == earlier + new
        # what rendering + tokenizing the conversation again gives: one token per turn's digits
        request = json.loads(call.request_json)
        again = env.tok(env.tok.apply_chat_template(
            request["messages"], tools=request["tools"], add_generation_prompt=True,
            tokenize=False), add_special_tokens=False)["input_ids"]
        assert len(again) == len(call.prompt_token_ids) - 2 * (call.seq)
        assert again != list(call.prompt_token_ids)
        assert env.tok.decode(again) == env.tok.decode(call.prompt_token_ids)
    rollout = env.store.get_rollout(rid, include_calls=True)
    [sample], _ = rollout_samples(rollout, advantage=1.0)
    last = calls[-1]
    assert sample.input_ids == list(last.prompt_token_ids) + list(last.completion_token_ids)
    assert sample.num_loss_tokens == 9 and sample.call_seqs == [0, 1, 2]
    for call in calls:
        at = len(call.prompt_token_ids)
        assert sample.loss_mask[at:at + 3] == [1, 1, 1]
        assert sample.behaviour_logprobs[at:at + 3] == list(call.logprobs)
