"""Where an authenticated call's server-side time goes, for `bench/_auth_overhead.py`: the parts
of harnessrl's authorization, each timed alone in this process.

- `authorize_interceptor_us`: `harnessrl.authz.Authorize` around a unary handler (the
  interceptor's dispatch, its wrapper and its table check), per call, over the bare handler;
  the peer's identity is handed to it ready-made.
- `authorize_check_us`: the table check alone (`Authorize.check`).
- `auth_context_us`: reading the peer's identity, `context.auth_context()`, which the check
  does on every call, in a real mTLS server of this process (gRPC builds it per call).
- `grpc_alone`: what TLS costs gRPC itself, no harnessrl code on either side: an asyncio
  server of this process answering 100 bytes, called over mTLS and plaintext channels
  (32 in flight, alternating draws): calls/s and CPU µs per call (client and server together),
  and their ratios, as `bench/_auth_overhead.py` gives them for the store.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from harnessrl import identity
from harnessrl.authz import Authorize

METHOD = "/harnessrl.v1.Store/GetRollout"


class _Context:
    """A servicer context whose peer is the controller, known in advance."""

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_common_name": [b"controller"]}

    def invocation_metadata(self) -> tuple[()]:
        return ()


class _Details:
    method = METHOD
    invocation_metadata = ()


async def _per_call_us(n: int, one: Callable[[], Awaitable[Any]]) -> float:
    t = time.perf_counter()
    for _ in range(n):
        await one()
    return (time.perf_counter() - t) * 1e6 / n


async def _interceptor(ca: bytes, n: int) -> dict[str, float]:
    async def bare(request: Any, context: Any) -> bytes:
        return b""

    handler = grpc.unary_unary_rpc_method_handler(bare)
    auth, ctx, details = Authorize(ca), _Context(), _Details()

    async def found(_details: Any) -> Any:
        return handler

    async def through_authorize() -> Any:
        h = await auth.intercept_service(found, details)
        return await h.unary_unary(b"", ctx)

    async def direct() -> Any:
        h = await found(details)
        return await h.unary_unary(b"", ctx)

    await through_authorize()
    with_it = min([await _per_call_us(n, through_authorize) for _ in range(3)])
    without = min([await _per_call_us(n, direct) for _ in range(3)])
    t = time.perf_counter()
    for _ in range(n):
        auth.check(METHOD, ctx, None)
    return {"authorize_interceptor_us": round(with_it - without, 2),
            "authorize_check_us": round((time.perf_counter() - t) * 1e6 / n, 2)}


async def _auth_context(pki_root: Path, n: int) -> float:
    async def probe(request: bytes, context: Any) -> bytes:
        t = time.perf_counter()
        for _ in range(n):
            context.auth_context()
        return str((time.perf_counter() - t) * 1e6 / n).encode()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench", {"AuthContext": grpc.unary_unary_rpc_method_handler(probe)}),))
    store = identity.Identity.from_folder(pki_root / "store")
    port = server.add_secure_port("127.0.0.1:0", identity.server_credentials(store))
    await server.start()
    caller = identity.Identity.from_folder(pki_root / "controller")
    try:
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", caller.channel_credentials(),
                                           options=identity.target_options("store")) as ch:
            return float(await ch.unary_unary("/bench/AuthContext")(b""))
    finally:
        await server.stop(0)


async def _grpc_alone(pki_root: Path, rounds: int, seconds: float) -> dict[str, Any]:
    answer = b"x" * 100

    async def echo(request: bytes, context: Any) -> bytes:
        return answer

    store = identity.Identity.from_folder(pki_root / "store")
    caller = identity.Identity.from_folder(pki_root / "controller")
    servers, calls, channels = [], {}, []
    for arm in ("mtls", "plaintext"):
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
        if arm == "mtls":
            port = server.add_secure_port("127.0.0.1:0", identity.server_credentials(store))
            ch = grpc.aio.secure_channel(f"127.0.0.1:{port}", caller.channel_credentials(),
                                         options=identity.target_options("store"))
        else:
            port = server.add_insecure_port("127.0.0.1:0")
            ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
        channels.append(ch)
        calls[arm] = ch.unary_unary("/bench/Echo")

    async def draw(call: Any, secs: float) -> tuple[float, float]:
        n, end = 0, time.monotonic() + secs

        async def worker() -> None:
            nonlocal n
            while time.monotonic() < end:
                await call(answer)
                n += 1
        cpu, t = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(32)))
        return n / (time.perf_counter() - t), (time.process_time() - cpu) * 1e6 / max(1, n)

    try:
        for call in calls.values():
            await draw(call, min(seconds, 0.3))  # warm-up
        runs: dict[str, list[tuple[float, float]]] = {arm: [] for arm in calls}
        for i in range(rounds):
            for arm in list(calls)[::-1 if i % 2 else 1]:
                runs[arm].append(await draw(calls[arm], seconds))
    finally:
        for ch in channels:
            await ch.close()
        for server in servers:
            await server.stop(0)
    m, p = runs["mtls"], runs["plaintext"]
    return {"ratio": round(statistics.median(a[0] / b[0] for a, b in zip(m, p)), 3),
            "cpu_ratio": round(statistics.median(b[1] / a[1] for a, b in zip(m, p)), 3),
            **{f"{arm}_{what}": round(statistics.median(r[i] for r in rs), 1)
               for arm, rs in runs.items()
               for i, what in enumerate(("calls_per_s", "cpu_us_per_call"))}}


def measure(pki_root: Path, n: int = 20000, rounds: int = 8, seconds: float = 1.0
            ) -> dict[str, Any]:
    async def all_parts() -> dict[str, Any]:
        ca = (pki_root / "store" / "ca.crt").read_bytes()
        return {**await _interceptor(ca, n),
                "auth_context_us": round(await _auth_context(pki_root, n), 2),
                "grpc_alone": await _grpc_alone(pki_root, rounds, seconds)}
    return asyncio.run(all_parts())
