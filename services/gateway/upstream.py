"""A lean HTTP/1.1 client for the gateway's engine round trips.

The gateway's hot path is one POST per harness call to an engine on a trusted network. A
general-purpose client (aiohttp, httpx) spends more CPU per request than the rest of the
gateway; this one keeps a pool of keep-alive connections per engine, writes each request in
one syscall and parses responses with httptools (the parser uvicorn uses). It speaks only
what vLLM's server speaks back: HTTP/1.1 with Content-Length or chunked bodies.

`post` returns a whole response; `stream` returns as soon as the response head arrived and
hands out the body as the engine writes it (server-sent events), so tokens reach the harness
as they are generated. Closing a stream before its end closes the connection: vLLM aborts the
request.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit

import httptools

from harnessrl.engine_guard import ClientKey, process_key


class UpstreamError(Exception):
    """The exchange failed after the request may have reached the engine."""


class ConnectFailed(UpstreamError):
    """No connection could be made: nothing reached the engine (safe to try another)."""


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []
        self.closed = False
        self.keep_alive = True
        self.got_bytes = False
        self.last_used = time.monotonic()
        # streaming mode: the head's status, then body pieces; None ends, an exception fails
        self.head: asyncio.Future[int] | None = None
        self.pieces: asyncio.Queue[bytes | BaseException | None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(UpstreamError(f"bad HTTP response from engine: {err}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(UpstreamError(f"engine closed the connection ({exc or 'EOF'})"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.pieces is not None:
            self.pieces.put_nowait(body)
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.pieces is not None:
            self.pieces.put_nowait(None)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved: the opener re-raises it
        if self.pieces is not None:
            self.pieces.put_nowait(exc)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    async def exchange(self, request: bytes, timeout: float) -> tuple[int, bytes]:
        assert self.transport is not None
        self.body = []
        self.got_bytes = False
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        # A timer on the waiter, not asyncio.wait_for: this runs once per harness call.
        timer = loop.call_later(timeout, self._timed_out, waiter, timeout)
        self.transport.write(request)
        try:
            return await waiter
        finally:
            timer.cancel()
            self.waiter = None
            self.last_used = time.monotonic()

    @staticmethod
    def _timed_out(waiter: asyncio.Future[tuple[int, bytes]], timeout: float) -> None:
        if not waiter.done():
            waiter.set_exception(asyncio.TimeoutError(f"no response within {timeout:g}s"))


class UpstreamStream:
    """A response being received: `status`, then `read()` the body as it arrives."""

    def __init__(self, pool: "UpstreamPool", conn: _Conn, status: int, timer: asyncio.TimerHandle
                 ) -> None:
        self.pool, self.conn, self.status, self.timer = pool, conn, status, timer
        self.done = False

    async def read(self) -> bytes | None:
        """The body received since the last read (at least one piece); None at its end."""
        if self.done:
            return None
        queue = self.conn.pieces
        assert queue is not None
        item = await queue.get()
        pieces: list[bytes] = []
        while True:
            if item is None:
                self._end(reuse=True)
                return b"".join(pieces) if pieces else None
            if isinstance(item, BaseException):
                self._end(reuse=False)
                raise item
            pieces.append(item)
            if queue.empty():
                return b"".join(pieces)
            item = queue.get_nowait()

    async def read_all(self) -> bytes:
        out = []
        while (piece := await self.read()) is not None:
            out.append(piece)
        return b"".join(out)

    def close(self) -> None:
        """Ends the exchange; before the body's end this closes the connection (the engine
        aborts the request)."""
        if not self.done:
            self._end(reuse=False)

    def _end(self, reuse: bool) -> None:
        self.done = True
        self.timer.cancel()
        self.conn.pieces = self.conn.head = None
        self.conn.last_used = time.monotonic()
        if reuse:
            self.pool._release(self.conn)
        else:
            self.conn.close()


class UpstreamPool:
    """Keep-alive connections to one engine (`base_url` like http://127.0.0.1:8000, or
    https://: TLS verified against the system's CAs, or `ssl_context`'s). Each request carries
    the engine key `key` (default: this process's, harnessrl/engine_guard.py)."""

    def __init__(self, base_url: str, idle_timeout_s: float = 30.0,
                 ssl_context: ssl.SSLContext | None = None, key: ClientKey | None = None
                 ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL must be http(s)://host:port, got {base_url!r}")
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self.ssl = ssl_context or ssl.create_default_context()
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.prefix = parts.path.rstrip("/")
        self.host_header = f"{self.host}:{self.port}".encode()
        self.idle: list[_Conn] = []
        self.idle_timeout_s = idle_timeout_s
        self.key = process_key() if key is None else key
        self._key, self._auth = "", b""  # the key's header line, made when the key changes

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(_Conn, self.host, self.port, ssl=self.ssl)
        except ssl.SSLError as err:  # the engine answered, but not as the one we trust
            raise ConnectFailed(f"TLS with {self.host}:{self.port} failed: {err}") from err
        except OSError as err:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {err}") from err
        return conn

    def _request_bytes(self, path: str, body: bytes, headers: bytes = b"") -> bytes:
        """`headers` (lines, each `\r\nName: value`): sent in place of the engine key's."""
        key = self.key.value()
        if key != self._key:
            self._key, self._auth = key, b"\r\nAuthorization: Bearer " + key.encode() if key \
                else b""
        return b"".join((
            b"POST ", (self.prefix + path).encode(), b" HTTP/1.1\r\nHost: ", self.host_header,
            headers or self._auth,
            b"\r\nContent-Type: application/json\r\nContent-Length: ", str(len(body)).encode(),
            b"\r\n\r\n", body))

    async def post(self, path: str, body: bytes, timeout: float, headers: bytes = b""
                   ) -> tuple[int, bytes]:
        """POSTs JSON; returns (status, body). Raises ConnectFailed when the engine could not
        be reached at all, UpstreamError when the exchange broke."""
        request = self._request_bytes(path, body, headers)
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if conn.closed or now - conn.last_used > self.idle_timeout_s:
                conn.close()
                continue
            try:
                return await self._exchange(conn, request, timeout)
            except UpstreamError:
                if not conn.got_bytes:
                    continue  # a keep-alive connection the engine had closed: use another
                raise
        return await self._exchange(await self._connect(), request, timeout)

    async def stream(self, path: str, body: bytes, timeout: float, headers: bytes = b""
                     ) -> UpstreamStream:
        """POSTs JSON and returns once the response head arrived; `timeout` bounds the whole
        exchange. Raises like `post`."""
        request = self._request_bytes(path, body, headers)
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if conn.closed or now - conn.last_used > self.idle_timeout_s:
                conn.close()
                continue
            try:
                return await self._open_stream(conn, request, timeout)
            except UpstreamError:
                if not conn.got_bytes:
                    continue  # a keep-alive connection the engine had closed: use another
                raise
        return await self._open_stream(await self._connect(), request, timeout)

    async def _open_stream(self, conn: _Conn, request: bytes, timeout: float
                           ) -> UpstreamStream:
        assert conn.transport is not None
        loop = asyncio.get_running_loop()
        conn.got_bytes = False
        conn.head = loop.create_future()
        conn.pieces = asyncio.Queue()
        timer = loop.call_later(timeout, conn._fail,
                                asyncio.TimeoutError(f"no complete response within {timeout:g}s"))
        conn.transport.write(request)
        try:
            status = await conn.head
        except BaseException:
            timer.cancel()
            conn.close()
            raise
        return UpstreamStream(self, conn, status, timer)

    async def _exchange(self, conn: _Conn, request: bytes, timeout: float
                        ) -> tuple[int, bytes]:
        try:
            result = await conn.exchange(request, timeout)
        except BaseException:
            conn.close()
            raise
        self._release(conn)
        return result

    def _release(self, conn: _Conn) -> None:
        if conn.keep_alive and not conn.closed:
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()
