"""Carrying bytes one way between two asyncio streams: half of a TCP relay (the sandboxes'
doors out, services/controller/sandbox/egress.py; the fake kubelet's pod doors)."""

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
