"""What a call's engine output adds up to: token ids, logprobs, text, tool calls.

The engine (vLLM, asked for `return_token_ids` and logprobs) answers a chat completion or a
completion either whole or as server-sent events. `SSEDecoder` cuts the event stream into
its `data:` payloads; a `Generated` accumulates either shape (a whole response is one big
"chunk") into what the gateway records: prompt and completion token ids, one logprob per
completion token, finish reason, the text and tool calls the harness received.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from harnessrl.v1 import common_pb2 as c

DONE = b"[DONE]"


class SSEDecoder:
    """Splits a server-sent-event byte stream into the `data:` payloads of its events."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events.pop()
        out = []
        for event in events:
            lines = [line[5:].lstrip(b" ") for line in event.split(b"\n")
                     if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        return out


class Generated:
    """The engine's output for one call (choice 0), from a whole response or its chunks."""

    __slots__ = ("chat", "prompt_ids", "ids", "logprobs", "text", "tool_calls", "finish_reason",
                 "stop_reason", "usage", "id", "whole")

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason = ""
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.id = ""
        self.whole: dict[str, Any] | None = None  # a whole response's message, as returned

    def add(self, chunk: dict[str, Any]) -> None:
        """Adds a streamed chunk, or a whole response (`message` instead of `delta`)."""
        if not self.id:
            self.id = chunk.get("id") or ""
        if (p := chunk.get("prompt_token_ids")) is not None:
            self.prompt_ids = p
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            if (p := choice.get("prompt_token_ids")) is not None:
                self.prompt_ids = p
            if ids := choice.get("token_ids"):
                if self.ids:
                    self.ids += ids
                else:
                    self.ids = ids
            if lp := choice.get("logprobs"):
                if self.chat:
                    self.logprobs += [e["logprob"] for e in lp.get("content") or ()]
                else:
                    self.logprobs += lp.get("token_logprobs") or ()
            if self.chat:
                if "message" in choice:
                    self.whole = choice["message"] or {}
                self._add_message(choice.get("delta") or self.whole or {})
            elif choice.get("text"):
                self.text.append(choice["text"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")

    def _add_message(self, delta: dict[str, Any]) -> None:
        if delta.get("content"):
            self.text.append(delta["content"])
        for i, tc in enumerate(delta.get("tool_calls") or ()):
            slot = self.tool_calls.setdefault(tc.get("index", i), {
                "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            if tc.get("id"):
                slot["id"] = tc["id"]
            fn = tc.get("function") or {}
            if fn.get("name"):
                slot["function"]["name"] += fn["name"]
            if fn.get("arguments"):
                slot["function"]["arguments"] += fn["arguments"]

    @property
    def content(self) -> str:
        return "".join(self.text)

    def message(self) -> dict[str, Any]:
        """The assistant message the harness received (chat)."""
        if self.whole is not None:
            return self.whole
        return {"role": "assistant", "content": self.content or None,
                "tool_calls": [self.tool_calls[k] for k in sorted(self.tool_calls)]}

    def problem(self) -> str:
        """Why this output cannot be recorded ("" when it can)."""
        if self.prompt_ids is None:
            return "the engine returned no prompt token ids (it must be vLLM with " \
                   "return_token_ids support)"
        if len(self.logprobs) != len(self.ids):
            return f"the engine returned {len(self.logprobs)} logprobs for {len(self.ids)} tokens"
        return ""

    def call(self, api: str, model: str, request_json: bytes, aborted: bool = False) -> c.Call:
        returned = orjson.dumps(self.message() if self.chat else self.content)
        ids, logprobs = self.ids, self.logprobs
        if aborted:
            n = min(len(ids), len(logprobs))
            ids, logprobs = ids[:n], logprobs[:n]
        return c.Call(api=api, model=model, prompt_token_ids=self.prompt_ids or [],
                      completion_token_ids=ids,
                      logprobs=[lp if lp is not None else -math.inf for lp in logprobs],
                      finish_reason=self.finish_reason or ("abort" if aborted else ""),
                      request_json=request_json, completion_text=self.content,
                      response_message_json=returned, aborted=aborted)


def strip_chunk(chunk: dict[str, Any], keep_ids: bool, keep_logprobs: bool) -> dict[str, Any]:
    """Removes what the gateway asked the engine for on its own behalf (in place)."""
    if not keep_ids:
        chunk.pop("prompt_token_ids", None)
    for choice in chunk.get("choices") or ():
        if not keep_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not keep_logprobs:
            choice["logprobs"] = None
    return chunk
