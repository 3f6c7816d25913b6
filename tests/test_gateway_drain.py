"""A stopping gateway's HTTP server (services/gateway/http_server.py, served on a real socket):
a response whose handler was running when the drain began says `connection: close`, the
requests pipelined behind it are answered in order, the last with `connection: close`, and
nothing sent after that is read."""

from __future__ import annotations

import asyncio
import socket

from services.gateway.http_server import Headers, HttpServer, serve_http


async def _server(delay_s: float) -> tuple[HttpServer, int, list[str]]:
    seen: list[str] = []

    async def handler(method: str, path: str, headers: Headers, body: bytes | None
                      ) -> tuple[int, bytes]:
        seen.append(path)
        if path == "/slow":
            await asyncio.sleep(delay_s)
        return 200, b'{"path": "%s"}' % path.encode()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = await serve_http(handler, sock, max_body_bytes=1 << 20)
    return server, sock.getsockname()[1], seen


def _get(path: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path.encode()


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), 10)  # until the server closes


def _responses(raw: bytes) -> list[tuple[bytes, bool]]:
    """(body, says connection: close) of each response in `raw`."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                          if ln.lower().startswith(b"content-length")))
        out.append((rest[:length], b"connection: close" in head.lower()))
        raw = rest[length:]
    return out


def test_a_response_in_flight_when_the_drain_begins_says_close() -> None:
    async def go() -> None:
        server, port, _ = await _server(0.5)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get("/slow"))
        await writer.drain()
        await asyncio.sleep(0.1)  # the handler is running
        drained = asyncio.create_task(server.drain(10))
        got = _responses(await _read_all(reader))
        assert got == [(b'{"path": "/slow"}', True)], got
        assert await drained == 0  # nothing cut
        writer.close()
    asyncio.run(go())


def test_pipelined_requests_are_answered_and_the_last_says_close() -> None:
    async def go() -> None:
        server, port, seen = await _server(0.5)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get("/slow") + _get("/a") + _get("/b"))
        await writer.drain()
        await asyncio.sleep(0.1)
        drained = asyncio.create_task(server.drain(10))
        await asyncio.sleep(0.1)
        writer.write(_get("/after"))  # sent once the drain began: not read
        got = _responses(await _read_all(reader))
        assert got == [(b'{"path": "/slow"}', False), (b'{"path": "/a"}', False),
                       (b'{"path": "/b"}', True)], got
        assert seen == ["/slow", "/a", "/b"]
        assert await drained == 0
        writer.close()
    asyncio.run(go())


def test_an_idle_connection_closes_at_once() -> None:
    async def go() -> None:
        server, port, _ = await _server(0.0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get("/a"))
        await writer.drain()
        assert b'{"path": "/a"}' in await asyncio.wait_for(reader.readuntil(b'"/a"}'), 5)
        assert await server.drain(10) == 0
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    asyncio.run(go())
