"""The data plane's request shapes, as the HTTP fuzzer (`http_fuzz.py`) knows them.

`SHAPES`: a valid request of each API (chat completions, completions, Responses, Messages,
Messages count_tokens, the reward report), streamed and not. `FIELDS`: for each API, the JSON
kinds each field of those requests accepts, written from the APIs' public references (OpenAI,
Anthropic), not from the gateway's code, so that they check it: a field of a kind it does not
accept must be answered 400 naming the field, in the API's own error shape (OpenAI's
`error.param`, `messages[0].content`; Anthropic's message, `messages.0.content: ...`).

`wrong_type_inputs` generates one-field mutations of the `SHAPES`: one field (at any depth)
given a value of a kind it does not accept; `check_named` checks the answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

ANTHROPIC = {"anthropic-version": "2023-06-01"}


@dataclass(frozen=True)
class Shape:
    route: str
    body: dict[str, Any]
    records: bool = True  # each 200 answer is a recorded call

    @property
    def style(self) -> str:
        return "anthropic" if self.route.startswith("/v1/messages") else "openai"

    @property
    def headers(self) -> dict[str, str]:
        return ANTHROPIC if self.style == "anthropic" else {}


_TOOL_CHAT = {"type": "function", "function": {"name": "add", "description": "add",
                                               "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "number"}}}}}
_TOOL_ANTHROPIC = {"name": "add", "description": "add", "input_schema": {
    "type": "object", "properties": {"a": {"type": "number"}}}}
_TOOL_RESPONSES = {"type": "function", "name": "add", "description": "add",
                   "parameters": {"type": "object"}}
_TOOL_TURNS_ANTHROPIC = [
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "adding"}, {
        "type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": False,
                                  "content": [{"type": "text", "text": "1"}]}]}]

SHAPES = [
    Shape("/v1/chat/completions", {"model": "tiny", "max_tokens": 8, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
    Shape("/v1/chat/completions", {"model": "tiny", "stream": True,
                                   "stream_options": {"include_usage": True},
                                   "messages": [{"role": "user", "content": "hi"}]}),
    Shape("/v1/chat/completions", {"model": "tiny", "temperature": 1.0, "top_p": 1.0,
                                   "tools": [_TOOL_CHAT], "tool_choice": "auto",
                                   "messages": [{"role": "user", "content": [
                                       {"type": "text", "text": "add"}]}]}),
    Shape("/v1/chat/completions", {"model": "tiny", "max_tokens": 8, "logprobs": True,
                                   "tools": [_TOOL_CHAT], "stop": ["\n\n"], "seed": 1,
                                   "messages": [
                                       {"role": "user", "content": "add", "name": "u"},
                                       {"role": "assistant", "content": None, "tool_calls": [
                                           {"id": "c1", "type": "function", "function": {
                                               "name": "add", "arguments": "{\"a\": 1}"}}]},
                                       {"role": "tool", "tool_call_id": "c1", "content": "1"}]}),
    Shape("/v1/completions", {"model": "tiny", "prompt": "Say hi", "max_tokens": 4,
                              "logprobs": 1}),
    Shape("/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "stream": True}),
    Shape("/v1/completions", {"model": "tiny", "prompt": [9906, 11], "echo": False,
                              "temperature": 0.5, "stop": "\n"}),
    Shape("/v1/messages", {"model": "tiny", "max_tokens": 8, "system": "be brief",
                           "stop_sequences": ["\n\n"],
                           "messages": [{"role": "user", "content": "hi"}]}),
    Shape("/v1/messages", {"model": "tiny", "max_tokens": 8, "stream": True,
                           "tools": [_TOOL_ANTHROPIC], "messages": _TOOL_TURNS_ANTHROPIC}),
    Shape("/v1/messages", {"model": "tiny", "max_tokens": 8, "temperature": 1.0, "top_p": 1.0,
                           "top_k": 5, "metadata": {"user_id": "u"},
                           "system": [{"type": "text", "text": "be brief"}],
                           "tools": [_TOOL_ANTHROPIC], "tool_choice": {"type": "tool",
                                                                       "name": "add"},
                           "messages": _TOOL_TURNS_ANTHROPIC}),
    Shape("/v1/messages/count_tokens", {"model": "tiny", "messages": [
        {"role": "user", "content": "hi"}]}, records=False),
    Shape("/v1/messages/count_tokens", {"model": "tiny", "system": "be brief",
                                        "tools": [_TOOL_ANTHROPIC],
                                        "tool_choice": {"type": "auto"},
                                        "messages": _TOOL_TURNS_ANTHROPIC}, records=False),
    Shape("/v1/responses", {"model": "tiny", "instructions": "be brief", "input": "hi",
                            "max_output_tokens": 8}),
    Shape("/v1/responses", {"model": "tiny", "stream": True, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}],
        "tools": [_TOOL_RESPONSES]}),
    Shape("/v1/responses", {"model": "tiny", "temperature": 1.0, "top_p": 1.0,
                            "parallel_tool_calls": False, "store": False,
                            "tool_choice": {"type": "function", "name": "add"},
                            "tools": [_TOOL_RESPONSES], "metadata": {"k": "v"}, "input": [
                                {"type": "message", "role": "developer", "content": "be brief"},
                                {"role": "user", "content": "add 1"},
                                {"type": "function_call", "call_id": "c1", "name": "add",
                                 "arguments": "{\"a\": 1}"},
                                {"type": "function_call_output", "call_id": "c1", "output": [
                                    {"type": "input_text", "text": "1"}]}]}),
    Shape("/v1/harnessrl/reward", {"reward": 0.5}, records=False),
]

# What each field accepts, per API: a path pattern (`*`: any list index) -> JSON kinds
# ("any": free-form, its contents are not the API's to check). "number" takes integers too.
_BLOCK = {"type": "string", "text": "string null"}
_CHAT_COMMON = {"model": "string", "stream": "boolean null", "stream_options": "object null",
                "stream_options.include_usage": "boolean null", "max_tokens": "integer null",
                "temperature": "number null", "top_p": "number null", "seed": "integer null",
                "stop": "string array null", "stop.*": "string"}
_ANTHROPIC_BLOCKS = {"type": "string", "text": "string null", "id": "string null",
                     "name": "string null", "input": "any", "tool_use_id": "string null",
                     "is_error": "boolean null", "content": "string array null",
                     "content.*": "object", **{f"content.*.{k}": v for k, v in _BLOCK.items()}}
_ANTHROPIC = {"model": "string", "messages": "array", "messages.*": "object",
              "messages.*.role": "string", "messages.*.content": "string array",
              "messages.*.content.*": "object",
              **{f"messages.*.content.*.{k}": v for k, v in _ANTHROPIC_BLOCKS.items()},
              "system": "string array null", "system.*": "object",
              **{f"system.*.{k}": v for k, v in _BLOCK.items()},
              "tools": "array null", "tools.*": "object", "tools.*.name": "string",
              "tools.*.description": "string null", "tools.*.input_schema": "any",
              "tool_choice": "object null", "tool_choice.type": "string",
              "tool_choice.name": "string null"}
FIELDS: dict[str, dict[str, str]] = {
    "/v1/chat/completions": {
        **_CHAT_COMMON, "messages": "array", "messages.*": "object",
        "messages.*.role": "string", "messages.*.content": "string array null",
        "messages.*.content.*": "object",
        **{f"messages.*.content.*.{k}": v for k, v in _BLOCK.items()},
        "messages.*.name": "string null", "messages.*.tool_call_id": "string null",
        "messages.*.tool_calls": "array null", "messages.*.tool_calls.*": "object",
        "messages.*.tool_calls.*.id": "string null", "messages.*.tool_calls.*.type":
        "string null", "messages.*.tool_calls.*.function": "object null",
        "messages.*.tool_calls.*.function.name": "string null",
        "messages.*.tool_calls.*.function.arguments": "string object null",
        "logprobs": "boolean null", "tools": "array null", "tools.*": "object",
        "tools.*.type": "string", "tools.*.function": "object null",
        "tools.*.function.name": "string", "tools.*.function.description": "string null",
        "tools.*.function.parameters": "any", "tool_choice": "string object null"},
    "/v1/completions": {**_CHAT_COMMON, "prompt": "string array",
                        "prompt.*": "string integer array", "echo": "boolean null",
                        "logprobs": "integer boolean null"},
    "/v1/messages": {**_ANTHROPIC, "max_tokens": "integer", "stop_sequences": "array null",
                     "stop_sequences.*": "string", "temperature": "number null",
                     "top_p": "number null", "top_k": "integer null", "stream": "boolean null",
                     "metadata": "any"},
    "/v1/messages/count_tokens": _ANTHROPIC,
    "/v1/responses": {
        "model": "string", "instructions": "string null", "input": "string array null",
        "input.*": "object", "input.*.type": "string", "input.*.role": "string null",
        "input.*.content": "string array null", "input.*.content.*": "object",
        **{f"input.*.content.*.{k}": v for k, v in _BLOCK.items()},
        "input.*.call_id": "string null", "input.*.name": "string null",
        "input.*.arguments": "string null", "input.*.output": "string array null",
        "input.*.output.*": "object", **{f"input.*.output.*.{k}": v for k, v in _BLOCK.items()},
        "max_output_tokens": "integer null", "temperature": "number null",
        "top_p": "number null", "stream": "boolean null", "store": "boolean null",
        "parallel_tool_calls": "boolean null", "metadata": "any", "tools": "array null",
        "tools.*": "object", "tools.*.type": "string", "tools.*.name": "string null",
        "tools.*.description": "string null", "tools.*.parameters": "any",
        "tool_choice": "string object null", "tool_choice.type": "string",
        "tool_choice.name": "string null"},
    "/v1/harnessrl/reward": {"reward": "number"},
}

# A value of each kind (several: the fuzzer draws one).
SAMPLES: dict[str, list[Any]] = {
    "null": [None], "boolean": [True, False], "integer": [0, 7, -1, 2**40],
    "number": [1.5, -0.25, 1e300], "string": ["", "x", "tiny", "0"],
    "array": [[], [1], ["x"], [{}]], "object": [{}, {"a": 1}, {"type": "text", "text": "x"}]}


def _pattern(path: tuple[Any, ...]) -> str:
    return ".".join("*" if isinstance(p, int) else str(p) for p in path)


def field_paths(shape: Shape) -> list[tuple[tuple[Any, ...], str]]:
    """Every field of `shape`'s request that the API's shape constrains, with its kinds.
    A field missing from `FIELDS` is an error here (the table must cover the requests)."""
    table = FIELDS[shape.route]
    out: list[tuple[tuple[Any, ...], str]] = []

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if path:
            kinds = table.get(_pattern(path))
            if kinds is None:
                raise KeyError(f"{shape.route}: no kinds for {_pattern(path)!r}")
            if kinds == "any":
                return
            out.append((path, kinds))
        items = value.items() if isinstance(value, dict) else \
            enumerate(value) if isinstance(value, list) else ()
        for k, v in items:
            walk(v, path + (k,))

    walk(shape.body, ())
    return out


def wrong_kinds(kinds: str) -> list[str]:
    accepted = set(kinds.split()) | ({"integer"} if "number" in kinds else set())
    return [k for k in SAMPLES if k not in accepted]


def field_name(path: tuple[Any, ...], style: str) -> str:
    """A field's path as the API writes it in its errors."""
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]" if style == "openai" else f".{p}"
        else:
            out += f".{p}" if out else str(p)
    return out


