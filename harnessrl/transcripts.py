"""A recorded call (`Call`) rendered as chat messages, for graders and judges that read what
a harness did from the store: the conversation its request carried, then its answer (chat,
Anthropic Messages, Responses and completions calls, each in its own shape)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from harnessrl.v1 import common_pb2 as c


def transcript(call: c.Call) -> list[dict[str, Any]]:
    """A recorded call as messages: the conversation its request carried, then its answer."""
    try:
        req = json.loads(call.request_json or b"{}")
    except ValueError:
        req = {}
    if not isinstance(req, dict):
        req = {}
    if call.api == "chat.completions":
        messages = list(req.get("messages") or [])
    elif call.api == "messages":  # Anthropic: the system prompt is a field of its own
        messages = ([{"role": "system", "content": req["system"]}] if req.get("system") else [])
        messages += list(req.get("messages") or [])
    elif call.api == "responses":
        given = req.get("input")
        messages = ([{"role": "system", "content": req["instructions"]}]
                    if req.get("instructions") else [])
        messages += given if isinstance(given, list) else [{"role": "user", "content": given}]
    else:  # completions: the prompt as it was sent
        messages = [{"role": "user", "content": req.get("prompt", "")}]
    answer: Any = None
    if call.api == "chat.completions" and call.response_message_json:
        try:
            answer = json.loads(call.response_message_json)
        except ValueError:
            answer = None
    if not isinstance(answer, dict):
        answer = {"role": "assistant", "content": call.completion_text}
    return [*messages, answer]


def last_call_transcript(calls: "Iterable[c.Call]") -> list[dict[str, Any]]:
    """An attempt's transcript: its last recorded call as messages ([] without calls)."""
    last = max(calls, key=lambda k: k.seq, default=None)
    return transcript(last) if last is not None else []
