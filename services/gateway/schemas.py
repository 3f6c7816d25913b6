"""The request shapes of the gateway's APIs, checked before anything reads a request.

Each API's request body is parsed (`parse`) and validated against a typed model of its shape
(a TypedDict checked by pydantic, strict: a JSON string is never an integer, a boolean never a
number; a list stops at its first wrong item) before the gateway forwards or translates it, so
a field of the wrong type is answered 400 naming the field, never a crash of the code that
reads it. The models hold the fields the gateway or its translations (`anthropic.py`,
`responses.py`, `tokens.py`) read and the common ones it forwards; every other field passes as
it is (`extra="allow"`: SDKs add fields of their own). Optional fields accept `null` as absent.

`Invalid` is the one error of a request the gateway cannot serve: where (`loc`, a path into
the body) and what. `app.py` answers it 400 in the API's own shape: OpenAI's `error.param`
(`messages[0].content`) and message, or Anthropic's message (`messages.0.content: ...`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Required, TypeVar

import orjson
from pydantic import ConfigDict, FailFast, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

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


class _FailFast(FailFast):
    """Stops checking a list at its first wrong item (a 16 MiB body of wrong items costs one
    error, not millions); hashable, so that it can sit in a union."""

    __hash__ = object.__hash__


T = TypeVar("T")
List = Annotated[list[T], _FailFast()]
Obj = dict[str, Any]
# Each shape is a TypedDict (checked without building objects: ~7x faster than models);
# fields are optional unless `Required`; unknown fields pass.
_allow = with_config(ConfigDict(extra="allow", strict=True))


# OpenAI chat completions and completions (forwarded; `tokens.py` reads the messages) -------
@_allow
class ChatFunctionCall(TypedDict, total=False):
    name: str | None
    arguments: str | Obj | None  # JSON text (some clients send the object)


@_allow
class ChatToolCall(TypedDict, total=False):
    id: str | None
    type: str | None
    function: ChatFunctionCall | None


@_allow
class ChatPart(TypedDict, total=False):
    type: Required[str]
    text: str | None


@_allow
class ChatMessage(TypedDict, total=False):
    role: Required[str]
    content: str | List[ChatPart] | None
    name: str | None
    tool_calls: List[ChatToolCall] | None
    tool_call_id: str | None


@_allow
class FunctionDef(TypedDict, total=False):
    name: Required[str]
    description: str | None
    parameters: Obj | None


@_allow
class ChatTool(TypedDict, total=False):
    type: str
    function: FunctionDef | None


@_allow
class StreamOptions(TypedDict, total=False):
    include_usage: bool | None
    continuous_usage_stats: bool | None


@_allow
class _OpenAIRequest(TypedDict, total=False):
    model: Required[str]
    stream: bool | None
    stream_options: StreamOptions | None
    n: int | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: str | List[str] | None
    return_token_ids: bool | None


@_allow
class ChatRequest(_OpenAIRequest, total=False):
    messages: Required[List[ChatMessage]]
    max_completion_tokens: int | None
    logprobs: bool | None
    top_logprobs: int | None
    tools: List[ChatTool] | None
    tool_choice: str | Obj | None
    parallel_tool_calls: bool | None
    chat_template: str | None
    chat_template_kwargs: Obj | None
    add_generation_prompt: bool | None
    continue_final_message: bool | None
    echo: bool | None
    documents: List[Obj] | None


@_allow
class CompletionRequest(_OpenAIRequest, total=False):
    prompt: Required[str | List[str | int | List[int]]]  # text(s), token ids, lists of them
    logprobs: int | bool | None  # an int; a boolean is taken as "the sampled token's"
    echo: bool | None
    suffix: str | None


# Anthropic Messages (translated: `anthropic.py`) -------------------------------------------
@_allow
class Block(TypedDict, total=False):
    """Any content block; which types are served where is `anthropic.to_chat`'s to say."""

    type: Required[str]
    text: str | None
    id: str | None
    name: str | None
    input: Obj | None
    tool_use_id: str | None
    content: str | List[Block] | None  # a tool_result's
    is_error: bool | None


