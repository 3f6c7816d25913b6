"""OpenAI Responses (`POST /v1/responses`) over chat completions, with the gateway's own chains.

vLLM serves `/v1/responses`, but keeps no responses unless started with an in-memory store of
its own (so `previous_response_id` fails across engines and restarts) and returns token ids
only in its `enable_response_messages` extension; chat completions return them in every
streamed chunk. So the gateway translates: `instructions` + `input` items (messages,
`function_call`, `function_call_output`) become chat messages, function tools become chat
tools, and the answer is translated back to a Response, whole or as `response.*` events
(`response.completed` only once the call is recorded). `previous_response_id` resolves
against `Chains`, the conversations this gateway answered, each visible only to its rollout,
and else against the store, where each response's `Chain` entry is recorded with its call.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from harnessrl.v1 import store_pb2 as spb
from services.gateway.images import RequestImages, chat_content
from services.gateway.schemas import Invalid, Loc
from services.gateway.streaming import Generated


@dataclass(slots=True)
class Chain:
    """What one response adds to its chain, recorded in the store with its call (so another
    replica, or this gateway restarted, resolves `previous_response_id` to it)."""

    response_id: str
    previous_id: str  # "" when it starts a chain
    messages: list[dict[str, Any]]  # its input items as chat messages

    def state(self, state: spb.GatewayCallState | None, gen: Generated
              ) -> spb.GatewayCallState:
        out = state if state is not None else spb.GatewayCallState()
        out.response_id, out.previous_response_id = self.response_id, self.previous_id
        out.messages_json = orjson.dumps(self.messages + [assistant_message(gen)])
        out.keep_responses = KEEP_RESPONSES
        return out


KEEP_RESPONSES = 1024  # per attempt, in the store (a chain is resolved from its entries)


class Chains:
    """Response id -> (rollout, chat messages up to and including that response), bounded:
    this gateway's cache of the chains in the store."""

    def __init__(self, max_responses: int = 50_000) -> None:
        self.max_responses = max_responses
        self._items: OrderedDict[str, tuple[str, list[dict[str, Any]]]] = OrderedDict()

    def get(self, response_id: str, rollout_id: str) -> list[dict[str, Any]] | None:
        item = self._items.get(response_id)
        if item is None or item[0] != rollout_id:
            return None
        return item[1]

    def put(self, response_id: str, rollout_id: str, messages: list[dict[str, Any]]) -> None:
        self._items[response_id] = (rollout_id, messages)
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)


def _content_text(content: Any, where: Loc, images: RequestImages | None = None
                  ) -> str | list[dict[str, Any]]:
    """A string, or a list of parts joined; with `images`, a list with `input_image` parts
    becomes chat content parts (text and image_url, in order)."""
    if isinstance(content, str):
        return content
    if content is None:
        raise Invalid(where, "a string or a list of parts is required")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part["type"] == "input_image" and images is not None:
            parts.append(_image(part, (*where, j), images))
        elif part["type"] not in ("input_text", "output_text", "text"):
            raise Invalid((*where, j, "type"),
                          f"content parts of type {part['type']!r} are not supported")
        else:
            parts.append({"type": "text", "text": part.get("text") or ""})
    return chat_content(parts)


def _image(part: dict[str, Any], where: Loc, images: RequestImages) -> dict[str, Any]:
    """An `input_image` part (its `image_url`, a data URL) as a chat image_url part."""
    if part.get("image_url") is None:
        field = "file_id" if part.get("file_id") is not None else "image_url"
        raise Invalid((*where, field), "an image_url (a data URL) is required (file ids are "
                                       "not supported)", "invalid_image")
    url = images.data_url(part["image_url"], (*where, "image_url"))
    return {"type": "image_url", "image_url": {"url": url}}


