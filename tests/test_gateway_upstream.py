"""The gateway's HTTP/1.1 engine client against small real asyncio servers."""

from __future__ import annotations

import asyncio

import pytest

from harnessrl import procs
from services.gateway.upstream import ConnectFailed, UpstreamError, UpstreamPool


async def _server(handler):  # type: ignore[no-untyped-def]
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    return await reader.readexactly(length)


async def test_keep_alive_chunked_and_reconnect_after_server_closed_idle_connection() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        body = await _read_request(reader)
        chunks = [b"echo:", body]  # a chunked body of two chunks
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(
            b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")
        await writer.drain()
        if connections == 1:
            body = await _read_request(reader)  # a second request on the same connection
            writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()  # then the server drops the idle keep-alive connection

    server, port = await _server(handler)
    pool = UpstreamPool(f"http://127.0.0.1:{port}")
    assert await pool.post("/x", b'{"a":1}', 5) == (200, b'echo:{"a":1}')
    assert await pool.post("/x", b"{}", 5) == (201, b"ok")
    await asyncio.sleep(0.1)
    # The pooled connection was closed by the server: the client notices and reconnects.
    assert await pool.post("/x", b"[]", 5) == (200, b"echo:[]")
    assert connections == 2
    pool.close()
    server.close()


async def test_connect_failure_and_broken_exchange_are_told_apart() -> None:
    pool = UpstreamPool(f"http://127.0.0.1:{procs.free_port()}")
    with pytest.raises(ConnectFailed):
        await pool.post("/x", b"{}", 5)

    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    server, port = await _server(half)
    with pytest.raises(UpstreamError) as err:
        await UpstreamPool(f"http://127.0.0.1:{port}").post("/x", b"{}", 5)
    assert not isinstance(err.value, ConnectFailed)
    server.close()


async def test_https_engine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import ssl
    import subprocess
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    trusting = ssl.create_default_context(cafile=str(cert))
    pool = UpstreamPool(f"https://127.0.0.1:{port}", ssl_context=trusting)
    assert await pool.post("/x", b'{"tls":1}', 5) == (200, b'{"tls":1}')
    with pytest.raises(ConnectFailed):  # a certificate nobody vouched for is refused
        await UpstreamPool(f"https://127.0.0.1:{port}").post("/x", b"{}", 5)
    pool.close()
    server.close()

