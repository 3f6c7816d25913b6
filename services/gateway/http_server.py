"""A lean HTTP/1.1 server for the gateway's data plane (httptools parser, asyncio protocol).

The gateway answers small JSON requests, each a round trip to an engine and the store; per
request, a general ASGI server (uvicorn) costs about as much CPU as the gateway's own work.
This server does only what the data plane needs: keep-alive HTTP/1.1, Content-Length or
chunked request bodies (bounded by `max_body_bytes`), pipelined requests answered in order, and
one write per response. Draining (`HttpServer.drain`, a stopping gateway) answers what each
connection has received, the last response with `connection: close`, and reads nothing more. A client that disconnects cancels its request (nothing is recorded
for a response nobody received). Handlers are `async (method, path, headers, body) -> (status,
body)`, headers a list of (lower-case name, value) byte pairs. A body is bytes (sent whole,
JSON; a `TextBody` for another content type) or a `StreamBody`: server-sent events, sent chunked piece by piece as the handler yields
them (each piece written at once, waiting only while the client's socket buffer is full); its
`aclose()` is always awaited, also when the client went away mid-stream.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import httptools

log = logging.getLogger("harnessrl.gateway.http")

Headers = list[tuple[bytes, bytes]]


class StreamBody(Protocol):
    """A streamed response body: the pieces to send, then `aclose()` (always called)."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


Handler = Callable[[str, str, Headers, bytes | None],
                   Awaitable[tuple[int, "bytes | StreamBody"]]]

_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found",
            408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            405: b"Method Not Allowed", 409: b"Conflict", 413: b"Payload Too Large",
            500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable"}


class TextBody(bytes):
    """A whole response body of another content type than JSON (e.g. /metrics)."""

    content_type: bytes

    def __new__(cls, data: bytes, content_type: str) -> "TextBody":
        self = super().__new__(cls, data)
        self.content_type = content_type.encode("latin-1")
        return self


def _response(status: int, body: bytes, keep_alive: bool,
              content_type: bytes = b"application/json") -> bytes:
    return b"".join((
        b"HTTP/1.1 ", str(status).encode(), b" ", _REASONS.get(status, b"Status"),
        b"\r\ncontent-type: ", content_type, b"\r\ncontent-length: ", str(len(body)).encode(),
        b"" if keep_alive else b"\r\nconnection: close", b"\r\n\r\n", body))


def _stream_head(status: int, keep_alive: bool) -> bytes:
    return b"".join((
        b"HTTP/1.1 ", str(status).encode(), b" ", _REASONS.get(status, b"Status"),
        b"\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked", b"" if keep_alive else b"\r\nconnection: close",
        b"\r\n\r\n"))


MAX_HEAD_BYTES = 64 * 1024  # request line and headers, together
LINGER_S = 2.0  # a drained connection's close: how long what the client still sends is read


class _HeadTooLarge(Exception):
    pass


