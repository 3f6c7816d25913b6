"""What authentication costs the store's RPCs, for `bench/gateway_overhead.py`: mTLS as the
calling service against plaintext, side by side (issue 40's target: authenticated / plaintext
throughput >= 0.95).

Two store processes on one Redis, started alike: one serving mTLS as `store` and authorizing
every call by harnessrl/authz.py, one in explicit insecure mode (HARNESSRL_INSECURE=1:
plaintext on loopback, no interceptor). The same client code drives both, in alternating
draws (mTLS first in even rounds, plaintext first in odd ones), so machine noise hits both
alike; a round's ratio is its mTLS figure / its plaintext figure:

- `record_stream`: the gateway's own recorder (services/gateway/recorder.py `CallRecorder`:
  one RecordCalls stream, group commit) fed by `concurrency` coroutines recording calls of one
  running attempt, as the `gateway` identity; calls/s.
- `unary_c1`, `unary`: GetRollout (no calls) as the `controller` identity, one call at a time
  (calls/s, p50 ms) and `concurrency` in flight (calls/s).
Each draw also gives the CPU per call (µs) of the store, of Redis and of this client process,
where the extra work of mTLS shows; `cpu_ratio` is plaintext's CPU per call / mTLS's, the
throughput ratio of a CPU-bound deployment, steadier than calls/s on a shared machine.
Besides: `connect_p50_ms`, a new channel's first call (the TLS handshake included), and
`parts`, the authorization's own pieces timed alone (bench/_auth_parts.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench import _auth_parts
from bench._services import start_store
from harnessrl import procs
from harnessrl.clients import StoreClient
from harnessrl.identity import INSECURE_ENV, TLS_DIR_ENV, Identity
from harnessrl.v1 import common_pb2 as c
from services.gateway.recorder import CallRecorder

TARGET = 0.95
TICK = os.sysconf("SC_CLK_TCK")
# A recorded call about the size of an agent's turn: 512 prompt tokens, 32 generated with
# their logprobs, the request's JSON (~2 kB) and the returned message.
PROMPT = list(range(1000, 1512))
REQUEST = (b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 2000 + b'"}]}')


class _Once(logging.Filter):
    """Passes each distinct message once (the plaintext arm's channels each warn INSECURE)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage().split(" at ")[0]
        if msg in self.seen:
            return False
        self.seen.add(msg)
        return True


def cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def make_call(rollout_id: str, seq: int) -> c.Call:
    return c.Call(rollout_id=rollout_id, attempt=1, seq=seq, api="chat.completions", model="m",
                  prompt_token_ids=PROMPT, completion_token_ids=list(range(32)),
                  logprobs=[-0.5] * 32, finish_reason="stop", engine="stub",
                  started_at=time.time(), latency_s=0.01, request_json=REQUEST,
                  completion_text="y" * 100, response_message_json=b'{"content": "y"}')


class Arm:
    """One store (mTLS or plaintext) and this process's clients of it."""

    def __init__(self, name: str, proc: procs.ServiceProcess, address: str,
                 gateway: Identity | None, controller: Identity | None, redis_pid: int) -> None:
        self.name, self.proc, self.address, self.redis_pid = name, proc, address, redis_pid
        self.gateway, self.controller = gateway, controller
        self.rollout = f"auth/{name}"
        self.seqs = itertools.count()
        self.runs: dict[str, list[dict[str, float]]] = {}

    async def open(self, concurrency: int) -> None:
        setup = StoreClient.connect(self.address, ident=self.controller)
        setup.create_rollouts([c.Rollout(rollout_id=r, run_id="bench-auth", task_id="t",
                                         group_id=f"bench-auth/{self.name}", group_size=1,
                                         stream="-")
                               for r in (self.rollout, self.rollout + "/read")])
        setup.start_attempt(self.rollout, 1)
        setup.close()
        self.recording = StoreClient.connect_async(self.address, ident=self.gateway)
        self.recorder = CallRecorder(self.recording, hold_timeout_s=30.0)
        self.reading = StoreClient.connect_async(self.address, ident=self.controller)
        self.concurrency = concurrency

    async def close(self) -> None:
        await self.recorder.close()
        await self.recording.close()
        await self.reading.close()

    async def _timed(self, kind: str, seconds: float, workers: int, one: Any) -> dict[str, float]:
        """Runs `workers` loops of `await one()` for `seconds`: calls/s, p50 ms, and CPU µs
        per call of the store, of Redis and of this process."""
        loop = asyncio.get_running_loop()
        latencies: list[float] = []
        end = loop.time() + seconds

        async def worker() -> None:
            while loop.time() < end:
                t = time.perf_counter()
                await one()
                latencies.append(time.perf_counter() - t)

        assert self.proc.proc is not None
        pid = self.proc.proc.pid
        store0, redis0, own0 = cpu_s(pid), cpu_s(self.redis_pid), time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workers)))
        elapsed, n = time.perf_counter() - t0, max(1, len(latencies))
        r = {"calls_per_s": len(latencies) / elapsed,
             "p50_ms": statistics.median(latencies) * 1000 if latencies else 0.0,
             "store_cpu_us_per_call": (cpu_s(pid) - store0) * 1e6 / n,
             "redis_cpu_us_per_call": (cpu_s(self.redis_pid) - redis0) * 1e6 / n,
             "client_cpu_us_per_call": (time.process_time() - own0) * 1e6 / n}
        r["cpu_us_per_call"] = sum(r[f"{w}_cpu_us_per_call"] for w in ("store", "redis", "client"))
        self.runs.setdefault(kind, []).append(r)
        return r

    async def draw(self, kind: str, seconds: float) -> dict[str, float]:
        if kind == "record_stream":
            async def one() -> None:
                await self.recorder.record(make_call(self.rollout, next(self.seqs)))
            return await self._timed(kind, seconds, self.concurrency, one)
        read = self.rollout + "/read"
        return await self._timed(kind, seconds, 1 if kind == "unary_c1" else self.concurrency,
                                 lambda: self.reading.get_rollout(read))

    async def connect_ms(self, samples: int) -> float:
        """p50 of a new channel's first GetRollout (handshake included), ms."""
        out = []
        for _ in range(samples):
            t = time.perf_counter()
            client = StoreClient.connect_async(self.address, ident=self.controller)
            await client.get_rollout(self.rollout + "/read")
            out.append(time.perf_counter() - t)
            await client.close()
        return statistics.median(out) * 1000


