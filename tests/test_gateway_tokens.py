"""Token in, token out through the gateway (stub engine, which tokenizes with a toy byte-level
tokenizer): the turns of a conversation reuse the tokens recorded for the earlier turns, edited
history starts a new segment, and the trainer's samples are the segments' token sequences.

The stub generates "Hello, world!" as 4 tokens; its tokenizer turns the same text into 13, so
re-tokenizing the conversation would change the earlier turn's tokens."""

from __future__ import annotations

import asyncio
import itertools
import json
from array import array
from collections.abc import Iterator

import httpx
import pytest

from harnessrl.testing.stub_engine import PROMPT_IDS, render_chat, toy_tokens
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.gateway.tokens import (Plan, Prefixes, TokenReuse, canonical, closing_tail,
                                     digest)
from services.trainer.samples import rollout_samples
from test_gateway import SIGNER, World, shared_world

HELLO = [9906, 11, 1917, 0]  # the stub's answer, "Hello, world!"
CLOSE = toy_tokens("<|im_end|>\n")  # what the template puts after an assistant turn's content


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[World]:
    with shared_world(tmp_path_factory.mktemp("world"), redis_url) as w:
        yield w


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def new_tokens(messages: list[dict[str, object]], tools: list[object] | None = None
               ) -> list[int]:
    """The stub's tokens for `messages` rendered after an assistant turn, with the generation
    prompt (what the gateway tokenizes of a new turn)."""
    return toy_tokens(render_chat(messages, tools, True))


