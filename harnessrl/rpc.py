"""Shared gRPC wiring: message limits, keepalive, health, reflection, error mapping, shutdown.

Every service builds its server with `start_server` (asyncio) and so serves
`grpc.health.v1.Health` and server reflection (grpcurl works against it), maps domain errors
(`harnessrl.errors`) to explicit status codes via `@map_errors`, and stops gracefully on
SIGTERM/SIGINT via `wait_for_termination`.

Health is honest: a service passes `ready` (an async check answering whether it can do its
job now, and why not) to `start_server`, which runs it every `ready_interval_s` and sets every
service of the server, and the overall status "", SERVING or NOT_SERVING accordingly (readiness
probes use it); the service name `liveness` stays SERVING while the process answers at all
(liveness probes use it).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from harnessrl import identity
from harnessrl.authz import Authorize
from harnessrl.errors import HarnessRLError

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Health service name that answers SERVING while the process serves at all: liveness probes
# ask for it (a service that cannot do its job should not be restarted for it), readiness
# probes ask for the overall status "".
LIVENESS_SERVICE = "liveness"
KEEPALIVE_TIME_MS = 30_000


def grpc_options(keepalive_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, Any]]:
    """Channel and server arguments for every harnessrl process: message limits, and
    keepalive pings every `keepalive_time_ms` that the peer accepts. Servers must allow pings
    that often: gRPC's default (one ping per 5 minutes without data) answers more frequent
    pings with GOAWAY "too_many_pings" and drops the connection, e.g. the gateway's idle
    RecordCalls stream."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_time_ms // 2),
    ]


OPTIONS = grpc_options()
# Every harnessrl write is idempotent, so clients may retry any RPC that found no server.
_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": "harnessrl.v1.Store"}, {"service": "harnessrl.v1.Controller"},
                 {"service": "harnessrl.v1.GatewayAdmin"}, {"service": "harnessrl.v1.Trainer"}],
        "retryPolicy": {
            "maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "2s",
            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]
})
# A peer that restarts is found again within 5 s: gRPC's default reconnect backoff grows to
# 120 s, so after a long store outage the gateway's held calls could time out (503) while the
# store was already back.
CLIENT_OPTIONS = OPTIONS + [("grpc.service_config", _SERVICE_CONFIG), ("grpc.enable_retries", 1),
                            ("grpc.max_reconnect_backoff_ms", 5_000)]


OWN = identity.Identity(b"", b"", b"")  # "this process's identity": identity.resolve()


def _credentials(address: str, peer: str, ident: identity.Identity | None
                 ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    if ident is OWN:
        ident = identity.resolve()
    if ident is None:
        identity.insecure_address(address, f"channel to the {peer} at")
        return None, CLIENT_OPTIONS
    return ident.channel_credentials(), CLIENT_OPTIONS + identity.target_options(peer)


def channel(address: str, peer: str, ident: identity.Identity | None = OWN) -> grpc.Channel:
    """A blocking mTLS channel to the service `peer` (store, controller, gateway, trainer; TLS
    checks the server is that identity) as `ident` (default: this process's identity,
    harnessrl/identity.py; None: plaintext, loopback only), with the project's limits and
    retry policy."""
    creds, options = _credentials(address, peer, ident)
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds, options=options)


def aio_channel(address: str, peer: str, ident: identity.Identity | None = OWN,
                extra_options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """An asyncio channel, as `channel`."""
    creds, options = _credentials(address, peer, ident)
    options = options + (extra_options or [])
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)