KINDS = ("record_stream", "unary_c1", "unary")


async def _measure(arms: list[Arm], seconds: float, warm_s: float, rounds: int,
                   concurrency: int, connect_samples: int) -> dict[str, Any]:
    for arm in arms:
        await arm.open(concurrency)
    try:
        for arm in arms:  # warm-up: channels connected, stores' code paths hot
            for kind in KINDS:
                await arm.draw(kind, warm_s)
            arm.runs.clear()
        for i in range(rounds):
            for kind in KINDS:
                for arm in arms[::-1] if i % 2 else arms:
                    await arm.draw(kind, seconds)
        connect = {arm.name: await arm.connect_ms(connect_samples) for arm in arms}
    finally:
        for arm in arms:
            await arm.close()
    return {"connect_p50_ms": connect}


def summarize(tls: Arm, plain: Arm) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        a, b = tls.runs[kind], plain.runs[kind]
        ratios = [x["calls_per_s"] / y["calls_per_s"] for x, y in zip(a, b)]
        # the throughput the same CPU would give, plaintext's CPU per call / mTLS's (all of
        # the store, Redis and this client): what a CPU-bound deployment gets, and steadier
        # than calls/s on a machine shared with other work
        cpu = [y["cpu_us_per_call"] / x["cpu_us_per_call"] for x, y in zip(a, b)]
        med = {arm.name: {m: round(statistics.median(r[m] for r in arm.runs[kind]), 3)
                          for m in a[0]} for arm in (tls, plain)}
        out[kind] = {"ratio": round(statistics.median(ratios), 3),
                     "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
                     "meets_target": statistics.median(ratios) >= TARGET,
                     "cpu_ratio": round(statistics.median(cpu), 3),
                     "cpu_ratio_min": round(min(cpu), 3), "cpu_ratio_max": round(max(cpu), 3),
                     **med}
    return out


def run(workdir: Path, redis_url: str, redis_pid: int, pki_root: Path, seconds: float,
        rounds: int, concurrency: int = 32, quick: bool = False) -> dict[str, Any]:
    """Starts the two stores on `redis_url` (Redis's process `redis_pid`; identities from the
    PKI folder `pki_root`), measures, stops them; returns the figures (the module docstring
    says which)."""
    started: list[procs.ServiceProcess] = []
    once = _Once()
    logging.getLogger("harnessrl.identity").addFilter(once)
    try:
        tls_proc, tls_addr = start_store(workdir / "auth-mtls", redis_url,
                                         {TLS_DIR_ENV: str(pki_root / "store")})
        started.append(tls_proc)
        plain_proc, plain_addr = start_store(workdir / "auth-plain", redis_url,
                                             {TLS_DIR_ENV: "", INSECURE_ENV: "1"})
        started.append(plain_proc)
        tls = Arm("mtls", tls_proc, tls_addr, Identity.from_folder(pki_root / "gateway"),
                  Identity.from_folder(pki_root / "controller"), redis_pid)
        plain = Arm("plaintext", plain_proc, plain_addr, None, None, redis_pid)
        extra = asyncio.run(_measure([tls, plain], seconds, 0.1 if quick else 1.0, rounds,
                                     concurrency, 3 if quick else 20))
    finally:
        logging.getLogger("harnessrl.identity").removeFilter(once)
        for p in started:
            p.stop()
    return {**summarize(tls, plain), **extra, "target": TARGET, "seconds": seconds,
            "rounds": rounds, "concurrency": concurrency,
            "call_bytes": make_call("auth/mtls", 0).ByteSize(),
            "parts": _auth_parts.measure(pki_root, 2000 if quick else 20000, rounds,
                                         0.2 if quick else 1.0)}
