"""Token in, token out: across the turns of a rollout, the engine gets the exact tokens of the
earlier turns, and only the new messages are tokenized.

A harness resends the whole conversation every turn. Rendering and tokenizing it again would
not always give back the tokens the policy produced: a completion's tokens can re-tokenize
differently once concatenated (a BPE boundary: "1" "2" sampled as two tokens comes back as
the one token "12"), and chat templates may render an earlier assistant turn differently from
how it was generated. Samples would then drift from what the engine saw.

So for a chat request (chat completions, and Messages and Responses, which the gateway
translates to chat) the gateway keeps, per attempt, the token sequence of the last call
(`SegmentState`: its prompt ids + completion ids; the few most recent calls, so side
conversations and branches do not break the main one) and a digest of the messages it stood for
(the request's messages + the assistant message returned). When the next request's messages
begin with exactly those (`canonical` form: roles, text, tool calls by name and arguments;
ids and reasoning fields ignored) and the tools and template settings are unchanged, the
prompt is

    earlier prompt ids + earlier completion ids + the turn's closing tokens + new messages

where the closing tokens are what the chat template puts after an assistant turn's content
and the model did not generate itself (for ChatML: the newline after `<|im_end|>`; both
tokens when the completion was cut at `max_tokens`), and the new messages are tokenized
through the engine's own `/tokenize` (its tokenizer and chat template: no transformers here),
rendered after a fixed dummy conversation whose tokens are then cut off (`TemplateSplit`).
The engine receives these ids in `kv_transfer_params.prompt_token_ids` next to the messages
(vLLM 0.32 then skips templating and tokenization and still parses tool calls from the
messages' `tools`); the prompt ids it answers with are checked against what was sent.

Anything else starts a new segment, recorded on the call (`Call.segment_start`): the first
call, edited or truncated history, changed tools or template settings, requests the engine
must render itself (completions API, `echo`, `continue_final_message`, non-text content),
state the gateway does not hold.

The states are recorded in the store with their calls (`state`, `AppendCallsRequest.states`),
so a restarted gateway, an evicted attempt and another replica read them back (`load`,
`Sessions.refresh`) and the next turn continues its segment.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb


class NotText(ValueError):
    """A message the gateway does not compare (non-text content): the engine renders it."""


def _args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments


def canonical(msg: Any) -> dict[str, Any]:
    """What of a chat message decides how it renders: role, text, tool calls (name and
    arguments as JSON values), name. Ids, reasoning and other fields are ignored."""
    if not isinstance(msg, dict):
        raise NotText("a message must be an object")
    content = msg.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text",
                                                                      "output_text"):
                raise NotText("non-text content")
            texts.append(str(part.get("text", "")))
        content = "\n".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise NotText("content must be text")
    out: dict[str, Any] = {"r": msg.get("role"), "c": content}
    calls = msg.get("tool_calls")
    if calls:
        out["t"] = [[(tc.get("function") or {}).get("name"),
                     _args((tc.get("function") or {}).get("arguments"))] for tc in calls]
    if msg.get("name"):
        out["n"] = msg["name"]
    return out


def digest(canon: list[dict[str, Any]]) -> bytes:
    return hashlib.blake2b(orjson.dumps(canon, option=orjson.OPT_SORT_KEYS),
                           digest_size=16).digest()


class Prefixes:
    """`digest` of the prefixes of one request's messages (canonical), hashed incrementally:
    a longer prefix's hash goes on from a shorter one's, so the conversation is encoded and
    hashed once per call, where `digest(canon[:n])` did it again for each prefix compared and
    once more for the call's own state. The same bytes are hashed (orjson's compact list:
    "[", the messages comma separated, "]"), so the digests are `digest`'s. (Each run of
    messages is encoded in one call: orjson spends about 1 us a call, ten times what one
    message costs it.)"""

    __slots__ = ("canon", "_hash", "_n", "_seen")

    def __init__(self, canon: list[dict[str, Any]]) -> None:
        self.canon = canon
        self._hash: Any = None  # "[" and the first `_n` messages, once a prefix is asked for
        self._n = 0
        self._seen: dict[int, bytes] = {}

    def _add(self, h: Any, first: bool, messages: list[dict[str, Any]]) -> None:
        encoded = orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)  # "[m,m,...]"
        if not first:
            h.update(b",")
        h.update(memoryview(encoded)[1:-1])

    def _upto(self, n: int) -> Any:
        if self._hash is None or n < self._n:  # (asked out of order: hashed again)
            self._hash, self._n = hashlib.blake2b(b"[", digest_size=16), 0
        if n > self._n:
            self._add(self._hash, self._n == 0, self.canon[self._n:n])
            self._n = n
        return self._hash

    def digest(self, n: int) -> bytes:
        """`digest(canon[:n])`."""
        found = self._seen.get(n)
        if found is None:
            h = self._upto(n).copy()
            h.update(b"]")
            found = self._seen[n] = h.digest()
        return found

    def with_message(self, message: dict[str, Any]) -> bytes:
        """`digest(canon + [message])`."""
        if self._hash is None:  # no prefix asked for (a first turn): in one go
            return digest(self.canon + [message])
        h = self._hash.copy()  # (`_n` <= len(canon): only prefixes are asked for)
        self._add(h, self._n == 0, self.canon[self._n:] + [message])
        h.update(b"]")
        return h.digest()


_SETTINGS = ("tools", "chat_template", "chat_template_kwargs")
_UNTRACKED = frozenset(("echo", "continue_final_message", "documents", "kv_transfer_params",
                        "prompt_embeds"))
_NO_SETTINGS = digest([None, None, None])  # type: ignore[list-item]


def settings_digest(forward: dict[str, Any]) -> bytes:
    values = [forward.get(k) for k in _SETTINGS]
    if values == [None, None, None]:
        return _NO_SETTINGS
    return digest(values)  # type: ignore[arg-type]


@dataclass(slots=True)
class SegmentState:
    """An attempt's last recorded chat call, as far as the next turn needs it."""

    segment: int  # seq of the call that started the segment
    seq: int  # seq of the call
    ids: array  # type: ignore[type-arg]  # its prompt ids + completion ids
    n_messages: int  # its messages + the assistant message returned
    digest: bytes  # digest(canonical of those messages)
    settings: bytes  # settings_digest of its request


