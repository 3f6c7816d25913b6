"""The HTTP data plane: OpenAI-compatible endpoints that forward to vLLM and record each call.

Routes:
- `POST /v1/chat/completions`, `POST /v1/completions` (non-streaming), `GET /v1/models`:
  OpenAI-compatible. The API key is the rollout credential the controller minted.
- `POST /v1/harnessrl/reward` `{"reward": <number>}`: a harness reports its own reward.
- `GET /health`.

Each completion request is forwarded to the rollout's engine with `return_token_ids` and
logprobs requested; the call (prompt and completion token ids, per-token logprobs, policy
version, engine, timings, the request) is recorded in the store *before* the response goes
back to the harness, which gets the response in the normal API shape (the fields the gateway
added are removed unless the harness asked for them itself). Errors use the OpenAI error shape
`{"error": {"message", "type", "code"}}` with 400 (bad request), 401 (key), 404 (unknown
model), 413 (body over `max_body_bytes`), 502 (engine failure), 503 (held past
`hold_timeout_s`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import orjson

from harnessrl.clients import StoreClient
from harnessrl.errors import HarnessRLError, Unauthenticated, Unavailable
from harnessrl.v1 import common_pb2 as c
from services.gateway.config import GatewayConfig
from services.gateway.engines import EngineRegistry, EngineState
from services.gateway.recorder import CallRecorder, HoldTimeout, RecordRejected
from services.gateway.sessions import Session, Sessions
from services.gateway.upstream import ConnectFailed, UpstreamError

log = logging.getLogger("harnessrl.gateway")

Headers = list[tuple[bytes, bytes]]


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.type,
                                       "param": None, "code": self.code}})


def _bad_request(message: str, code: str = "invalid_request") -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", code)


def _from_domain(exc: HarnessRLError) -> HTTPError:
    if isinstance(exc, Unauthenticated):
        return HTTPError(401, str(exc), "authentication_error", "invalid_api_key")
    if isinstance(exc, Unavailable):
        return HTTPError(503, str(exc), "service_unavailable", "unavailable")
    return HTTPError(500, str(exc), "server_error", "internal")


class GatewayApp:
    """The data plane's request handler (served by `http_server`; no framework on the hot
    path): `handle(method, path, headers, body)` -> (status, JSON body)."""

    def __init__(self, cfg: GatewayConfig, registry: EngineRegistry, sessions: Sessions,
                 recorder: CallRecorder, store: StoreClient) -> None:
        self.cfg = cfg
        self.registry = registry
        self.sessions = sessions
        self.recorder = recorder
        self.store = store
        self.routes: dict[tuple[str, str], Callable[[Headers, bytes], Awaitable[Any]]] = {
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/v1/completions"): self.completions,
            ("GET", "/v1/models"): self.list_models,
            ("POST", "/v1/harnessrl/reward"): self.report_reward,
            ("GET", "/health"): self.health,
        }

    async def handle(self, method: str, path: str, headers: Headers, body: bytes | None
                     ) -> tuple[int, bytes]:
        """`body` is None when it was over `max_body_bytes`."""
        try:
            handler = self.routes.get((method, path))
            if handler is None:
                if any(p == path for _, p in self.routes):
                    raise HTTPError(405, f"method {method} not allowed", "invalid_request_error")
                raise HTTPError(404, f"no route {path}", "invalid_request_error", "not_found")
            if body is None:
                raise HTTPError(413, f"request body over the {self.cfg.max_body_bytes}-byte "
                                "limit", "invalid_request_error", "body_too_large")
            result = await handler(headers, body)
            return result if isinstance(result, tuple) else (200, result)
        except HTTPError as err:
            return err.status, err.body()
        except HarnessRLError as err:
            http_err = _from_domain(err)
            return http_err.status, http_err.body()
        except Exception as err:  # noqa: BLE001 - reported to the harness, logged here
            log.exception("request failed")
            return 500, HTTPError(500, f"gateway error: {type(err).__name__}: {err}",
                                  "server_error").body()

    async def _auth(self, headers: Headers) -> Session:
        authorization = api_key = None
        for name, value in headers:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-api-key":
                api_key = value.decode("latin-1")
        return await self.sessions.authenticate(authorization, api_key)

    # routes ---------------------------------------------------------------------------------
    async def health(self, headers: Headers, body: bytes) -> bytes:
        return b'{"status":"ok"}'

    async def list_models(self, headers: Headers, body: bytes) -> bytes:
        await self._auth(headers)
        now = int(time.time())
        return orjson.dumps({"object": "list", "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "harnessrl"}
            for m in self.registry.models()]})

    async def report_reward(self, headers: Headers, body: bytes) -> bytes:
        session = await self._auth(headers)
        data = _parse_json(body)
        reward = data.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or \
                not math.isfinite(reward):
            raise _bad_request("'reward' must be a finite number")
        try:
            await self.store.report_reward(session.cred.rollout_id, session.cred.attempt,
                                           float(reward))
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise HTTPError(409, err.details() or "attempt not running",
                                "invalid_request_error", "conflict") from err
            raise Unavailable(f"store: {err.details()}") from err
        return b'{"ok":true}'

    async def chat_completions(self, headers: Headers, body: bytes) -> tuple[int, bytes]:
        return await self._complete(headers, body, "chat.completions")

    async def completions(self, headers: Headers, body: bytes) -> tuple[int, bytes]:
        return await self._complete(headers, body, "completions")

    # the recorded round trip ----------------------------------------------------------------
    async def _complete(self, headers: Headers, body: bytes, api: str) -> tuple[int, bytes]:
        session = await self._auth(headers)
        request = _parse_json(body)
        model = request.get("model")
        if not isinstance(model, str) or not model:
            raise _bad_request("'model' is required", "missing_model")
        if model not in self.registry.models():
            raise HTTPError(404, f"the model {model!r} does not exist; served: "
                                 f"{self.registry.models()}", "invalid_request_error",
                            "model_not_found")
        if request.get("stream"):
            raise _bad_request("stream=true is not supported by this gateway yet",
                               "unsupported_stream")
        if request.get("n", 1) not in (1, None):
            raise _bad_request("n > 1 is not supported: the controller samples groups",
                               "unsupported_n")
        if api == "chat.completions" and not isinstance(request.get("messages"), list):
            raise _bad_request("'messages' must be a list", "invalid_messages")
        if api == "completions" and "prompt" not in request:
            raise _bad_request("'prompt' is required", "missing_prompt")

        wants_logprobs = request.get("logprobs")
        wants_ids = request.get("return_token_ids")
        forward = dict(request)
        forward["return_token_ids"] = True
        if api == "chat.completions":
            forward["logprobs"] = True
        elif not isinstance(wants_logprobs, int) or isinstance(wants_logprobs, bool):
            forward["logprobs"] = 0  # the sampled token's logprob only

        rollout_id = session.cred.rollout_id
        deadline = time.monotonic() + self.cfg.hold_timeout_s
        started = time.time()
        while True:
            engine = await self.registry.acquire(rollout_id, model, deadline)
            # The version when generation starts: a call that spans a weight push (engine
            # paused with mode=keep) is attributed to the older policy, so staleness is never
            # under-counted.
            version = engine.policy_version
            forward["model"] = engine.model or model
            t0 = time.perf_counter()
            served = False
            try:
                status, response = await self._forward(engine, api, forward)
                served = status == 200
            except ConnectFailed as err:
                self.registry.mark_unreachable(engine, str(err))
                continue  # nothing was generated: try another engine (or wait for one)
            finally:
                self.registry.release(engine, served)
            break
        latency = time.perf_counter() - t0
        if status != 200:
            return status, response if isinstance(response, bytes) else orjson.dumps(response)

        call = _call_from_response(api, request, response, body)
        call.rollout_id = rollout_id
        call.attempt = session.cred.attempt
        call.policy_version = version
        call.engine = engine.name
        call.started_at = started
        call.latency_s = latency
        call.seq = session.take_seq()
        try:
            await self.recorder.record(call)
        except RecordRejected as err:
            self.sessions.close(session, f"rollout {rollout_id} attempt {call.attempt}: {err}")
            raise HTTPError(401, f"call not recorded: {err}", "authentication_error",
                            "rollout_closed") from err
        except HoldTimeout as err:
            raise HTTPError(503, str(err), "service_unavailable", "store_unavailable") from err

        if not wants_ids:
            response.pop("prompt_token_ids", None)
        for choice in response.get("choices", ()):
            if not wants_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            if not wants_logprobs:
                choice["logprobs"] = None
        return 200, orjson.dumps(response)

    async def _forward(self, engine: EngineState, api: str, forward: dict[str, Any]
                       ) -> tuple[int, Any]:
        path = "/v1/chat/completions" if api == "chat.completions" else "/v1/completions"
        try:
            status, raw = await engine.pool.post(path, orjson.dumps(forward),
                                                 self.cfg.request_timeout_s)
            if status != 200:
                return status, raw
            return 200, orjson.loads(raw)
        except ConnectFailed:
            raise
        except (UpstreamError, asyncio.TimeoutError, orjson.JSONDecodeError) as err:
            raise HTTPError(502, f"engine {engine.name} failed: {type(err).__name__}: {err}",
                            "server_error", "engine_error") from err


def _parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise _bad_request(f"malformed JSON body: {err}", "invalid_json") from err
    if not isinstance(data, dict):
        raise _bad_request("the JSON body must be an object", "invalid_json")
    return data


def _call_from_response(api: str, request: dict[str, Any], response: dict[str, Any],
                        body: bytes) -> c.Call:
    """The recorded call from the engine's response (choice 0)."""
    try:
        choice = response["choices"][0]
        completion_ids = choice["token_ids"]
        if api == "chat.completions":
            prompt_ids = response["prompt_token_ids"]
            entries = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [e["logprob"] for e in entries]
            message = choice.get("message") or {}
            text = message.get("content") or ""
            returned = orjson.dumps(message)
        else:
            prompt_ids = choice["prompt_token_ids"]
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            text = choice.get("text") or ""
            returned = orjson.dumps(text)
    except (KeyError, IndexError, TypeError) as err:
        raise HTTPError(502, f"engine response lacks token ids or logprobs ({err!r}); the "
                             "engine must be vLLM with return_token_ids support",
                        "server_error", "engine_error") from err
    if prompt_ids is None or completion_ids is None or len(logprobs) != len(completion_ids):
        raise HTTPError(502, f"engine returned {len(logprobs)} logprobs for "
                             f"{len(completion_ids or [])} tokens", "server_error", "engine_error")
    return c.Call(api=api, model=str(request.get("model", "")), prompt_token_ids=prompt_ids,
                  completion_token_ids=completion_ids,
                  logprobs=[lp if lp is not None else -math.inf for lp in logprobs],
                  finish_reason=choice.get("finish_reason") or "", request_json=body,
                  completion_text=text, response_message_json=returned)
