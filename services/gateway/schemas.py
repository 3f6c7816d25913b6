"""The request shapes of the gateway's APIs, checked before anything reads a request.

Each API's request body is parsed (`parse`) and validated against a typed model of its shape
(pydantic, strict: a JSON string is never an integer, a boolean never a number) before the
gateway forwards or translates it, so a field of the wrong type is answered 400 naming the
field, never a crash of the code that reads it. The models hold the fields the gateway or its
translations (`anthropic.py`, `responses.py`, `tokens.py`) read and the common ones it
forwards; every other field passes as it is (`extra="allow"`: SDKs add fields of their own).
Optional fields accept `null` as absent.

`Invalid` is the one error of a request the gateway cannot serve: where (`loc`, a path into
the body) and what. `app.py` answers it 400 in the API's own shape: OpenAI's `error.param`
(`messages[0].content`) and message, or Anthropic's message (`messages.0.content: ...`).
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

Loc = tuple[str | int, ...]


class Invalid(ValueError):
    """A request that cannot be served (400): the field at `loc` (empty: the whole body)."""

    def __init__(self, loc: Loc, problem: str, code: str = "invalid_value") -> None:
        super().__init__(problem)
        self.loc, self.problem, self.code = loc, problem, code

    def field(self, style: str = "anthropic") -> str | None:
        """The field's path as the API writes it: `messages.0.content` (Anthropic) or
        `messages[0].content` (OpenAI); None for the whole body."""
        if not self.loc:
            return None
        out = ""
        for part in self.loc:
            if isinstance(part, int):
                out += f"[{part}]" if style == "openai" else f".{part}"
            else:
                out += f".{part}" if out else part
        return out

    def message(self, style: str = "anthropic") -> str:
        field = self.field(style)
        return f"{field}: {self.problem}" if field else self.problem

    def __str__(self) -> str:
        return self.message()


class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    def check(self) -> None:
        """What the types cannot say (raises `Invalid`)."""


# OpenAI chat completions and completions (forwarded; `tokens.py` reads the messages) -------
class ChatFunctionCall(_Shape):
    name: str | None = None
    arguments: str | dict[str, Any] | None = None  # JSON text (some clients send the object)


class ChatToolCall(_Shape):
    id: str | None = None
    type: str | None = None
    function: ChatFunctionCall | None = None


class ChatPart(_Shape):
    type: str
    text: str | None = None


class ChatMessage(_Shape):
    role: str
    content: str | list[ChatPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Shape):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(_Shape):
    type: str = "function"
    function: FunctionDef | None = None


class StreamOptions(_Shape):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _OpenAIRequest(_Shape):
    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    return_token_ids: bool | None = None

    def check(self) -> None:
        if self.n not in (1, None):
            raise Invalid(("n",), "over 1 is not supported: the controller samples groups",
                          "unsupported_n")


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    echo: bool | None = None
    documents: list[dict[str, Any]] | None = None


class CompletionRequest(_OpenAIRequest):
    # text, texts, token ids, or lists of token ids
    prompt: str | list[str | int | list[int]]
    logprobs: int | bool | None = None  # an int; a boolean is taken as "the sampled token's"
    echo: bool | None = None
    suffix: str | None = None


# Anthropic Messages (translated: `anthropic.py`) -------------------------------------------
class Block(_Shape):
    """Any content block; which types are served where is `anthropic.to_chat`'s to say."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None  # a tool_result's
    is_error: bool | None = None


class AnthropicMessage(_Shape):
    role: str
    content: str | list[Block]


class AnthropicTool(_Shape):
    name: str
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # none: a server tool (not served)


class AnthropicToolChoice(_Shape):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Shape):
    model: str
    messages: list[AnthropicMessage]
    max_tokens: int | None = None  # not part of a count_tokens request
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int  # type: ignore[assignment]


# OpenAI Responses (translated: `responses.py`) ----------------------------------------------
class ResponsesPart(_Shape):
    type: str
    text: str | None = None


class ResponsesItem(_Shape):
    type: str = "message"
    role: str | None = None
    content: str | list[ResponsesPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ResponsesPart] | None = None


class ResponsesTool(_Shape):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(_Shape):
    type: str
    name: str | None = None


class ResponsesRequest(_Shape):
    model: str
    input: str | list[ResponsesItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None


class Reward(_Shape):
    reward: float


# parsing and error reporting ---------------------------------------------------------------
def parse(body: bytes, shape: type[_Shape] | None = None) -> dict[str, Any]:
    """The JSON object in `body`, checked against `shape`; `Invalid` otherwise."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise Invalid((), f"malformed JSON body: {err}", "invalid_json") from err
    if not isinstance(data, dict):
        raise Invalid((), "the JSON body must be an object", "invalid_json")
    try:  # what is forwarded must encode again: orjson nests 254 levels at most (1024 read)
        orjson.dumps(data)
    except orjson.JSONEncodeError as err:
        raise Invalid((), f"JSON body not accepted: {err}", "invalid_json") from err
    if shape is not None:
        try:
            checked = shape.model_validate(data)
        except ValidationError as err:
            raise _invalid(err, data) from None
        checked.check()
    return data


_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
             "bool_type": "a boolean", "list_type": "an array", "dict_type": "an object",
             "model_type": "an object", "model_attributes_type": "an object"}
_MISSING = object()


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _where(error: Any, data: Any) -> tuple[Loc, Any]:
    """An error's path into the body and the value there: pydantic's `loc` without the names
    it gives the members of a union (`str`, `list[Block]`, a model's name)."""
    loc: list[str | int] = []
    at = data
    for i, part in enumerate(error["loc"]):
        if isinstance(at, dict) and isinstance(part, str) and part in at:
            at = at[part]
        elif isinstance(at, list) and isinstance(part, int) and 0 <= part < len(at):
            at = at[part]
        elif error["type"] == "missing" and i == len(error["loc"]) - 1:
            at = _MISSING
        else:
            continue  # a union member's name
        loc.append(part)
    return tuple(loc), at


def _invalid(err: ValidationError, data: dict[str, Any]) -> Invalid:
    """The most specific of pydantic's errors (the deepest field; each union member reports
    its own), with what every member expected there."""
    found = [(*_where(e, data), e) for e in err.errors(include_url=False, include_input=False)]
    loc, value, _ = max(found, key=lambda f: len(f[0]))
    errors = [e for lc, _, e in found if lc == loc]
    if any(e["type"] == "missing" for e in errors):
        return Invalid(loc, "required", "missing_required_parameter")
    expected = [_EXPECTED.get(e["type"]) for e in errors]
    if None in expected:  # not a type error
        return Invalid(loc, "; ".join(e["msg"] for e in errors))
    return Invalid(loc, f"expected {' or '.join(dict.fromkeys(expected))} "  # type: ignore[arg-type]
                        f"(got {json_kind(value)})", "invalid_type")