def test_turns_reuse_recorded_tokens_and_merge_into_one_sample(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    history: list[dict[str, object]] = [{"role": "user", "content": "hi"}]
    for turn in range(3):
        resp = client.chat.completions.create(model="tiny", messages=history, stream=turn == 1)
        if turn == 1:
            text = "".join(ch.choices[0].delta.content or "" for ch in resp if ch.choices)
        else:
            text = resp.choices[0].message.content
        assert text == "Hello, world!"
        history += [{"role": "assistant", "content": text},
                    {"role": "user", "content": f"and again {turn}"}]
    calls = world.calls(rid)
    assert [call.segment_start for call in calls] == [
        c.SEGMENT_START_FIRST, c.SEGMENT_START_CONTINUED, c.SEGMENT_START_CONTINUED]
    assert [call.segment for call in calls] == [0, 0, 0]
    assert calls[0].reused_prompt_tokens == 0 and not calls[0].HasField("extends_seq")
    assert list(calls[0].prompt_token_ids) == PROMPT_IDS
    for prev, call in itertools.pairwise(calls):
        earlier = list(prev.prompt_token_ids) + list(prev.completion_token_ids)
        assert call.extends_seq == prev.seq and call.reused_prompt_tokens == len(earlier)
        user = json.loads(call.request_json)["messages"][-1]
        # the earlier tokens exactly, the turn closed as the template closes it, the new message
        assert list(call.prompt_token_ids) == earlier + CLOSE + new_tokens([user])
        assert list(call.completion_token_ids) == HELLO
    # re-tokenizing the conversation would have changed the earlier turns' tokens
    retokenized = httpx.post(world.engines[0].base_url + "/tokenize", json={
        "messages": json.loads(calls[2].request_json)["messages"]}).json()["tokens"]
    recorded = list(calls[2].prompt_token_ids)
    assert contains(retokenized, toy_tokens("Hello, world!<|im_end|>\n"))
    assert contains(recorded, HELLO + CLOSE)
    assert not contains(recorded, toy_tokens("Hello, world!"))

    # the trainer: one sample, = the last call's prompt + completion; loss on completions only
    world.finish(rid)
    ro = world.store.get_rollout(rid, include_calls=True)
    [sample], truncated = rollout_samples(ro, advantage=1.0)
    last = calls[-1]
    assert truncated == 0 and sample.call_seqs == [0, 1, 2]
    assert sample.input_ids == list(last.prompt_token_ids) + list(last.completion_token_ids)
    mask = [0] * len(sample.input_ids)
    logprobs = [0.0] * len(sample.input_ids)
    for call in calls:
        start = len(call.prompt_token_ids)
        for i, lp in enumerate(call.logprobs):
            mask[start + i], logprobs[start + i] = 1, lp
    assert sample.loss_mask == mask and sample.behaviour_logprobs == logprobs
    assert sample.num_loss_tokens == 3 * len(HELLO)


def test_edited_history_starts_a_new_segment(world: World) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    first = [{"role": "user", "content": "hi"}]
    text = client.chat.completions.create(model="tiny", messages=first).choices[0].message.content
    turn = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    client.chat.completions.create(model="tiny", messages=turn)
    edited = first + [{"role": "assistant", "content": "Hello!"},  # the harness rewrote it
                      {"role": "user", "content": "more"}]
    client.chat.completions.create(model="tiny", messages=edited)
    truncated = [{"role": "user", "content": "more"}]  # the harness dropped the history
    client.chat.completions.create(model="tiny", messages=truncated)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    client.chat.completions.create(model="tiny", messages=truncated + [
        {"role": "assistant", "content": text}, {"role": "user", "content": "x"}], tools=tools)
    calls = world.calls(rid)
    assert [(call.segment_start, call.segment) for call in calls] == [
        (c.SEGMENT_START_FIRST, 0), (c.SEGMENT_START_CONTINUED, 0),
        (c.SEGMENT_START_EDITED, 2), (c.SEGMENT_START_EDITED, 3),
        (c.SEGMENT_START_SETTINGS_CHANGED, 4)]
    for call in calls[2:]:  # the engine rendered those prompts itself
        assert call.reused_prompt_tokens == 0 and list(call.prompt_token_ids) == PROMPT_IDS
    world.finish(rid)
    samples, _ = rollout_samples(world.store.get_rollout(rid, include_calls=True), 1.0)
    assert [s.call_seqs for s in samples] == [[0, 1], [2], [3], [4]]


def test_tool_turns_of_every_api_continue_their_segment(world: World) -> None:
    """Chat (tool call, tool result), Anthropic Messages (tool_use, tool_result) and Responses
    (previous_response_id, function_call_output) each continue the segment."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    client = world.client(key)
    history: list[dict[str, object]] = [{"role": "user", "content": "1 + 2?"}]
    msg = client.chat.completions.create(model="tiny", messages=history, tools=tools
                                         ).choices[0].message
    assert msg.tool_calls and msg.tool_calls[0].function.name == "add"
    history += [msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "3"}]
    client.chat.completions.create(model="tiny", messages=history, tools=tools)

    gw = world.gateway.base_url[:-3]
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    a_tools = [{"name": "add", "input_schema": {"type": "object"}}]
    a_history: list[dict[str, object]] = [{"role": "user", "content": "1 + 2?"}]
    answer = httpx.post(gw + "/v1/messages", headers=headers, json={
        "model": "tiny", "max_tokens": 16, "tools": a_tools, "messages": a_history}).json()
    [use] = [b for b in answer["content"] if b["type"] == "tool_use"]
    a_history += [{"role": "assistant", "content": answer["content"]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                "content": "3"}]}]
    httpx.post(gw + "/v1/messages", headers=headers, json={
        "model": "tiny", "max_tokens": 16, "tools": a_tools, "messages": a_history}
               ).raise_for_status()

    r_tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    first = client.responses.create(model="tiny", input="1 + 2?", tools=r_tools)
    [fc] = [item for item in first.output if item.type == "function_call"]
    client.responses.create(model="tiny", previous_response_id=first.id, tools=r_tools,
                            input=[{"type": "function_call_output", "call_id": fc.call_id,
                                    "output": "3"}])
    calls = world.calls(rid)
    # chat: 0 -> 1; messages: 2 -> 3; responses: 4 -> 5 (each API's tools translate to the
    # same chat tools; a new conversation does not extend the earlier ones: EDITED)
    assert [(call.segment_start, call.segment) for call in calls] == [
        (c.SEGMENT_START_FIRST, 0), (c.SEGMENT_START_CONTINUED, 0),
        (c.SEGMENT_START_EDITED, 2), (c.SEGMENT_START_CONTINUED, 2),
        (c.SEGMENT_START_EDITED, 4), (c.SEGMENT_START_CONTINUED, 4)]
    for seq in (1, 3, 5):
        prev, call = calls[seq - 1], calls[seq]
        earlier = list(prev.prompt_token_ids) + list(prev.completion_token_ids)
        assert list(call.prompt_token_ids[:len(earlier)]) == earlier
        tools_json = json.loads(call.request_json).get("tools")
        assert tools_json is not None
        tool_turn = toy_tokens("<|im_end|>\n<|im_start|>tool\n<tool_response>\n3\n"
                               "</tool_response><|im_end|>\n<|im_start|>assistant\n")
        assert list(call.prompt_token_ids[len(earlier):]) == tool_turn


def test_prefix_digests_are_the_digests_of_the_prefixes() -> None:
    """The digests the store and other replicas hold were made by `digest`: the incremental
    ones (a plan's comparisons, a call's state) must be the same bytes, asked in any order."""
    messages: list[dict[str, object]] = [{"role": "system", "content": "S \u2603"}]
    for i in range(12):
        messages += [{"role": "user", "content": f"q{i}", "name": "n" if i % 3 else ""},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": f"c{i}", "function": {"name": "f", "arguments":
                                                      '{"b": [1, 2.5, null], "a": "\\u00e9"}'}}]},
                     {"role": "tool", "content": [{"type": "text", "text": "x"},
                                                  {"type": "text", "text": "\"y\""}]}]
    canon = [canonical(m) for m in messages]
    answer = canonical({"role": "assistant", "content": "done"})
    rng = __import__("random").Random(3)
    for _ in range(20):
        prefixes = Prefixes(canon)
        for n in rng.sample(range(len(canon) + 1), 6) + [0, len(canon)]:
            assert prefixes.digest(n) == digest(canon[:n]), n
        assert prefixes.with_message(answer) == digest(canon + [answer])
    assert Prefixes([]).with_message(answer) == digest([answer])
    assert Prefixes([]).digest(0) == digest([])


def test_closing_tail_overlaps_a_completion_that_stopped_on_the_end_token() -> None:
    closing = [2, 1010]  # <|im_end|> \n
    assert closing_tail([5, 6, 2], closing) == [1010]  # stopped on <|im_end|>
    assert closing_tail([5, 6, 7], closing) == [2, 1010]  # cut at max_tokens
    assert closing_tail([], closing) == [2, 1010]
    assert closing_tail([2, 1010], closing) == []


class _Session:
    def __init__(self) -> None:
        self.tokens = None
        self.next_seq = 0
        self.let_go: list[int] = []
        self.evicted = False
        self.seen_next, self.lost = 0, False
        self.stored: set[int] = set()  # the seqs of the states the store keeps

    def take_seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1


async def _toy_tokenize(request: dict[str, object]) -> list[int]:
    return toy_tokens(render_chat(request["messages"], request.get("tools"),  # type: ignore[arg-type]
                                  bool(request["add_generation_prompt"])))


def _turn(reuse: "TokenReuse", session: _Session, messages: list[dict[str, object]],
          **extra: object) -> c.Call:
    """One call through `TokenReuse` as the gateway makes it: plan, engine (prompt = ids sent,
    else the fixed prompt), record."""

    forward: dict[str, object] = {"model": "tiny", "messages": messages, **extra}
    plan = asyncio.run(reuse.plan(session, forward, "tiny", _toy_tokenize))
    sent = (forward.get("kv_transfer_params") or {}).get("prompt_token_ids")  # type: ignore[union-attr]
    call = c.Call(seq=session.next_seq, prompt_token_ids=sent or PROMPT_IDS,
                  completion_token_ids=HELLO)
    session.next_seq += 1
    reuse.check(plan, list(call.prompt_token_ids))
    reuse.fields(plan, call)
    _recorded(reuse, session, plan, call, {"role": "assistant", "content": "Hello, world!"},
              list(call.prompt_token_ids), HELLO)
    return call


def _planned(reuse: "TokenReuse", session: _Session, messages: list[dict[str, object]],
             seq: int) -> tuple[Plan, c.Call]:
    """A call of `messages` with seq `seq` as the gateway plans it, answered by the stub (the
    fixed prompt, HELLO), its segment fields set; not recorded yet."""
    forward: dict[str, object] = {"model": "tiny", "messages": messages}
    plan = asyncio.run(reuse.plan(session, forward, "tiny", _toy_tokenize))
    call = c.Call(seq=seq, prompt_token_ids=PROMPT_IDS, completion_token_ids=HELLO)
    reuse.fields(plan, call)
    return plan, call


def _recorded(reuse: "TokenReuse", session: _Session, plan: object, call: c.Call,
              assistant: dict[str, object], prompt: list[int], completion: list[int]) -> None:
    """What the gateway does once the store took the call with its state. The store (here
    `session.stored`) deletes the states the state names and keeps the new one: it then holds
    what the session holds, and the states the session let go since its last call. (A
    session whose states this gateway evicted (`max_rollouts`) reads them back from the store
    on its next call in the gateway; this double does not, so the check waits for that.)"""
    state = reuse.state(session, plan, call, assistant)  # type: ignore[arg-type]
    if state is not None:
        evicted = session.tokens is None and bool(session.stored)
        session.stored = session.stored - set(state.drop_seqs) | {call.seq}
        reuse.recorded(session, plan, call, state, prompt, completion)  # type: ignore[arg-type]
        held = {s.seq for s in session.tokens or ()}
        assert evicted or session.stored == held | set(session.let_go), (
            session.stored, held, session.let_go)


def test_segment_starts_side_conversations_and_eviction() -> None:
    reuse = TokenReuse(max_rollouts=1, per_rollout=2)
    a, b = _Session(), _Session()
    main = [{"role": "user", "content": "main"}]
    side = [{"role": "user", "content": "summarise"}]
    said = {"role": "assistant", "content": "Hello, world!"}
    assert _turn(reuse, a, main).segment_start == c.SEGMENT_START_FIRST
    assert _turn(reuse, a, side).segment_start == c.SEGMENT_START_EDITED  # a side conversation
    # the main conversation goes on from its own last turn
    call = _turn(reuse, a, main + [said, {"role": "user", "content": "go on"}])
    assert (call.segment_start, call.segment, call.extends_seq) == (
        c.SEGMENT_START_CONTINUED, 0, 0)
    # a third conversation pushes the oldest state out (per_rollout=2), and the store is told
    # to drop it (`_recorded` checks that every state names what the session lets go)
    assert _turn(reuse, a, [{"role": "user", "content": "third"}]).segment_start == \
        c.SEGMENT_START_EDITED
    assert [s.seq for s in a.tokens] == [3, 2]  # type: ignore[attr-defined]
    # non-text content and continue_final_message: the engine renders
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert _turn(reuse, a, image).segment_start == c.SEGMENT_START_UNTRACKED
    assert _turn(reuse, a, main + [said], continue_final_message=True,
                 add_generation_prompt=False).segment_start == c.SEGMENT_START_UNTRACKED
    # arguments compare as JSON values; tool-call ids are ignored
    tc = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    tools = [{"type": "function", "function": {"name": "f"}}]
    session = _Session()
    forward_tools: dict[str, object] = {"tools": tools}
    plan = asyncio.run(reuse.plan(session, {"model": "tiny", "messages": main, **forward_tools},
                                  "tiny", _toy_tokenize))
    first = c.Call(seq=0, prompt_token_ids=PROMPT_IDS, completion_token_ids=[7])
    reuse.fields(plan, first)
    _recorded(reuse, session, plan, first, tc, PROMPT_IDS, [7])
    session.next_seq = 1
    resent = dict(tc, tool_calls=[{"id": "other", "type": "function",
                                   "function": {"name": "f", "arguments": '{"a":1}'}}])
    turn = main + [resent, {"role": "tool", "tool_call_id": "other", "content": "1"}]
    assert _turn(reuse, session, turn, tools=tools).segment_start == c.SEGMENT_START_CONTINUED
    assert _turn(reuse, session, turn + [said, {"role": "user", "content": "u"}]
                 ).segment_start == c.SEGMENT_START_SETTINGS_CHANGED
    # one rollout's state at most (max_rollouts=1): `a`'s was dropped for `session`'s
    assert a.tokens is None
    assert _turn(reuse, a, main + [said, {"role": "user", "content": "go on"}]
                 ).segment_start == c.SEGMENT_START_NO_STATE
    assert _turn(reuse, b, main).segment_start == c.SEGMENT_START_FIRST


def test_calls_in_flight_together_leave_the_store_what_the_session_keeps() -> None:
    """Three calls of one attempt sent at once (each planned and its state made before any is
    recorded) push states out of `per_rollout`; the store, told what to drop one call late,
    keeps no more than the session holds plus what it let go since its last call."""
    reuse = TokenReuse(per_rollout=2, drop_batch=1)
    session = _Session()
    for text in ("a", "b"):
        _turn(reuse, session, [{"role": "user", "content": text}])
    said = {"role": "assistant", "content": "Hello, world!"}
    flight = []
    for text in ("c", "d", "e"):
        plan, call = _planned(reuse, session, [{"role": "user", "content": text}],
                              session.take_seq())
        flight.append((plan, call, reuse.state(session, plan, call, said)))
    for plan, call, state in flight:
        assert state is not None
        session.stored = session.stored - set(state.drop_seqs) | {call.seq}
        reuse.recorded(session, plan, call, state, PROMPT_IDS, HELLO)
    held = {s.seq for s in session.tokens or ()}
    assert held == {4, 3} and session.stored == held | set(session.let_go) == {4, 3, 2, 1, 0}
    # the next call drops them (and lets go of 3, which the call after it drops)
    _turn(reuse, session, [{"role": "user", "content": "f"}])
    assert session.stored == {5, 4, 3} and session.let_go == [3]
    # a call that extends seq 5 takes 3 over; not recorded, it gives 3 back
    plan, call = _planned(reuse, session, [{"role": "user", "content": "f"}, said,
                                           {"role": "user", "content": "g"}], 6)
    assert call.segment_start == c.SEGMENT_START_CONTINUED and call.extends_seq == 5
    state = reuse.state(session, plan, call, said)
    assert state is not None and list(state.drop_seqs) == [3] and session.let_go == []
    reuse.unsent(session, state)
    assert session.let_go == [3]
    # recorded, it drops 3 and lets go of the state it extended (5), which the next call drops
    _recorded(reuse, session, plan, call, said, PROMPT_IDS, HELLO)
    assert session.stored == {6, 5, 4} and session.let_go == [5]
    assert [s.seq for s in session.tokens] == [6, 4]  # type: ignore[attr-defined]


def test_states_let_go_are_named_a_batch_at_a_time() -> None:
    """With `drop_batch` 3 the store is told to drop states once three have gathered (one
    HDEL per three calls): it holds at most per_rollout + drop_batch of them, and
    `_recorded` checks after every call that they are what the session holds and let go."""
    reuse = TokenReuse(per_rollout=2, drop_batch=3)
    session = _Session()
    said = {"role": "assistant", "content": "Hello, world!"}
    sizes, named = [], []
    conversation: list[dict[str, object]] = [{"role": "user", "content": "main"}]
    for turn in range(12):
        if turn % 3 == 2:  # a side conversation between turns of the main one
            messages: list[dict[str, object]] = [{"role": "user", "content": f"side {turn}"}]
        else:
            messages = conversation
            conversation = conversation + [said, {"role": "user", "content": f"go on {turn}"}]
        before = list(session.let_go)
        _turn(reuse, session, messages)
        named.append(len(before) if len(before) >= 3 else 0)
        sizes.append(len(session.stored))
    assert max(sizes) == 2 + 3 and all(n in (0, 3, 4) for n in named) and sum(named) > 0
    assert len(session.tokens) == 2  # type: ignore[arg-type]


def test_the_extended_state_is_replaced_when_a_refresh_reloaded_it_meanwhile() -> None:
    """A refresh between a call's plan and its record (a conflict, another replica's calls)
    reloads the states as new objects: the state the call extended is still the one it
    replaces, found by its seq, and let go to the store, not kept in a slot beside it."""
    reuse = TokenReuse(per_rollout=3, drop_batch=1)
    session = _Session()
    said = {"role": "assistant", "content": "Hello, world!"}
    first = [{"role": "user", "content": "a"}]
    _turn(reuse, session, first)
    _turn(reuse, session, [{"role": "user", "content": "b"}])
    plan, call = _planned(reuse, session, first + [said, {"role": "user", "content": "c"}], 2)
    assert call.extends_seq == 0
    held = {s.seq: s for s in session.tokens}  # type: ignore[attr-defined]
    reuse.load(session, [spb.SegmentRecord(segment=s.segment, seq=s.seq, ids=s.ids.tobytes(),
                                           n_messages=s.n_messages, digest=s.digest,
                                           settings=s.settings)
                         for s in (held[0], held[1])])  # read before the call is stored
    _recorded(reuse, session, plan, call, said, list(call.prompt_token_ids), HELLO)
    assert [s.seq for s in session.tokens] == [2, 1]  # type: ignore[attr-defined]
    assert session.let_go == [0] and session.stored == {2, 1, 0}
    # read after the call is stored and before it is marked recorded: the store gives the
    # call's own state and leaves out the one it extended; the session holds each state once
    # and lets go of the extended one all the same
    plan, call = _planned(reuse, session, first + [said, {"role": "user", "content": "c"},
                                                   said, {"role": "user", "content": "d"}], 3)
    assert call.extends_seq == 2
    session.let_go = []  # named with an earlier call
    session.stored.discard(0)
    mine = spb.SegmentRecord(segment=call.segment, seq=3, ids=b"", n_messages=6, digest=b"x",
                             settings=b"s")
    reuse.load(session, [mine, spb.SegmentRecord(segment=1, seq=1, ids=b"", n_messages=2,
                                                 digest=b"y", settings=b"s")])
    _recorded(reuse, session, plan, call, said, list(call.prompt_token_ids), HELLO)
    assert [s.seq for s in session.tokens] == [3, 1]  # type: ignore[attr-defined]
    assert session.let_go == [2] and session.stored == {3, 2, 1}


def test_a_session_evicted_while_its_call_ran_lets_go_of_the_state_it_extended() -> None:
    """Another attempt's call pushes this session's states out of the gateway's memory
    (`max_rollouts`) while this session's call runs: the state that call extended is let go
    all the same (the store would keep it otherwise), and the session holds nothing until its
    next call reads the store."""
    reuse = TokenReuse(max_rollouts=1, per_rollout=2, drop_batch=1)
    a, b = _Session(), _Session()
    said = {"role": "assistant", "content": "Hello, world!"}
    main = [{"role": "user", "content": "main"}]
    _turn(reuse, a, main)
    plan, call = _planned(reuse, a, main + [said, {"role": "user", "content": "go on"}], 1)
    assert call.extends_seq == 0
    _turn(reuse, b, main)  # evicts a's states
    assert a.tokens is None
    state = reuse.state(a, plan, call, said)
    assert state is not None
    reuse.recorded(a, plan, call, state, PROMPT_IDS, HELLO)
    assert a.tokens is None and a.let_go == [0]
    # a new session's two first calls in flight, evicted between their records: the second
    # does not hold its state alone (the first's would be kept by the store, never named)
    fresh = _Session()
    flight = []
    for text in ("x", "y"):
        plan, call = _planned(reuse, fresh, [{"role": "user", "content": text}],
                              fresh.take_seq())
        flight.append((plan, call, reuse.state(fresh, plan, call, said)))
    reuse.recorded(fresh, *flight[0], PROMPT_IDS, HELLO)  # type: ignore[arg-type]
    _turn(reuse, _Session(), main)  # another attempt's first call evicts `fresh`
    reuse.recorded(fresh, *flight[1], PROMPT_IDS, HELLO)  # type: ignore[arg-type]
    assert fresh.tokens is None and fresh.evicted  # its next call reads both from the store


def test_a_call_not_recorded_lets_go_of_what_it_named_and_of_its_own_state() -> None:
    """A call whose record failed, or whose request went away while it was recorded, gives
    back the states it named and lets go of its own: the store may hold it (a batch in
    flight when the request went), and no later call would name it otherwise."""
    from types import SimpleNamespace

    from services.gateway.recorder import RecordFailed
    from services.gateway.recording import Recording

    class Failing:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        async def record(self, call: c.Call, state: object) -> None:
            raise self.error

    said = {"role": "assistant", "content": "Hello, world!"}
    for error in (RecordFailed("store error"), asyncio.CancelledError()):
        reuse = TokenReuse(per_rollout=1, drop_batch=1)
        session = _Session()
        session.seen_next, session.lost = 0, False  # type: ignore[attr-defined]
        for text in ("a", "b"):
            _turn(reuse, session, [{"role": "user", "content": text}])
        assert session.let_go == [0]
        plan, call = _planned(reuse, session, [{"role": "user", "content": "c"}], 2)
        gen = SimpleNamespace(message=lambda: said, prompt_ids=PROMPT_IDS, ids=HELLO)
        ex = SimpleNamespace(generated=gen, plan=plan, chain=None, session=session)
        recording = Recording(Failing(error), None, reuse)  # type: ignore[arg-type]
        with pytest.raises(type(error)):
            asyncio.run(recording.record(ex, call))  # type: ignore[arg-type]
        assert session.let_go == [0, 2]
        assert [s.seq for s in session.tokens] == [1]  # type: ignore[attr-defined]


def test_a_call_that_keeps_meeting_conflicts_lets_go_of_no_seq_another_replica_holds() -> None:
    """A call whose seq another replica's call holds (CONFLICT) tries the next free seq; when
    it gives up, or re-reading the session fails, it gives back what it named but lets go of
    none of those seqs: the store holds another replica's states there."""
    from types import SimpleNamespace

    from harnessrl.errors import Unavailable
    from services.gateway.recorder import SeqConflict
    from services.gateway.recording import MAX_CONFLICTS, Recording

    class Conflicts:
        async def record(self, call: c.Call, state: object) -> None:
            raise SeqConflict(f"seq {call.seq} holds another call")

    class Sessions:
        def __init__(self, fail: bool) -> None:
            self.fail, self.refreshes = fail, 0

        async def refresh(self, session: object, force: bool = False) -> None:
            self.refreshes += 1
            if self.fail:
                raise Unavailable("store unavailable")

    said = {"role": "assistant", "content": "Hello, world!"}
    for fail, error in ((False, SeqConflict), (True, Unavailable)):
        reuse = TokenReuse(per_rollout=1, drop_batch=1)
        session = _Session()
        for text in ("a", "b"):
            _turn(reuse, session, [{"role": "user", "content": text}])
        assert session.let_go == [0]
        plan, call = _planned(reuse, session, [{"role": "user", "content": "c"}],
                              session.take_seq())
        gen = SimpleNamespace(message=lambda: said, prompt_ids=PROMPT_IDS, ids=HELLO)
        ex = SimpleNamespace(generated=gen, plan=plan, chain=None, session=session)
        sessions = Sessions(fail)
        with pytest.raises(error):
            asyncio.run(Recording(Conflicts(), sessions, reuse).record(ex, call))  # type: ignore[arg-type]
        assert sessions.refreshes == (1 if fail else MAX_CONFLICTS)
        assert session.let_go == [0]  # given back; no conflicting seq let go


