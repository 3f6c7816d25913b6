"""A minimal streaming HTTP/1.1 load generator for server-sent events (asyncio, no library).

wrk times whole responses; a stream's first token matters on its own. Each connection sends
the same POST over keep-alive, reads the chunked event stream and notes when the first event
carrying generated text arrived (TTFT; vLLM's and the stub's role-only first chunk does not
count) and when the stream ended. The same client measures direct and through-the-gateway, so
its own cost cancels out of the comparison.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from urllib.parse import urlsplit

_TOKEN = re.compile(rb'"content":"[^"]')  # a delta with generated text in it


async def _one_connection(host: str, port: int, request: bytes, stop_at: float,
                          ttft: list[float], total: list[float]) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    done = 0
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"stream refused: {head[:200]!r}")
            first = None
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                data = await reader.readexactly(size + 2)
                if size == 0:
                    break
                if first is None and _TOKEN.search(data):
                    first = time.perf_counter() - t0
            if first is None:
                raise RuntimeError("a stream without generated text")
            ttft.append(first)
            total.append(time.perf_counter() - t0)
            done += 1
    finally:
        writer.close()
    return done


def run(url: str, body: dict, key: str, connections: int, duration: float) -> dict[str, float]:  # type: ignore[type-arg]
    """Streams `body` to `url` over `connections` keep-alive connections for `duration` s."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    request = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer "
               f"{key}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}"
               "\r\n\r\n").encode() + payload
    ttft: list[float] = []
    total: list[float] = []

    async def main() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(_one_connection(parts.hostname or "127.0.0.1", parts.port or 80,
                                               request, t0 + duration, ttft, total)
                               for _ in range(connections)))
        return time.perf_counter() - t0

    elapsed = asyncio.run(main())
    q = statistics.quantiles(ttft, n=100) if len(ttft) > 1 else ttft * 99
    return {"ttft_p50_ms": statistics.median(ttft) * 1000, "ttft_p99_ms": q[98] * 1000,
            "stream_p50_ms": statistics.median(total) * 1000,
            "streams_per_s": len(total) / elapsed, "streams": len(total)}
