"""The gateway with another HTTP server or engine client, for `bench/gateway_overhead.py`.

The gateway serves its data plane with its own httptools server (`http_server.py`) and calls
engines with its own pooled client (`upstream.py`). To decide that with numbers, the benchmark
runs the very same gateway (same `GatewayApp`, recorder, store) with one part swapped:

- `--http-server uvicorn`: uvicorn (httptools parser, uvloop) serving a raw ASGI adapter of
  `GatewayApp.handle` (no framework);
- `--http-server granian`: granian (Rust, hyper) serving the same ASGI adapter, embedded in the
  gateway's event loop (`granian.server.embed`);
- `--engine-client httpx`: `httpx.AsyncClient` (one per engine, keep-alive pool);
- `--engine-client aiohttp`: `aiohttp.ClientSession` (one per engine, keep-alive pool).

`python bench/_gateway_variants.py --http-server uvicorn --engine-client builtin <gateway flags>`
(by its path: `bench` is not an installed package)
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.gateway import engines as gw_engines  # noqa: E402
from services.gateway import server as gw_server  # noqa: E402
from services.gateway.upstream import ConnectFailed, UpstreamError  # noqa: E402


# --- the data plane as a raw ASGI app --------------------------------------------------------
class ASGIAdapter:
    """`GatewayApp.handle` as an ASGI application (http scope only)."""

    def __init__(self, handler: Any, max_body_bytes: int) -> None:
        self.handler, self.max_body = handler, max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body: list[bytes] = []
        size, more = 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            piece = msg.get("body", b"")
            size += len(piece)
            if size <= self.max_body:
                body.append(piece)
            more = msg.get("more_body", False)
        headers = [(n.lower(), v) for n, v in scope["headers"]]
        status, payload = await self.handler(scope["method"], scope["path"], headers,
                                             b"".join(body) if size <= self.max_body else None)
        if isinstance(payload, bytes):
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        try:
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"text/event-stream"),
                                    (b"cache-control", b"no-cache")]})
            async for piece in payload:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await payload.aclose()


def uvicorn_server(handler: Any, sock: socket.socket, max_body_bytes: int,
                   idle_timeout_s: float = 75.0, read_timeout_s: float = 30.0) -> Any:
    import uvicorn

    config = uvicorn.Config(ASGIAdapter(handler, max_body_bytes), http="httptools",
                            loop="none", lifespan="off", access_log=False, log_level="warning",
                            timeout_keep_alive=int(idle_timeout_s), backlog=2048)
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))

    class Handle:
        def close(self) -> None:
            server.should_exit = True
            task.cancel()
    return Handle()


def granian_server(handler: Any, sock: socket.socket, max_body_bytes: int,
                   idle_timeout_s: float = 75.0, read_timeout_s: float = 30.0) -> Any:
    from granian.constants import Interfaces
    from granian.http import HTTP1Settings
    from granian.server.embed import Server

    host, port = sock.getsockname()[:2]
    sock.close()  # granian binds its own socket
    server = Server(ASGIAdapter(handler, max_body_bytes), address=host, port=port,
                    interface=Interfaces.ASGI, http1_settings=HTTP1Settings(
                        keep_alive=True, header_read_timeout=int(read_timeout_s * 1000)),
                    log_enabled=False, backlog=2048)
    task = asyncio.get_running_loop().create_task(server.serve())

    class Handle:
        def close(self) -> None:
            server.stop()
            task.cancel()
    return Handle()


async def _as_server(make: Any, *args: Any) -> Any:
    handle = make(*args)
    await asyncio.sleep(0.5)  # the server binds and starts accepting

    async def drain(grace_s: float) -> int:  # the gateway's shutdown: these arms stop at once
        handle.close()
        return 0
    handle.drain = drain
    return handle


# --- engine clients with UpstreamPool's interface -----------------------------------------------
class _Stream:
    def __init__(self, status: int, chunks: Any, closer: Any) -> None:
        self.status, self._chunks, self._closer = status, chunks, closer
        self.done = False

    async def read(self) -> bytes | None:
        if self.done:
            return None
        try:
            piece = await self._chunks.__anext__()
        except StopAsyncIteration:
            self.close()
            return None
        except Exception as err:
            self.close()
            raise UpstreamError(f"engine stream broke: {err!r}") from err
        return piece

    async def read_all(self) -> bytes:
        out = []
        while (piece := await self.read()) is not None:
            out.append(piece)
        return b"".join(out)

    def close(self) -> None:
        if not self.done:
            self.done = True
            asyncio.get_running_loop().create_task(self._closer())


class HttpxPool:
    def __init__(self, base_url: str, idle_timeout_s: float = 30.0, ssl_context: Any = None
                 ) -> None:
        import httpx

        self.httpx = httpx
        self.client = httpx.AsyncClient(
            base_url=base_url, limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=256,
                                                   keepalive_expiry=idle_timeout_s))
        self.headers = {"content-type": "application/json"}

    async def post(self, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        try:
            r = await self.client.post(path, content=body, headers=self.headers,
                                       timeout=timeout)
        except self.httpx.ConnectError as err:
            raise ConnectFailed(str(err)) from err
        except self.httpx.HTTPError as err:
            raise UpstreamError(repr(err)) from err
        return r.status_code, r.content

    async def stream(self, path: str, body: bytes, timeout: float) -> _Stream:
        req = self.client.build_request("POST", path, content=body, headers=self.headers,
                                        timeout=timeout)
        try:
            r = await self.client.send(req, stream=True)
        except self.httpx.ConnectError as err:
            raise ConnectFailed(str(err)) from err
        except self.httpx.HTTPError as err:
            raise UpstreamError(repr(err)) from err
        return _Stream(r.status_code, r.aiter_raw(), r.aclose)

    def close(self) -> None:
        pass


class AiohttpPool:
    def __init__(self, base_url: str, idle_timeout_s: float = 30.0, ssl_context: Any = None
                 ) -> None:
        import aiohttp

        self.aiohttp = aiohttp
        self.base_url = base_url.rstrip("/")
        self.session: Any = None
        self.idle_timeout_s = idle_timeout_s
        self.headers = {"content-type": "application/json"}

    def _session(self) -> Any:
        if self.session is None:
            self.session = self.aiohttp.ClientSession(connector=self.aiohttp.TCPConnector(
                limit=0, keepalive_timeout=self.idle_timeout_s), auto_decompress=False)
        return self.session

    async def post(self, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        try:
            async with self._session().post(self.base_url + path, data=body,
                                            headers=self.headers,
                                            timeout=self.aiohttp.ClientTimeout(total=timeout)
                                            ) as r:
                return r.status, await r.read()
        except self.aiohttp.ClientConnectorError as err:
            raise ConnectFailed(str(err)) from err
        except self.aiohttp.ClientError as err:
            raise UpstreamError(repr(err)) from err

    async def stream(self, path: str, body: bytes, timeout: float) -> _Stream:
        try:
            r = await self._session().post(self.base_url + path, data=body,
                                           headers=self.headers,
                                           timeout=self.aiohttp.ClientTimeout(total=timeout))
        except self.aiohttp.ClientConnectorError as err:
            raise ConnectFailed(str(err)) from err
        except self.aiohttp.ClientError as err:
            raise UpstreamError(repr(err)) from err

        async def chunks() -> Any:
            async for piece in r.content.iter_any():
                yield piece

        async def closer() -> None:
            r.release()
        return _Stream(r.status, chunks(), closer)

    def close(self) -> None:
        pass


SERVERS = {"uvicorn": uvicorn_server, "granian": granian_server}
CLIENTS = {"httpx": HttpxPool, "aiohttp": AiohttpPool}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--http-server", choices=["builtin", *SERVERS], default="builtin")
    ap.add_argument("--engine-client", choices=["builtin", *CLIENTS], default="builtin")
    args, rest = ap.parse_known_args()
    if args.http_server != "builtin":
        make = SERVERS[args.http_server]

        async def serve_http(*a: Any) -> Any:
            return await _as_server(make, *a)
        gw_server.serve_http = serve_http  # type: ignore[assignment]
    if args.engine_client != "builtin":
        gw_engines.UpstreamPool = CLIENTS[args.engine_client]  # type: ignore[assignment,misc]
    sys.argv = [sys.argv[0], *rest]
    from services.gateway.__main__ import main as gateway_main

    gateway_main()


if __name__ == "__main__":
    main()