def input_messages(items: Any, images: RequestImages | None = None) -> list[dict[str, Any]]:
    """Chat messages for a Responses `input` (a string or a list of items); `input_image`
    parts of user messages are taken when `images` checks them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if items is None:
        raise Invalid(("input",), "a string or a list of items is required")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise Invalid(("input", i, "role"), f"unknown role {role!r}")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(item.get("content"), ("input", i, "content"),
                                                 images if role == "user" else None)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or "", "type": "function", "function": {
                "name": item.get("name") or "", "arguments": item.get("arguments") or ""}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and \
                    last.get("content") is not None:
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output") or ""
            out.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                        "content": _content_text(output, ("input", i, "output"))})
        elif kind == "reasoning":
            continue
        else:
            raise Invalid(("input", i, "type"), f"items of type {kind!r} are not supported")
    return out


def to_chat(request: dict[str, Any], history: list[dict[str, Any]],
            images: RequestImages | None = None) -> dict[str, Any]:
    """The chat completions request for a Responses request (checked against its shape,
    `schemas.ResponsesRequest`) after `history`."""
    messages: list[dict[str, Any]] = []
    if request.get("instructions"):
        messages.append({"role": "system", "content": request["instructions"]})
    messages += history
    messages += input_messages(request.get("input"), images)
    forward: dict[str, Any] = {"model": request.get("model"), "messages": messages}
    if request.get("max_output_tokens") is not None:
        forward["max_tokens"] = request["max_output_tokens"]
    for name in ("temperature", "top_p"):
        if request.get(name) is not None:
            forward[name] = request[name]
    tools = []
    for k, tool in enumerate(request.get("tools") or ()):
        if tool["type"] != "function" or not tool.get("name"):
            raise Invalid(("tools", k, "type" if tool["type"] != "function" else "name"),
                          "only function tools (with a name) are supported")
        fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        tools.append({"type": "function", "function": fn})
    if tools:
        forward["tools"] = tools
    choice = request.get("tool_choice")
    if isinstance(choice, str):
        forward["tool_choice"] = choice
    elif choice is not None and choice["type"] == "function":
        forward["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    if request.get("parallel_tool_calls") is not None:
        forward["parallel_tool_calls"] = request["parallel_tool_calls"]
    return forward


def assistant_message(gen: Generated) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": gen.content or None}
    if gen.tool_calls:
        msg["tool_calls"] = [gen.tool_calls[k] for k in sorted(gen.tool_calls)]
    return msg


class ResponseBuilder:
    """Ids and output items of one Response, shared by its events and its final object."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self.id = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.fc_ids: dict[int, str] = {}
        self.created = int(time.time())

    def fc_id(self, index: int) -> str:
        return self.fc_ids.setdefault(index, "fc_" + uuid.uuid4().hex)

    def text_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def call_item(self, index: int, tc: dict[str, Any], status: str = "completed"
                  ) -> dict[str, Any]:
        fn = tc.get("function") or {}
        return {"type": "function_call", "id": self.fc_id(index), "call_id": tc.get("id") or
                "call_" + uuid.uuid4().hex[:24], "name": fn.get("name", ""),
                "arguments": fn.get("arguments", "") if status == "completed" else "",
                "status": status}

    def response(self, gen: Generated | None, status: str = "completed") -> dict[str, Any]:
        output: list[dict[str, Any]] = []
        incomplete = None
        if gen is not None:
            if gen.content:
                output.append(self.text_item(gen.content))
            for index in sorted(gen.tool_calls):
                output.append(self.call_item(index, gen.tool_calls[index]))
            if gen.finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        r = self.request
        usage = None if gen is None else {
            "input_tokens": len(gen.prompt_ids or ()), "output_tokens": len(gen.ids),
            "total_tokens": len(gen.prompt_ids or ()) + len(gen.ids),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": None, "incomplete_details": incomplete,
                "instructions": r.get("instructions"), "model": r.get("model"),
                "output": output, "parallel_tool_calls": r.get("parallel_tool_calls", True),
                "previous_response_id": r.get("previous_response_id"),
                "temperature": r.get("temperature"), "top_p": r.get("top_p"),
                "max_output_tokens": r.get("max_output_tokens"),
                "tool_choice": r.get("tool_choice", "auto"), "tools": r.get("tools") or [],
                "text": {"format": {"type": "text"}}, "metadata": r.get("metadata") or {},
                "usage": usage}


class ResponsesEvents:
    """Chat completion chunks -> Responses stream events (`EventRenderer`)."""

    def __init__(self, builder: ResponseBuilder, on_done: Any) -> None:
        self.b = builder
        self.on_done = on_done  # called with the Generated once the call is recorded
        self.seq = 0
        self.started = False
        self.text_index: int | None = None  # output index of the message item
        self.call_index: dict[int, int] = {}  # tool call index -> output index
        self.next_index = 0

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        data["type"] = kind
        data["sequence_number"] = self.seq
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _start(self) -> list[bytes]:
        self.started = True
        snapshot = self.b.response(None, "in_progress")
        return [self._event("response.created", {"response": snapshot}),
                self._event("response.in_progress", {"response": snapshot})]

    def chunk(self, chunk: dict[str, Any], gen: Generated) -> bytes:
        out = [] if self.started else self._start()
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.text_index is None:
                    self.text_index = self.next_index
                    self.next_index += 1
                    out.append(self._event("response.output_item.added", {
                        "output_index": self.text_index,
                        "item": self.b.text_item("", "in_progress")}))
                    out.append(self._event("response.content_part.added", {
                        "item_id": self.b.msg_id, "output_index": self.text_index,
                        "content_index": 0, "part": {"type": "output_text", "text": "",
                                                     "annotations": []}}))
                out.append(self._event("response.output_text.delta", {
                    "item_id": self.b.msg_id, "output_index": self.text_index,
                    "content_index": 0, "delta": delta["content"], "logprobs": []}))
            for tc in delta.get("tool_calls") or ():
                index = tc.get("index", 0)
                if index not in self.call_index:
                    self.call_index[index] = self.next_index
                    self.next_index += 1
                    out.append(self._event("response.output_item.added", {
                        "output_index": self.call_index[index],
                        "item": self.b.call_item(index, gen.tool_calls.get(index, tc),
                                                 "in_progress")}))
                args = (tc.get("function") or {}).get("arguments")
                if args:
                    out.append(self._event("response.function_call_arguments.delta", {
                        "item_id": self.b.fc_id(index), "output_index": self.call_index[index],
                        "delta": args}))
        return b"".join(out)

    def finish(self, gen: Generated) -> bytes:
        out = [] if self.started else self._start()
        if self.text_index is not None:
            text = gen.content
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._event("response.output_text.done", {
                "item_id": self.b.msg_id, "output_index": self.text_index, "content_index": 0,
                "text": text, "logprobs": []}))
            out.append(self._event("response.content_part.done", {
                "item_id": self.b.msg_id, "output_index": self.text_index, "content_index": 0,
                "part": part}))
            out.append(self._event("response.output_item.done", {
                "output_index": self.text_index, "item": self.b.text_item(text)}))
        for index, out_index in self.call_index.items():
            item = self.b.call_item(index, gen.tool_calls[index])
            out.append(self._event("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": out_index,
                "arguments": item["arguments"]}))
            out.append(self._event("response.output_item.done", {
                "output_index": out_index, "item": item}))
        self.on_done(gen)
        response = self.b.response(gen)
        kind = "response.completed" if response["status"] == "completed" else \
            "response.incomplete"
        out.append(self._event(kind, {"response": response}))
        return b"".join(out)

    def error(self, err: Any) -> bytes:
        return self._event("error", {"code": err.code, "message": err.message, "param": None})