@dataclass(slots=True)
class Plan:
    """How one call's prompt was made (`Call.segment*` fields), and what to keep after it."""

    start: int = c.SEGMENT_START_UNTRACKED
    state: SegmentState | None = None  # the state it extends (CONTINUED)
    prompt: list[int] | None = None  # the ids sent (CONTINUED)
    canon: list[dict[str, Any]] = field(default_factory=list)  # its messages, canonical
    prefixes: Prefixes | None = None  # digests of `canon`'s prefixes
    settings: bytes = b""
    engine_rendered: bool = False  # the engine did not use the ids sent


@dataclass(slots=True)
class TemplateSplit:
    """How the engine's chat template frames turns, found once per (model, settings) from a
    dummy conversation: the dummy's tokens (cut off the front of a render of dummy + new
    messages) and the tokens that close an assistant turn after its content."""

    dummy_ids: list[int]
    closing: list[int]


DUMMY_HEAD = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
DUMMY = DUMMY_HEAD + [{"role": "assistant", "content": "A"}]

Tokenize = Callable[[dict[str, Any]], Awaitable[list[int]]]


class TemplateError(Exception):
    """The template's renders do not split into turns (so ids cannot be spliced)."""


def _startswith(ids: list[int], prefix: list[int]) -> bool:
    return len(ids) >= len(prefix) and ids[:len(prefix)] == prefix


def closing_tail(ids: array | list[int], closing: list[int]) -> list[int]:  # type: ignore[type-arg]
    """The closing tokens the model did not generate: `closing` minus its longest prefix that
    `ids` already ends with (a completion that stopped on `<|im_end|>` ends with the first)."""
    for k in range(min(len(closing), len(ids)), 0, -1):
        if list(ids[len(ids) - k:]) == closing[:k]:
            return closing[k:]
    return list(closing)