@_allow
class AnthropicMessage(TypedDict):
    role: str
    content: str | List[Block]


@_allow
class AnthropicTool(TypedDict, total=False):
    name: Required[str]
    type: str | None
    description: str | None
    input_schema: Obj | None  # none: a server tool (not served)


@_allow
class AnthropicToolChoice(TypedDict, total=False):
    type: Required[str]
    name: str | None
    disable_parallel_tool_use: bool | None


@_allow
class _AnthropicRequest(TypedDict, total=False):
    model: Required[str]
    messages: Required[List[AnthropicMessage]]
    system: str | List[Block] | None
    stop_sequences: List[str] | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    stream: bool | None
    tools: List[AnthropicTool] | None
    tool_choice: AnthropicToolChoice | None
    thinking: Obj | None
    metadata: Obj | None


@_allow
class MessagesRequest(_AnthropicRequest, total=False):
    max_tokens: Required[int]


@_allow
class CountTokensRequest(_AnthropicRequest, total=False):
    max_tokens: int | None  # not part of a count_tokens request


# OpenAI Responses (translated: `responses.py`) ----------------------------------------------
@_allow
class ResponsesPart(TypedDict, total=False):
    type: Required[str]
    text: str | None


@_allow
class ResponsesItem(TypedDict, total=False):
    type: str  # "message" when absent
    role: str | None
    content: str | List[ResponsesPart] | None
    call_id: str | None
    name: str | None
    arguments: str | None
    output: str | List[ResponsesPart] | None


@_allow
class ResponsesTool(TypedDict, total=False):
    type: Required[str]
    name: str | None
    description: str | None
    parameters: Obj | None
    strict: bool | None


@_allow
class ResponsesToolChoice(TypedDict, total=False):
    type: Required[str]
    name: str | None


@_allow
class ResponsesRequest(TypedDict, total=False):
    model: Required[str]
    input: str | List[ResponsesItem] | None
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: List[ResponsesTool] | None
    tool_choice: str | ResponsesToolChoice | None
    parallel_tool_calls: bool | None
    stream: bool | None
    store: bool | None
    metadata: Obj | None


@_allow
class RewardRequest(TypedDict):
    reward: float


def _one_choice(request: dict[str, Any]) -> None:
    if request.get("n") not in (1, None):
        raise Invalid(("n",), "over 1 is not supported: the controller samples groups",
                      "unsupported_n")
    for name in ("mm_processor_kwargs", "media_io_kwargs"):  # the record would not show them
        if name in request:  # (images are processed as the model's processor settings say)
            raise Invalid((name,), "not supported: images are processed as the served "
                                   "model's processor settings say", "unsupported_parameter")


class Shape:
    """One API's request shape: its TypedDict (checked by a `TypeAdapter` built once) and a
    check of what the types cannot say."""

    def __init__(self, typed: Any, check: Callable[[dict[str, Any]], None] | None = None
                 ) -> None:
        self.adapter: TypeAdapter[Any] = TypeAdapter(typed)
        self.check = check


CHAT = Shape(ChatRequest, _one_choice)
COMPLETION = Shape(CompletionRequest, _one_choice)
MESSAGES = Shape(MessagesRequest)
COUNT_TOKENS = Shape(CountTokensRequest)
RESPONSES = Shape(ResponsesRequest)
REWARD = Shape(RewardRequest)


# parsing and error reporting ---------------------------------------------------------------
def parse(body: bytes, shape: Shape | None = None) -> dict[str, Any]:
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
            shape.adapter.validate_python(data)
        except ValidationError as err:
            raise _invalid(err, data) from None
        if shape.check is not None:
            shape.check(data)
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
