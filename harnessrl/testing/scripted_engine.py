"""A scripted OpenAI-compatible upstream that answers like vLLM: a test double of a model that
plays a script, for end-to-end tests of a real harness (mini-swe-agent) through the real gateway.

It is `stub_engine`'s server (same `/tokenize`, `/v1/models`, `/health`, token in / token out)
with chat completions answered from a script file (JSON, re-read when it changes):

    {"scripts": [{"marker": "case-gold-3f2a", "replies": [
        {"content": "I will fix it.", "command": "patch -p1 <<'EOF' ... EOF"},
        {"content": "Done.", "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]}],
     "default": [...]}

A request plays the script whose `marker` occurs in its messages' text (the first that does;
`default` when none does; no script at all: HTTP 400). Which reply it gets is read from the
conversation itself, so the engine keeps no state per rollout and concurrent rollouts of one
script do not disturb each other: the reply index is the number of turns already taken, i.e.
assistant messages plus user messages after the first one (a harness such as mini-swe-agent
drops a reply without a tool call from its history and adds a format-error user message
instead, so that turn counts too). Past the last reply it answers with the last one again.

A reply is `{"content": str, "command": str}` (one tool call of mini-swe-agent's `bash` tool,
`{"command": ...}`), `{"content": str, "commands": [str, ...]}` (several), `{"content": str}`
alone (no tool call: a format error for mini), or `{"status": 400, "message": str}` (an error
answer, as vLLM words its errors). `"tool": NAME` names another tool.

Like vLLM it returns `prompt_token_ids` (the ids the gateway sent in
`kv_transfer_params.prompt_token_ids`, else the toy tokens of the ChatML render of the
messages, as `/tokenize` counts them), per-choice `token_ids` (the toy tokens of the hermes-
format text a Qwen-style model would have generated, then `<|im_end|>`) and one logprob per
token when asked. Streaming is not scripted (400).

`python -m harnessrl.testing.scripted_engine --script FILE --port 0 --ready-file F`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import uvicorn

from harnessrl.testing.stub_engine import SPECIAL, StubEngine, render_chat, toy_tokens

LOGPROB = -0.125  # every generated token's logprob (any value <= 0 does)


class ScriptError(ValueError):
    """The request matches no script (or the script file is malformed)."""


class ScriptedRefusal(Exception):
    """A scripted error answer: HTTP `status` with `message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Script:
    """The script file, re-read when its modification time changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._data: dict[str, Any] = {}

    def data(self) -> dict[str, Any]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return {}
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._data = json.loads(self.path.read_text())
            self._stamp = stamp
        return self._data

    def replies_for(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        data = self.data()
        text = "\n".join(_text(m.get("content")) for m in messages)
        for entry in data.get("scripts", ()):
            if entry["marker"] in text:
                return list(entry["replies"])
        if data.get("default"):
            return list(data["default"])
        raise ScriptError(f"no script of {self.path} matches this conversation")


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def turn_index(messages: list[dict[str, Any]]) -> int:
    """Turns already taken: assistant messages + user messages after the first user message."""
    users = sum(1 for m in messages if m.get("role") == "user")
    return sum(1 for m in messages if m.get("role") == "assistant") + max(0, users - 1)


def _generated_text(content: str, calls: list[dict[str, Any]]) -> str:
    """What a Qwen-style model emits for this message (hermes tool calls)."""
    out = content
    for call in calls:
        fn = call["function"]
        out += ("\n" if out else "") + "<tool_call>\n" + json.dumps(
            {"name": fn["name"], "arguments": json.loads(fn["arguments"])}) + "\n</tool_call>"
    return out


def scripted_chat_response(request: dict[str, Any], script: Script,
                           counter: int) -> dict[str, Any]:
    if request.get("stream"):
        raise ScriptError("the scripted engine does not stream")
    messages = request.get("messages") or []
    replies = script.replies_for(messages)
    if not replies:
        raise ScriptError("the matching script has no replies")
    reply = replies[min(turn_index(messages), len(replies) - 1)]
    if "status" in reply:
        raise ScriptedRefusal(int(reply["status"]), str(reply.get("message", "refused")))
    content = str(reply.get("content", ""))
    commands = reply.get("commands") or ([reply["command"]] if "command" in reply else [])
    calls = [{"id": f"chatcmpl-tool-{counter:06d}{k}", "type": "function",
              "function": {"name": reply.get("tool", "bash"),
                           "arguments": json.dumps({"command": cmd})}}
             for k, cmd in enumerate(commands)]
    completion = toy_tokens(_generated_text(content, calls)) + [SPECIAL["<|im_end|>"]]
    sent = (request.get("kv_transfer_params") or {}).get("prompt_token_ids")
    prompt = sent or toy_tokens(render_chat(messages, request.get("tools"), True))
    message: dict[str, Any] = {"role": "assistant", "content": content or None,
                               "tool_calls": calls}
    logprobs = {"content": [{"token": f"t{t}", "logprob": LOGPROB, "bytes": [],
                             "top_logprobs": []} for t in completion]} \
        if request.get("logprobs") else None
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": logprobs,
                              "finish_reason": "tool_calls" if calls else "stop",
                              "stop_reason": None}
    resp: dict[str, Any] = {
        "id": f"chatcmpl-scripted-{counter}", "object": "chat.completion",
        "created": int(time.time()), "model": request.get("model"), "choices": [choice],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion),
                  "total_tokens": len(prompt) + len(completion)},
        "prompt_logprobs": None}
    if request.get("return_token_ids"):
        resp["prompt_token_ids"] = prompt
        choice["token_ids"] = completion
    return resp


class ScriptedEngine(StubEngine):
    """`StubEngine` with chat completions answered from the script."""

    def __init__(self, model: str, script: Path) -> None:
        super().__init__(model)
        self.script = Script(script)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await super().__call__(scope, receive, send)
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        try:
            self.requests += 1
            status, payload = 200, orjson.dumps(
                scripted_chat_response(orjson.loads(body), self.script, self.requests))
        except ScriptedRefusal as err:
            status = err.status
            payload = orjson.dumps({"error": {"message": str(err), "type": "BadRequestError",
                                              "param": None, "code": status}})
        except Exception as err:  # noqa: BLE001 - answered as vLLM answers a bad request
            status = 400
            payload = orjson.dumps({"error": {"message": f"scripted engine: {err}",
                                              "type": "BadRequestError", "param": None,
                                              "code": 400}})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


async def _serve(port: int, model: str, script: Path, ready_file: str) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(ScriptedEngine(model, script), http="httptools",
                                           lifespan="off", access_log=False,
                                           log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            json.dump({"http_port": sock.getsockname()[1]}, f)
        os.replace(ready_file + ".tmp", ready_file)
    await task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", type=Path, required=True,
                    help="the script file (JSON, see above); may be written after start")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="stub-model")
    ap.add_argument("--ready-file", default="")
    args = ap.parse_args()
    asyncio.run(_serve(args.port, args.model, args.script, args.ready_file))


if __name__ == "__main__":
    main()
