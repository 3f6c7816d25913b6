"""Many rollouts calling the gateway at once, each as a harness does: its own keep-alive
connection, its own key, one call after another (`bench/gateway_load.py`,
`tests/test_gateway_load.py`).

A small asyncio client (the response parsed with httptools) rather than an HTTP library: with
a thousand connections on a small machine, a general client's own CPU would be what is measured
(see docs/http.md). `verify` then checks the store: every answered call recorded once, under its
own rollout, nothing lost.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httptools

from harnessrl.clients import StoreClient
from harnessrl.credentials import CredentialSigner
from harnessrl.v1 import common_pb2 as c


@dataclass
class LoadReport:
    rollouts: int = 0
    calls: int = 0
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s) or [0.0]
        q = statistics.quantiles(lat, n=100) if len(lat) > 1 else lat * 99
        return {"rollouts": self.rollouts, "calls": self.calls, "ok": self.ok,
                "errors": len(self.errors), "first_errors": self.errors[:5],
                "p50_ms": round(statistics.median(lat) * 1000, 2),
                "p99_ms": round(q[98] * 1000, 2), "max_ms": round(lat[-1] * 1000, 2),
                "calls_per_s": round(self.ok / self.elapsed_s, 1) if self.elapsed_s else 0.0,
                "elapsed_s": round(self.elapsed_s, 2)}


class _Response:
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.done = False

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


def make_rollouts(store: StoreClient, signer: CredentialSigner, run: str, n: int
                  ) -> list[tuple[str, str]]:
    """`n` running rollouts of run `run`: [(rollout id, key)]."""
    ids = [f"{run}/t{i}/0" for i in range(n)]
    for start in range(0, n, 500):
        store.create_rollouts([c.Rollout(rollout_id=r, run_id=run, task_id=f"t{i}",
                                         group_id=f"{run}/t{i}", group_size=1, stream="-")
                               for i, r in enumerate(ids[start:start + 500], start)])
    for r in ids:
        store.start_attempt(r, 1)
    return [(r, signer.mint(r, 1, 3600)) for r in ids]


async def _rollout(port: int, key: str, calls: int, stream_every: int, report: LoadReport,
                   start: asyncio.Event) -> None:
    await start.wait()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as err:
        report.errors.append(f"connect: {err}")
        return
    try:
        messages: list[dict[str, str]] = [{"role": "user", "content": "hi"}]
        for i in range(calls):
            stream = stream_every > 0 and i % stream_every == stream_every - 1
            body = json.dumps({"model": "tiny", "messages": messages, "stream": stream,
                               "max_tokens": 8}).encode()
            req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: "
                   b"Bearer " + key.encode() + b"\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            t0 = time.perf_counter()
            writer.write(req)
            resp = _Response()
            while not resp.done:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("gateway closed the connection")
                resp.parser.feed_data(data)
            report.calls += 1
            status = resp.parser.get_status_code()
            text = b"".join(resp.body)
            if status != 200 or (stream and b"data: [DONE]" not in text):
                report.errors.append(f"status {status}: {text[:200]!r}")
                return
            report.latencies_s.append(time.perf_counter() - t0)
            report.ok += 1
            answer = "Hello, world!"
            messages = messages + [{"role": "assistant", "content": answer},
                                   {"role": "user", "content": f"turn {i + 1}"}]
    except (OSError, ConnectionError, httptools.HttpParserError) as err:
        report.errors.append(f"{type(err).__name__}: {err}")
    finally:
        writer.close()


async def drive(port: int, keys: list[str], calls: int, stream_every: int = 0) -> LoadReport:
    """Every key's rollout makes `calls` chat calls (each `stream_every`-th streamed), all
    rollouts at once; returns when all are done."""
    report = LoadReport(rollouts=len(keys))
    start = asyncio.Event()
    tasks = [asyncio.create_task(_rollout(port, k, calls, stream_every, report, start))
             for k in keys]
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    start.set()
    await asyncio.gather(*tasks)
    report.elapsed_s = time.perf_counter() - t0
    return report


def verify(store: StoreClient, rollouts: list[str], calls: int) -> list[str]:
    """Problems in the store: each rollout must hold exactly its `calls` calls, seq 0.., none
    aborted, all its own."""
    problems = []
    for r in rollouts:
        got = list(store.get_rollout(r, include_calls=True).calls)
        seqs = sorted(x.seq for x in got)
        if seqs != list(range(calls)) or any(x.aborted or x.rollout_id != r for x in got):
            problems.append(f"{r}: seqs {seqs[:10]}..., aborted "
                            f"{sum(x.aborted for x in got)}, foreign "
                            f"{sum(x.rollout_id != r for x in got)}")
    return problems