def mutated_body(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> bytes:
    copy = json.loads(json.dumps(body))
    parent = copy
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return json.dumps(copy).encode()


def wrong_types() -> st.SearchStrategy[tuple[Shape, tuple[Any, ...], str, Any]]:
    """(shape, field path, wrong kind, value): one field of a valid request (a request drawn,
    then one of its fields) given a value of a kind it does not accept."""
    cases = {id(shape): [(path, kind) for path, kinds in field_paths(shape)
                         for kind in wrong_kinds(kinds)] for shape in SHAPES}
    return st.sampled_from(SHAPES).flatmap(lambda shape: st.tuples(
        st.just(shape), st.sampled_from(cases[id(shape)]))).flatmap(
        lambda c: st.sampled_from(SAMPLES[c[1][1]]).map(lambda v: (c[0], c[1][0], c[1][1], v)))


def check_named(field: str, style: str, statuses: list[int], bodies: list[bytes]) -> list[str]:
    """What is wrong with the answer to a request whose `field` has the wrong type: it must be
    a 400 in the API's own error shape that names the field."""
    if statuses != [400]:
        return ["wrong_type_not_400"]
    try:
        body = json.loads(bodies[0])
        err = body["error"]
        if style == "openai":  # {"error": {"message", "type", "param", "code"}}
            named = err["param"] == field and field in err["message"]
        else:  # {"type": "error", "error": {"type", "message"}}, the message "field: ..."
            named = body["type"] == "error" and err["message"].startswith(field + ":")
        shaped = err["type"] == "invalid_request_error"
    except (ValueError, KeyError, TypeError):
        return ["wrong_type_error_not_in_api_shape"]
    if not shaped:
        return ["wrong_type_error_not_in_api_shape"]
    return [] if named else ["wrong_type_field_not_named"]