def test_states_read_from_the_store_beyond_per_rollout_are_let_go() -> None:
    """A session reading the store's states (a restart, another replica's calls) holds the
    `per_rollout` most recent it has not let go, as one gateway would, and lets go of the
    others."""
    reuse = TokenReuse(per_rollout=2)
    session = _Session()
    session.let_go = [5]  # let go by this session, not named to the store yet: not held again
    records = [spb.SegmentRecord(segment=seq, seq=seq, ids=array("i", [seq]).tobytes(),
                                 n_messages=2, digest=b"d", settings=b"s")
               for seq in (7, 5, 2, 1)]
    reuse.load(session, records)
    assert [s.seq for s in session.tokens] == [7, 2]  # type: ignore[attr-defined]
    assert session.let_go == [5, 1]


def test_a_template_that_does_not_split_into_turns_is_rendered_by_the_engine() -> None:
    """A template that renders an assistant turn's end differently each time: the turn is
    recorded as a TEMPLATE segment start, and the template is asked only once."""
    asked = []

    async def odd_tokenize(request: dict[str, object]) -> list[int]:
        asked.append(request)
        ids = await _toy_tokenize(request)
        return ids + [len(asked)]  # a trailing token that changes from render to render

    reuse = TokenReuse()
    session = _Session()
    main = [{"role": "user", "content": "main"}]
    said = {"role": "assistant", "content": "Hello, world!"}
    plan = asyncio.run(reuse.plan(session, {"model": "tiny", "messages": main}, "tiny",
                                  odd_tokenize))
    first = c.Call(seq=0, prompt_token_ids=PROMPT_IDS, completion_token_ids=HELLO)
    reuse.fields(plan, first)
    _recorded(reuse, session, plan, first, said, PROMPT_IDS, HELLO)
    session.next_seq = 1
    for turn in range(2):
        forward = {"model": "tiny", "messages": main + [said, {"role": "user", "content": "x"}]}
        plan = asyncio.run(reuse.plan(session, forward, "tiny", odd_tokenize))
        assert plan.start == c.SEGMENT_START_TEMPLATE and "kv_transfer_params" not in forward
    assert len(asked) == 3  # the dummy renders, once