F = TypeVar("F", bound=Callable[..., Any])
Readiness = Callable[[], Awaitable[tuple[bool, str]]]


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, HarnessRLError):
        return exc.code, str(exc)
    log.exception("unexpected error in RPC", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _wrap(fn: F) -> F:
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def agen(self: Any, request: Any, context: Any) -> Any:
            try:
                async for item in fn(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                code, msg = _status_for(exc)
                await context.abort(code, msg)
        return agen  # type: ignore[return-value]

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def coro(self: Any, request: Any, context: Any) -> Any:
            try:
                return await fn(self, request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                code, msg = _status_for(exc)
                await context.abort(code, msg)
        return coro  # type: ignore[return-value]

    @functools.wraps(fn)
    def sync(self: Any, request: Any, context: Any) -> Any:
        try:
            return fn(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            if type(exc).__name__ == "_AbortError" or isinstance(exc, grpc.RpcError):
                raise
            code, msg = _status_for(exc)
            context.abort(code, msg)
    return sync  # type: ignore[return-value]


C = TypeVar("C", bound=type)


def map_errors(cls: C) -> C:
    """Class decorator for servicers: every public method (an RPC) maps `HarnessRLError` to its
    status code and anything else to INTERNAL with the message (never UNKNOWN)."""
    for name, fn in list(vars(cls).items()):
        if not name.startswith("_") and callable(fn):
            setattr(cls, name, _wrap(fn))
    return cls


class _Undecodable:
    """A request whose bytes are no valid message of its type."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class _RefuseUndecodable(grpc.aio.ServerInterceptor):
    """Requests that do not parse get INVALID_ARGUMENT (gRPC itself would answer UNKNOWN)."""

    def __init__(self) -> None:
        # method -> (the handler it wrapped, the wrapper): built once per method, not per call
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        cached = self._wrapped.get(details.method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[details.method] = (handler, self._wrap(handler))
        return cached[1]

    @staticmethod
    def _wrap(handler: Any) -> Any:
        decode = handler.request_deserializer

        def lenient(data: bytes) -> Any:
            try:
                return decode(data)
            except Exception as exc:  # noqa: BLE001 - answered INVALID_ARGUMENT
                return _Undecodable(exc)

        async def refuse(context: Any, bad: _Undecodable) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request does not parse: {bad.error}")

        async def checked(requests: Any, context: Any) -> Any:
            async for r in requests:
                if isinstance(r, _Undecodable):
                    await refuse(context, r)
                yield r

        kw = {"request_deserializer": lenient,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def uu(request: Any, context: Any) -> Any:
                if isinstance(request, _Undecodable):
                    await refuse(context, request)
                return await inner_uu(request, context)
            return grpc.unary_unary_rpc_method_handler(uu, **kw)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def us(request: Any, context: Any) -> Any:
                if isinstance(request, _Undecodable):
                    await refuse(context, request)
                async for item in inner_us(request, context):
                    yield item
            return grpc.unary_stream_rpc_method_handler(us, **kw)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def su(requests: Any, context: Any) -> Any:
                return await inner_su(checked(requests, context), context)
            return grpc.stream_unary_rpc_method_handler(su, **kw)
        inner_ss = handler.stream_stream

        async def ss(requests: Any, context: Any) -> Any:
            async for item in inner_ss(checked(requests, context), context):
                yield item
        return grpc.stream_stream_rpc_method_handler(ss, **kw)


async def start_server(
    bind: str,
    services: Iterable[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    ready: Readiness | None = None,
    ready_interval_s: float = 1.0,
    ident: identity.Identity | None = OWN,
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Starts an asyncio gRPC server on `bind` ("host:port"; port 0 picks a free one).

    It serves mTLS as `ident` (default: this process's identity, harnessrl/identity.py) and
    authorizes every call by harnessrl/authz.py's table; `ident` None (explicit insecure
    mode) serves plaintext on loopback only, with no authorization.

    `services` holds (add_XServicer_to_server, servicer, full service name) triples. Health
    (SERVING for each service and overall; with `ready`, whatever it answers, checked every
    `ready_interval_s`) and reflection are added. Returns the server, the bound port and the
    health servicer.
    """
    if ident is OWN:
        ident = identity.resolve()
    interceptors: list[grpc.aio.ServerInterceptor] = [_RefuseUndecodable()]
    if ident is not None:
        interceptors.insert(0, Authorize(
            ident.ca, ident.folder / "ca.crt" if ident.folder is not None else None))
    server = grpc.aio.server(options=OPTIONS, interceptors=interceptors)
    health = health_aio.HealthServicer()
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME]
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(names, server)
    if ident is None:
        try:
            identity.insecure_address(bind, "gRPC server on")
        except identity.NoIdentity as exc:
            raise SystemExit(str(exc)) from None
        port = server.add_insecure_port(bind)
    else:
        port = server.add_secure_port(bind, identity.server_credentials(ident))
        log.info("gRPC on %s: mTLS as %r, calls authorized by harnessrl/authz.py", bind,
                 ident.name)
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {bind}")
    await server.start()
    for name in names:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    if ready is not None:
        serving = await _apply_readiness(health, names, ready, None)
        task = asyncio.create_task(_watch_readiness(health, names, ready, ready_interval_s,
                                                    serving))
        _WATCHERS.add(task)
        task.add_done_callback(_WATCHERS.discard)
    return server, port, health


_WATCHERS: set[asyncio.Task[None]] = set()


async def _apply_readiness(health: health_aio.HealthServicer, names: list[str],
                           ready: Readiness, serving: bool | None) -> bool:
    """Runs `ready` once and sets the health status of every service when it changed."""
    try:
        ok, why = await ready()
    except Exception as exc:  # noqa: BLE001 - a failing check means not ready
        ok, why = False, f"readiness check failed: {type(exc).__name__}: {exc}"
    if ok != serving:
        status = health_pb2.HealthCheckResponse.SERVING if ok else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in [*names, ""]:
            await health.set(name, status)
        if ok:
            log.info("health: SERVING")
        else:
            log.warning("health: NOT_SERVING (%s)", why)
    return ok


async def _watch_readiness(health: health_aio.HealthServicer, names: list[str],
                           ready: Readiness, interval_s: float, serving: bool) -> None:
    while True:
        await asyncio.sleep(interval_s)
        serving = await _apply_readiness(health, names, ready, serving)


async def peer_serving(ch: grpc.aio.Channel, timeout: float = 2.0) -> tuple[bool, str]:
    """Whether the server behind `ch` answers SERVING to a health check (and why not)."""
    try:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=timeout)
    except grpc.aio.AioRpcError as err:
        return False, f"{err.code().name}: {err.details()}"
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return False, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return True, ""


async def wait_for_termination(
    server: grpc.aio.Server, grace_s: float = 5.0, on_stop: Callable[[], Any] | None = None
) -> None:
    """Serves until SIGTERM/SIGINT, then runs `on_stop` and stops with a grace period."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping")
    if on_stop is not None:
        result = on_stop()
        if inspect.isawaitable(result):
            await result
    await server.stop(grace_s)
    waiter.cancel()
    stopper.cancel()


def write_ready_file(path: str | os.PathLike[str] | None, **info: Any) -> None:
    """Atomically writes `info` (ports, pid) as JSON to `path` once a service is serving, so
    launchers and tests can start services on port 0 and learn the ports."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
    tmp.replace(p)


def health_check(address: str, service: str = "", timeout: float = 2.0, peer: str = "",
                 ident: identity.Identity | None = OWN) -> bool:
    """True when the server at `address`, the service `peer` (default: this process's own
    identity, as a container's probe checks its own service), answers SERVING for
    `service`."""
    if ident is OWN:
        ident = identity.resolve()
    with channel(address, peer or (ident.name if ident else "any"), ident) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING
