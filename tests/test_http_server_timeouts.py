"""The gateway's HTTP server (services/gateway/http_server.py, a real socket, uvloop as the
gateway runs it) times a connection out at its bounds and not before: idle for
`idle_timeout_s` since its last response, or a request not received within `read_timeout_s`
of its first byte; one timer per connection, which a request only moves
(tests/test_gateway.py checks the same through a gateway process, with 1 s bounds)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import uvloop

from services.gateway.http_server import Headers, serve_http

IDLE, READ = 0.6, 0.4


def _run(test: Callable[[int], Awaitable[None]]) -> None:
    async def go() -> None:
        async def handler(method: str, path: str, headers: Headers, body: bytes | None
                          ) -> tuple[int, bytes]:
            if path == "/slow":
                await asyncio.sleep(READ + IDLE)  # longer than either bound
            return 200, b"{}"

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        server = await serve_http(handler, sock, 1 << 20, idle_timeout_s=IDLE,
                                  read_timeout_s=READ)
        try:
            await test(sock.getsockname()[1])
        finally:
            await server.drain(0)
    uvloop.run(go())


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(length)


def test_a_busy_connection_stays_and_an_idle_one_closes_at_its_bound() -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # requests for 3 idle bounds, each soon after the last answer: never idle that long
        end = time.monotonic() + 3 * IDLE
        while time.monotonic() < end:
            writer.write(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(IDLE / 4)
        # a request answered after longer than both bounds is not cut off
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # then closed once idle
        assert IDLE - 0.05 < time.monotonic() - answered < IDLE + 0.5
        writer.close()
    _run(test)


def test_a_request_dribbled_in_gets_408_at_the_read_bound() -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(IDLE * 0.8)  # idle, nearly to its bound
        started = time.monotonic()
        writer.write(b"POST /a HTTP/1.1\r\nhost: x\r\n")  # its first byte: the read bound
        for _ in range(20):  # a header every 0.05 s, never the end of the head
            writer.write(b"x-dribble: 1\r\n")
            await asyncio.sleep(0.05)
            if reader.at_eof() or len(reader._buffer):  # type: ignore[attr-defined]
                break
        data = await asyncio.wait_for(reader.read(), 5)
        assert data.startswith(b"HTTP/1.1 408"), data
        assert READ - 0.05 < time.monotonic() - started < READ + 0.5
        writer.close()
    _run(test)
