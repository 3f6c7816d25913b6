"""A faulty link (test double): a TCP proxy between a gRPC client and server that breaks the
stream carrying a chosen rollout's calls at a chosen point, the way a store process fails.

It stands between the gateway and the real store in `tests/test_gateway_record_faults.py`.
It reads the HTTP/2 frames going each way (frame headers only; HPACK is never decoded, and
header frames always pass, so both ends' header tables stay in step) and finds the record
batch by its content: a client DATA frame whose gRPC message parses as an `AppendCallsRequest`
with a call of the armed rollout. Once `arm(point, fault, rollout_id)`, the next such batch
meets the fault at `point`:

- `before_send`: the batch never reaches the store;
- `after_send`: the store gets the batch (and stores it); its answer never reaches the client;
- `mid_ack`: the store's answer is cut in half: the first half reaches the client.

and the fault is one of:

- `killed`: every connection is cut (aborted) there, and new connections are cut as soon as
  they are accepted until `reset()`: the store process died;
- `hung`: nothing more passes either way on any connection (new ones included) until
  `reset()`, which delivers everything held in order: the store process stopped (SIGSTOP)
  and continued;
- `internal`: the client's stream ends there with grpc-status INTERNAL (trailers made up by
  the link) and the store's side of it is reset (RST_STREAM CANCEL); later batches pass.

With `persistent=True` every later batch of the rollout meets the same fault (until
`reset()`). `fired` is set when the fault happened; `retried` when the client came back after
it: it sent the rollout's batch again, or (killed) tried to connect again.

Frames can only be read in the clear, so with mTLS on (as everywhere) the link ends TLS on
both sides, as a man in the middle with real credentials of the deployment's CA:
`serve_as` (the store's identity) towards the client, which verifies it as the store, and
`connect_as` (the client's own identity) towards the store, which authorizes the calls as
the client's. Both sides speak HTTP/2 by ALPN, as gRPC requires.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from dataclasses import dataclass, field

from harnessrl import identity, pki
from harnessrl.v1 import store_pb2 as spb

POINTS = ("before_send", "after_send", "mid_ack")
FAULTS = ("killed", "hung", "internal")

_DATA, _HEADERS, _RST_STREAM = 0, 1, 3
_END_STREAM, _END_HEADERS = 0x1, 0x4
_PREFACE_LEN = 24
_CANCEL = 0x8


def _frame(ftype: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes([ftype, flags])
            + stream_id.to_bytes(4, "big") + payload)


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing (leaves the header tables alone)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def _internal_trailers(stream_id: int, headers_sent: bool) -> bytes:
    block = b"" if headers_sent else (b"\x88"  # :status 200 (static table), trailers-only
                                      + _literal(b"content-type", b"application/grpc"))
    block += _literal(b"grpc-status", b"13") + _literal(
        b"grpc-message", b"INTERNAL made up by the test's FaultyLink")
    return _frame(_HEADERS, _END_STREAM | _END_HEADERS, stream_id, block)


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    held: list[tuple[bool, bytes]] = field(default_factory=list)  # (to the server, bytes)
    answered: set[int] = field(default_factory=set)  # streams the server sent headers on
    ended: set[int] = field(default_factory=set)  # streams the link ended INTERNAL

    def abort(self) -> None:
        self.client.transport.abort()
        self.server.transport.abort()


@dataclass
class _Armed:
    point: str
    fault: str
    rollout_id: str
    persistent: bool


def _tls(ident: identity.Identity, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=ident.ca.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED  # the client's certificate too, as the store asks
    assert ident.folder is not None, "the link reads its identities from folders"
    ctx.load_cert_chain(ident.folder / "tls.crt", ident.folder / "tls.key")
    ctx.set_alpn_protocols(["h2"])
    return ctx


class FaultyLink:
    def __init__(self, upstream: str, serve_as: identity.Identity | None = None,
                 connect_as: identity.Identity | None = None, upstream_peer: str = "store"
                 ) -> None:
        """A link to `upstream`; with `serve_as` and `connect_as` it ends mTLS on both sides
        (both or neither: a plaintext link is for insecure mode only)."""
        assert (serve_as is None) == (connect_as is None), "mTLS on both sides or neither"
        self.upstream_host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self._serve_tls = _tls(serve_as, server=True) if serve_as else None
        self._connect_tls = _tls(connect_as, server=False) if connect_as else None
        self._upstream_name = pki.server_name(upstream_peer)
        self.port = 0
        self.fired = threading.Event()
        self.retried = threading.Event()
        self._armed: _Armed | None = None
        self._rollout = ""  # the last armed rollout (its batches set `retried`)
        self._dead = False
        self._hung = False
        self._await_ack: set[tuple[_Conn, int]] = set()
        self._conns: set[_Conn] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="faulty-link")
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "FaultyLink":
        self._thread.start()
        self._server = self._call(self._listen())
        return self

    def stop(self) -> None:
        async def shut() -> None:
            assert self._server is not None
            self._server.close()
            for conn in list(self._conns):
                conn.abort()
        self._call(shut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def arm(self, point: str, fault: str, rollout_id: str, persistent: bool = False) -> None:
        assert point in POINTS and fault in FAULTS
        armed = _Armed(point, fault, rollout_id, persistent)

        def apply() -> None:
            self._armed, self._rollout = armed, rollout_id
        self._loop.call_soon_threadsafe(apply)

    def reset(self) -> None:
        """Disarms, revives a killed link and delivers what a hung one held."""
        async def heal() -> None:
            self._armed, self._rollout, self._dead, self._hung = None, "", False, False
            self._await_ack.clear()
            for conn in self._conns:
                for to_server, data in conn.held:
                    (conn.server if to_server else conn.client).write(data)
                conn.held.clear()
            self.fired.clear()
            self.retried.clear()
        self._call(heal())

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self) -> asyncio.Server:
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=self._serve_tls)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._dead:
            self.retried.set()
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.upstream_host, self.upstream_port, ssl=self._connect_tls,
                server_hostname=self._upstream_name if self._connect_tls else None)
        except OSError:
            writer.transport.abort()
            return
        conn = _Conn(writer, up_writer)
        self._conns.add(conn)
        try:
            await asyncio.gather(self._pump(conn, reader, True),
                                 self._pump(conn, up_reader, False))
        finally:
            self._conns.discard(conn)
            conn.abort()

    async def _pump(self, conn: _Conn, reader: asyncio.StreamReader, to_server: bool) -> None:
        try:
            if to_server:
                self._pass(conn, to_server, await reader.readexactly(_PREFACE_LEN))
            while True:
                head = await reader.readexactly(9)
                payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
                stream_id = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                if to_server:
                    self._from_client(conn, head, payload, stream_id)
                else:
                    self._from_server(conn, head, payload, stream_id)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            conn.abort()

    def _pass(self, conn: _Conn, to_server: bool, data: bytes) -> None:
        if self._hung:
            conn.held.append((to_server, data))
        else:
            (conn.server if to_server else conn.client).write(data)

    def _active(self) -> _Armed | None:
        armed = self._armed
        if armed is None or (self.fired.is_set() and not armed.persistent):
            return None
        return armed

    def _from_client(self, conn: _Conn, head: bytes, payload: bytes, stream_id: int) -> None:
        if head[3] == _DATA and self._rollout and _carries(payload, self._rollout):
            if self.fired.is_set():
                self.retried.set()
            armed = self._active()
            if armed is not None:
                if armed.point == "before_send":
                    self._fire(armed, conn, stream_id, (True, head + payload))
                    return
                self._await_ack.add((conn, stream_id))
        self._pass(conn, True, head + payload)

    def _from_server(self, conn: _Conn, head: bytes, payload: bytes, stream_id: int) -> None:
        if head[3] == _HEADERS:
            conn.answered.add(stream_id)
        elif head[3] == _DATA and stream_id in conn.ended:
            return  # the client's stream is over: the store's late answer goes nowhere
        armed = self._armed
        if head[3] == _DATA and payload and (conn, stream_id) in self._await_ack \
                and armed is not None:
            self._await_ack.discard((conn, stream_id))
            rest = head + payload
            if armed.point == "mid_ack":
                half = max(1, len(payload) // 2)
                self._pass(conn, False, _frame(_DATA, 0, stream_id, payload[:half]))
                rest = _frame(_DATA, head[4], stream_id, payload[half:])
            self._fire(armed, conn, stream_id, (False, rest))
            return
        self._pass(conn, False, head + payload)

    def _fire(self, armed: _Armed, conn: _Conn, stream_id: int,
              stopped: tuple[bool, bytes]) -> None:
        """The fault, where `stopped` (direction, bytes) was about to pass."""
        self.fired.set()
        if armed.fault == "killed":
            self._dead = True
            for c in list(self._conns):
                c.abort()
        elif armed.fault == "hung":
            self._hung = True
            conn.held.append(stopped)
        else:  # internal: the client's stream ends INTERNAL, the store's side is reset
            conn.ended.add(stream_id)
            conn.client.write(_internal_trailers(stream_id, stream_id in conn.answered))
            conn.server.write(_frame(_RST_STREAM, 0, stream_id, _CANCEL.to_bytes(4, "big")))


def _carries(payload: bytes, rollout_id: str) -> bool:
    """Whether a DATA frame's payload is one gRPC message holding a record batch with a call
    of `rollout_id`."""
    if len(payload) < 5 or payload[0] != 0:
        return False
    try:
        request = spb.AppendCallsRequest.FromString(payload[5:5 + int.from_bytes(
            payload[1:5], "big")])
    except Exception:  # noqa: BLE001 - any other message: not a batch
        return False
    return any(call.rollout_id == rollout_id for call in request.calls)
