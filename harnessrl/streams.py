"""Carrying bytes between asyncio streams: `relay`, one way (half of a TCP relay: the
sandboxes' doors out, services/controller/sandbox/egress.py; the fake kubelet's pod doors;
the gateway's door in Compose, services/gate/door.py), and `splice`, a client's connection
carried both ways to a target."""

from __future__ import annotations

import asyncio


async def relay(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copies `src` to `dst` until `src` ends, then half-closes `dst` (EOF) where it can. A
    connection that breaks ends it quietly: the caller closes both ends."""
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except OSError:
        pass


async def splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str,
                 port: int) -> None:
    """Connects to host:port and carries the client's connection both ways until both ends
    are done, then closes both. A target that does not answer closes the client's end and
    raises the `OSError` for the caller to report."""
    try:
        up_reader, up_writer = await asyncio.open_connection(host, port)
    except OSError:
        writer.close()
        raise
    try:
        await asyncio.gather(relay(reader, up_writer), relay(up_reader, writer))
    finally:
        for w in (writer, up_writer):
            w.close()
