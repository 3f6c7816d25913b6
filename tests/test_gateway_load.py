"""The gateway under load: a thousand rollouts calling at once, and slow or idle clients that
must not starve the real ones. Real gateway process, real store on Redis, the stub engine.
The long form (and the p99 to report) is `bench/gateway_load.py`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from conftest import StoreService, StubEngineService
from harnessrl.testing import gateway_load
from test_gateway import SIGNER, World


def test_a_thousand_concurrent_rollouts_lose_nothing(
        tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService) -> None:
    w = World(tmp_path, store_service, [stub_engine])
    try:
        rollouts = gateway_load.make_rollouts(w.store, SIGNER, "load", 1000)
        report = asyncio.run(gateway_load.drive(w.gateway.http_port, [k for _, k in rollouts],
                                                calls=2, stream_every=2))
        print("load:", report.summary())
        assert report.errors == [] and report.ok == 2000
        assert gateway_load.verify(w.store, [r for r, _ in rollouts], 2) == []
    finally:
        w.close()


async def _dribble(port: int, head: bytes, piece: bytes, every_s: float, max_s: float
                   ) -> tuple[bytes, float]:
    """Sends `head`, then `piece` every `every_s` until the gateway answers or closes (or
    `max_s`); returns what it answered and after how long."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(head)
    answer = b""
    try:
        while time.monotonic() - t0 < max_s:
            try:
                data = await asyncio.wait_for(reader.read(4096), every_s)
            except TimeoutError:
                writer.write(piece)
                continue
            answer += data
            if not data:
                break
    except ConnectionError:
        pass
    finally:
        writer.close()
    return answer, time.monotonic() - t0


async def _idle(port: int, max_s: float) -> float:
    """Opens a connection, sends nothing; returns when the gateway closed it (seconds from
    before the connection was made)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await asyncio.wait_for(reader.read(), max_s)
    except TimeoutError:
        return float("inf")
    finally:
        writer.close()
    return time.monotonic() - t0


def test_idle_and_dribbling_clients_do_not_starve_real_calls(
        tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService) -> None:
    """A burst of 1,000 idle connections and 60 clients dribbling their headers or body, while
    100 rollouts make their calls: every call is answered; the dribblers get 408 within the
    read bound; the idle connections are closed at the idle bound."""
    w = World(tmp_path, store_service, [stub_engine], "--http-read-timeout-s", "1",
              "--http-idle-timeout-s", "3")
    port = w.gateway.http_port
    try:
        rollouts = gateway_load.make_rollouts(w.store, SIGNER, "slow", 100)

        async def scenario() -> tuple[list[float], list[tuple[bytes, float]],
                                      gateway_load.LoadReport]:
            idle = [asyncio.create_task(_idle(port, 20)) for _ in range(1000)]
            await asyncio.sleep(0.5)  # the burst is in before the real calls start
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\n"
                    b"Content-Type: application/json\r\n")
            dribblers = [asyncio.create_task(_dribble(port, head, b"X-Slow: 1\r\n", 0.2, 10))
                         for _ in range(30)]
            dribblers += [asyncio.create_task(_dribble(
                port, head + b"Content-Length: 1000\r\n\r\n{", b" ", 0.2, 10))
                for _ in range(30)]
            report = await gateway_load.drive(port, [k for _, k in rollouts], calls=3,
                                              stream_every=3)
            return (await asyncio.gather(*idle), await asyncio.gather(*dribblers), report)

        idle, dribbled, report = asyncio.run(scenario())
        print("under an idle burst:", report.summary())
        assert report.errors == [] and report.ok == 300
        assert gateway_load.verify(w.store, [r for r, _ in rollouts], 3) == []
        for answer, after in dribbled:
            assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
            assert after < 4, after  # 1 s read bound, on a busy machine
        assert all(2.9 < t < 10 for t in idle), sorted(idle)[::100]  # 3 s idle bound
        assert w.gateway.proc.alive
    finally:
        w.close()