class TokenReuse:
    """The gateway's token in, token out: `plan` before a chat call goes to the engine,
    `recorded` once the call is in the store. Per-attempt state lives on the session (its
    `per_rollout` most recent calls); at most `max_rollouts` attempts hold state (least
    recently used dropped first)."""

    def __init__(self, max_rollouts: int = 4096, per_rollout: int = 4, max_splits: int = 256,
                 drop_batch: int = 4) -> None:
        self.max_rollouts = max_rollouts
        self.per_rollout = max(1, per_rollout)
        # The states an attempt let go are named to the store once this many have gathered
        # (one HDEL per `drop_batch` calls): the store keeps what the session holds, up to
        # `drop_batch` it let go, and those that calls in flight named or may have written.
        self.drop_batch = max(1, drop_batch)
        self.max_splits = max_splits
        self._holders: OrderedDict[int, Any] = OrderedDict()  # id(session) -> session
        # (model, settings) -> how its template frames turns (None: it does not split)
        self._splits: OrderedDict[tuple[str, bytes], TemplateSplit | None] = OrderedDict()

    async def plan(self, session: Any, forward: dict[str, Any], model: str,
                   tokenize: Tokenize) -> Plan:
        """Decides how the prompt of a chat request is made; when it extends the attempt's
        last call, sets `forward["kv_transfer_params"]` to the reused + new ids."""
        if not _UNTRACKED.isdisjoint(forward) and any(forward.get(k) for k in _UNTRACKED) \
                or forward.get("add_generation_prompt", True) is not True:
            return Plan(c.SEGMENT_START_UNTRACKED)
        messages = forward.get("messages") or []
        try:
            canon = [canonical(m) for m in messages]
        except NotText:
            return Plan(c.SEGMENT_START_UNTRACKED)
        prefixes = Prefixes(canon)
        plan = Plan(c.SEGMENT_START_FIRST, canon=canon, prefixes=prefixes,
                    settings=settings_digest(forward))
        states: list[SegmentState] | None = session.tokens
        if not states:
            if session.next_seq > 0:
                plan.start = c.SEGMENT_START_NO_STATE
            return plan
        state = _extended(states, prefixes, plan.settings)
        if state is None:
            plan.start = c.SEGMENT_START_SETTINGS_CHANGED \
                if all(s.settings != plan.settings for s in states) else c.SEGMENT_START_EDITED
            return plan
        n = state.n_messages
        try:
            split = await self._split(forward, model, tokenize)
            render = dict(_template_fields(forward), messages=DUMMY + messages[n:],
                          add_generation_prompt=True)
            rendered = await tokenize(render)
            if not _startswith(rendered, split.dummy_ids):
                raise TemplateError("the new messages' render does not extend the dummy's")
        except TemplateError:
            plan.start = c.SEGMENT_START_TEMPLATE
            return plan
        prompt = state.ids.tolist()
        prompt += closing_tail(state.ids, split.closing)
        prompt += rendered[len(split.dummy_ids):]
        plan.start, plan.state, plan.prompt = c.SEGMENT_START_CONTINUED, state, prompt
        forward["kv_transfer_params"] = {"prompt_token_ids": prompt}
        return plan

    async def _split(self, forward: dict[str, Any], model: str, tokenize: Tokenize
                     ) -> TemplateSplit:
        key = (model, settings_digest(forward))
        if key in self._splits:
            self._splits.move_to_end(key)
            found = self._splits[key]
            if found is None:
                raise TemplateError("this template's renders do not split into turns")
            return found
        fields = _template_fields(forward)
        dummy = await tokenize(dict(fields, messages=DUMMY, add_generation_prompt=False))
        head = await tokenize(dict(fields, messages=DUMMY_HEAD, add_generation_prompt=True))
        empty = await tokenize(dict(fields, add_generation_prompt=False, messages=DUMMY_HEAD + [
            {"role": "assistant", "content": ""}]))
        closing = empty[len(head):]
        split: TemplateSplit | None = TemplateSplit(dummy, closing)
        if not _startswith(empty, head) or not closing or \
                dummy[len(dummy) - len(closing):] != closing:
            split = None  # remembered: not asked again for every turn
        self._splits[key] = split
        while len(self._splits) > self.max_splits:
            self._splits.popitem(last=False)
        if split is None:
            raise TemplateError("this template's renders do not split into turns (an empty "
                                "assistant turn must extend the generation prompt, and "
                                "assistant turns end with the same tokens)")
        return split

    def check(self, plan: Plan, prompt_ids: list[int] | None) -> None:
        """After the engine answered: it must have used the ids sent."""
        if plan.start == c.SEGMENT_START_CONTINUED and prompt_ids != plan.prompt:
            plan.engine_rendered = True

    def fields(self, plan: Plan, call: c.Call) -> None:
        """Sets the call's segment fields (its `seq` already set)."""
        start = plan.start
        if start == c.SEGMENT_START_CONTINUED and plan.engine_rendered:
            start = c.SEGMENT_START_TEMPLATE
        call.segment_start = start  # type: ignore[assignment]
        if start == c.SEGMENT_START_CONTINUED:
            assert plan.state is not None
            call.segment = plan.state.segment
            call.extends_seq = plan.state.seq
            call.reused_prompt_tokens = len(plan.state.ids)
        else:
            call.segment = call.seq

    def state(self, session: Any, plan: Plan, call: c.Call, assistant: dict[str, Any]
              ) -> spb.GatewayCallState | None:
        """What the store keeps of this call for a later turn (recorded with it), or None
        when no turn can extend it (untracked, non-text answer). Once `drop_batch` states have
        gathered in `session.let_go` (the ones later calls replaced or pushed out of
        `per_rollout`), it names them: the store deletes them with this call, which takes them
        over (`unsent` gives them back if it is not recorded). They go with a later call rather
        than their own: calls of one attempt in flight together each see the states as they
        were, and only `recorded`, one call at a time, knows which go."""
        if call.segment_start in (c.SEGMENT_START_UNTRACKED, c.SEGMENT_START_MEDIA):
            return None
        try:
            answer = canonical(assistant)
        except NotText:
            return None
        out = spb.GatewayCallState(
            segment=True, n_messages=len(plan.canon) + 1, settings=plan.settings,
            digest=plan.prefixes.with_message(answer) if plan.prefixes is not None
            else digest(plan.canon + [answer]))
        if len(session.let_go) >= self.drop_batch:
            out.drop_seqs.extend(session.let_go)
            session.let_go = []
        return out

    @staticmethod
    def unsent(session: Any, state: spb.GatewayCallState) -> None:
        """`state`'s call was not recorded: the states it took over are let go still."""
        session.let_go += [seq for seq in state.drop_seqs if seq not in session.let_go]

    def recorded(self, session: Any, plan: Plan, call: c.Call, state: spb.GatewayCallState,
                 prompt_ids: list[int], completion_ids: list[int]) -> None:
        """The call is in the store (and complete) with `state`: a later turn may extend it.
        The attempt keeps its `per_rollout` most recent calls' states (a harness may
        interleave side conversations, or branch), the one this call extended replaced; that
        one and those it pushes out join `session.let_go`. A session whose states were evicted
        (`max_rollouts`) holds none until its next call reads them from the store."""
        if plan.state is not None and plan.state.seq not in session.let_go:
            session.let_go.append(plan.state.seq)  # replaced (named twice at worst: harmless)
        if session.evicted:
            return
        reused = plan.state.ids if plan.state is not None and not plan.engine_rendered \
            else None
        if reused is not None:  # only the tokens added since are converted
            ids = reused + array("i", prompt_ids[len(reused):])
        else:
            ids = array("i", prompt_ids)  # == the call's (lists: faster than the proto's)
        ids.extend(completion_ids)
        new = SegmentState(call.segment, call.seq, ids, state.n_messages, state.digest,
                           state.settings)
        # by seq: a refresh since may have reloaded the one it extended, and this call's own
        skip = (plan.state.seq if plan.state is not None else -1, call.seq)
        states = [s for s in session.tokens or () if s.seq not in skip]
        if len(states) >= self.per_rollout:
            session.let_go += [s.seq for s in states[self.per_rollout - 1:]
                               if s.seq not in session.let_go]
        self._hold(session, [new] + states[:self.per_rollout - 1])

    def load(self, session: Any, records: Any) -> None:
        """The attempt's states as the store holds them (`SegmentRecord`s, most recent first):
        a restarted gateway, or another replica's calls. The session holds the `per_rollout`
        most recent that it has not let go itself, and lets go of the others (states another
        replica let go, not named to the store yet; the store leaves out those a stored call
        extended)."""
        pending = set(session.let_go)  # let go already: not held again
        states = [SegmentState(r.segment, r.seq, array("i", r.ids), r.n_messages, r.digest,
                               r.settings) for r in records if r.seq not in pending]
        session.let_go += [s.seq for s in states[self.per_rollout:]]
        self._hold(session, states[:self.per_rollout])

    def _hold(self, session: Any, states: list[SegmentState]) -> None:
        session.tokens, session.evicted = states, False
        key = id(session)
        self._holders[key] = session
        self._holders.move_to_end(key)
        while len(self._holders) > self.max_rollouts:
            _, old = self._holders.popitem(last=False)
            old.tokens, old.evicted = None, True  # read again from the store on its next turn


def _extended(states: list[SegmentState], prefixes: Prefixes, settings: bytes
              ) -> SegmentState | None:
    """The most recent state whose messages `prefixes.canon` begins with (and adds to)."""
    n_canon = len(prefixes.canon)
    candidates = [s for s in states if s.settings == settings and n_canon > s.n_messages]
    for n in sorted({s.n_messages for s in candidates}):  # one pass, shortest first
        prefixes.digest(n)
    for state in candidates:
        if prefixes.digest(state.n_messages) == state.digest:
            return state
    return None


def _template_fields(forward: dict[str, Any]) -> dict[str, Any]:
    out = {k: forward[k] for k in _SETTINGS if forward.get(k) is not None}
    out["model"] = forward.get("model")
    return out