class _Connection(asyncio.Protocol):
    def __init__(self, handler: Handler, max_body_bytes: int, idle_timeout_s: float,
                 read_timeout_s: float, live: set["_Connection"],
                 max_head_bytes: int = MAX_HEAD_BYTES) -> None:
        self.handler = handler
        self.live = live  # the server's open connections (HttpServer.drain)
        self.draining = False  # answer what is asked, then close
        self.max_body = max_body_bytes
        self.max_head = max_head_bytes
        self._head_size = 0
        self.idle_timeout_s = idle_timeout_s
        self.read_timeout_s = read_timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._fires = 0.0  # when `_timer` fires (loop time)
        self._deadline: float | None = None  # when the connection times out (None: never)
        self._reading = False  # a request has begun and is not complete yet
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[tuple[str, str, Headers, bytes | None, bool]] = deque()
        self.worker: asyncio.Task[None] | None = None
        self._url = b""
        self._headers: Headers = []
        self._body: list[bytes] = []
        self._size = 0
        self._writable: asyncio.Event | None = None  # set while the socket buffer has room
        self._discard = False  # closing after its last response: what comes is dropped

    # asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()
        self.live.add(self)
        self._arm(self.idle_timeout_s)

    # timeouts: an idle keep-alive connection, or a request whose head and body do not arrive
    # within `read_timeout_s` of its first byte (a client dribbling its headers), is closed.
    # A request only moves the deadline: the one timer is set when none would fire by then,
    # and when it fires before the deadline it waits on for the rest (a timer set and
    # cancelled at each request's start and end cost the gateway some 4 us a request).
    def _arm(self, seconds: float) -> None:
        if seconds <= 0:
            self._deadline = None
            return
        deadline = self._deadline = self.loop.time() + seconds
        if self._timer is None or self._fires > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._fires = self.loop.call_at(deadline, self._tick), deadline

    def _tick(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None:  # the request is being answered
            return
        if self.loop.time() < deadline - 0.001:  # (the loop's timers have 1 ms steps)
            self._timer, self._fires = self.loop.call_at(deadline, self._tick), deadline
            return
        self._deadline = None
        self._timed_out()

    def _timed_out(self) -> None:
        if self._reading:
            self._reject(408, b'{"error": {"message": "request not received in time"}}')
        elif self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing() or self._discard:
            return  # rejected, or closing: the rest is not read
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, b'{"error": {"message": "protocol upgrade not supported"}}')
        except httptools.HttpParserError as err:
            if isinstance(err.__context__, _HeadTooLarge):
                self._reject(431, b'{"error": {"message": "request line and headers over %d '
                                  b'bytes"}}' % self.max_head)
                return
            msg = str(err).replace('"', "'")
            self._reject(400, b'{"error": {"message": "malformed HTTP request: %s"}}'
                         % msg.encode())

    def connection_lost(self, exc: Exception | None) -> None:
        self.live.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if self.worker is not None:
            self.worker.cancel()
        self.queue.clear()
        if self._writable is not None:
            self._writable.set()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.Event()
        self._writable.clear()

    def resume_writing(self) -> None:
        if self._writable is not None:
            self._writable.set()

    # httptools callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", [], [], 0
        self._head_size = 0
        self._reading = True
        self._arm(self.read_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._count_head(len(name) + len(value) + 4)

    def _count_head(self, n: int) -> None:
        self._head_size += n
        if self._head_size > self.max_head:
            raise _HeadTooLarge  # ends feed_data: answered 431 there

    def on_headers_complete(self) -> None:
        if (b"expect", b"100-continue") not in [(n, v.lower()) for n, v in self._headers
                                                 if n == b"expect"]:
            return
        length = next((v for n, v in self._headers if n == b"content-length"), b"")
        if length.isdigit() and int(length) > self.max_body:
            self._reject(413, b'{"error": {"message": "request body over the size limit", '
                              b'"code": "body_too_large"}}')
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size <= self.max_body:
            self._body.append(body)
        else:
            self._body = []  # too large: keep parsing to the end, answer 413

    def on_message_complete(self) -> None:
        self._reading = False
        self._deadline = None  # no timeout while the request is answered
        path = self._url.split(b"?", 1)[0].decode("latin-1")
        body = b"".join(self._body) if self._size <= self.max_body else None
        self.queue.append((self.parser.get_method().decode("latin-1"), path, self._headers,
                           body, self.parser.should_keep_alive()))
        if self.draining and self.transport is not None:
            self.transport.pause_reading()  # the request being read when the drain began
        if self.worker is None or self.worker.done():
            self.worker = self.loop.create_task(self._serve())

    # --------------------------------------------------------------------------------------
    async def _serve(self) -> None:
        while self.queue and self.transport is not None and not self.transport.is_closing():
            method, path, headers, body, keep_alive = self.queue.popleft()
            try:
                status, payload = await self.handler(method, path, headers, body)
            except Exception:  # noqa: BLE001 - the handler maps its errors; this is a bug
                log.exception("unhandled error in %s %s", method, path)
                status, payload = 500, b'{"error": {"message": "internal gateway error"}}'
            # draining (it may have begun while the handler ran): the requests already
            # received are answered, the last of them with `connection: close`
            keep_alive = keep_alive and not (self.draining and self._last())
            if not isinstance(payload, bytes):
                try:
                    await self._send_stream(status, payload, keep_alive)
                except Exception:  # noqa: BLE001 - streams report their own errors: a bug
                    log.exception("stream of %s %s failed", method, path)
                    self.transport.close()
                    return
            elif self.transport.is_closing():
                return
            else:
                response = (_response(status, payload, keep_alive, payload.content_type)
                            if isinstance(payload, TextBody)
                            else _response(status, payload, keep_alive))
                if method == "HEAD":  # the head alone: a body would be read as the next response
                    response = response[:len(response) - len(payload)]
                self.transport.write(response)
            if self.transport.is_closing():
                return
            if not keep_alive or (self.draining and self._last()):  # (a stream whose head
                self._close()  # went out before the drain said keep-alive)
                return
        if not self._reading and not self.queue and self.transport is not None:
            self._arm(self.idle_timeout_s)

    def _close(self) -> None:
        """Closes after the last response; draining, a "lingering" close: the write side
        first, then what the client still sends is read and dropped (up to
        `LINGER_S`), so that unread requests do not make the kernel reset the connection and
        lose the responses the client has not read yet."""
        transport = self.transport
        assert transport is not None
        if not self.draining or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._discard = True
        transport.resume_reading()
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(LINGER_S, transport.close)
        self._fires = math.inf  # (not a `_tick`: an `_arm` would set its own)

    def _last(self) -> bool:
        """No other request is queued or being read: the response now due is the last."""
        return not self.queue and not self._reading

    @property
    def busy(self) -> bool:
        """A request is being read, queued or answered."""
        return self._reading or bool(self.queue) or (self.worker is not None and
                                                      not self.worker.done())

    def drain(self) -> None:
        """Closes the connection now if idle, else once the requests it has received (those
        pipelined behind the current one too, and one being read) are answered, the last
        with `connection: close`; no later request is read."""
        self.draining = True
        if not self.busy and self.transport is not None:
            self.transport.close()
        elif not self._reading and self.transport is not None:
            self.transport.pause_reading()

    async def _send_stream(self, status: int, body: StreamBody, keep_alive: bool) -> None:
        transport = self.transport
        assert transport is not None
        try:
            if transport.is_closing():
                return
            transport.write(_stream_head(status, keep_alive))
            async for piece in body:
                if transport.is_closing():
                    return  # the client went away: aclose() learns it was not finished
                if piece:
                    transport.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                if self._writable is not None and not self._writable.is_set():
                    await self._writable.wait()  # a slow client: the stream waits for it
            if not transport.is_closing():
                transport.write(b"0\r\n\r\n")
        finally:
            await body.aclose()

    def _reject(self, status: int, payload: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_response(status, payload, False))
            self.transport.close()


class HttpServer:
    """The listening server and its open connections."""

    def __init__(self, server: asyncio.AbstractServer, live: set[_Connection]) -> None:
        self.server, self.live = server, live

    async def drain(self, grace_s: float) -> int:
        """Stops accepting connections, closes the idle ones, lets each busy one finish its
        response (then closes it), and after `grace_s` closes what is left. Returns how many
        were cut off that way."""
        self.server.close()
        for conn in list(self.live):
            conn.drain()
        deadline = time.monotonic() + grace_s
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cut = list(self.live)
        for conn in cut:
            if conn.transport is not None:
                conn.transport.close()
        return len(cut)


async def serve_http(handler: Handler, sock: socket.socket, max_body_bytes: int,
                     idle_timeout_s: float = 75.0, read_timeout_s: float = 30.0
                     ) -> HttpServer:
    """Serves `handler` on an already bound socket; returns the started server."""
    loop = asyncio.get_running_loop()
    live: set[_Connection] = set()
    server = await loop.create_server(lambda: _Connection(handler, max_body_bytes,
                                                          idle_timeout_s, read_timeout_s, live),
                                      sock=sock, backlog=2048)
    return HttpServer(server, live)
