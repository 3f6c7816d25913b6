"""What the engine's key check (harnessrl/engine_guard.py) costs: vLLM on the tiny model with the
guard and without it, side by side in one run.

Three engines start from the same model folder: one with `--middleware
harnessrl.engine_guard.RequireKey` and a keys file (as `harnessrl up` runs it), two without
(`plain`, `plain2`: their difference is the noise floor; with two engines alone, on a shared
2-core machine, where each engine's processes landed decided more than the guard: 160-440 us
once). For each route (GET /v1/models: no model work, so the guard's share
is largest; POST /tokenize; a one-token chat completion) the bench sends `--requests`
sequential keep-alive requests to each engine in turn, rotating which goes first, for
`--rounds` rounds, and reports each engine's median latency (the median of the rounds'
medians), guarded/plain and plain2/plain as ratios and in microseconds. Then the middleware
alone, in this process: one request through `RequireKey` around an ASGI app that does nothing,
against that app called directly (microseconds per call).

Ends with one JSON line of the figures.

    python bench/engine_guard.py                     # 9 rounds of 200 requests per route
    python bench/engine_guard.py --rounds 3 --requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harnessrl.engine_guard import RequireKey  # noqa: E402


def routes(model: str) -> dict[str, tuple[str, str, Any]]:
    return {"models": ("GET", "/v1/models", None),
            "tokenize": ("POST", "/tokenize", {"model": model, "prompt": "What is 2+3?"}),
            "chat_1_token": ("POST", "/v1/chat/completions", {
                "model": model, "messages": [{"role": "user", "content": "What is 2+3?"}],
                "max_tokens": 1, "temperature": 0.0})}


def timed(client: httpx.Client, method: str, path: str, body: Any, n: int) -> float:
    """Median seconds of `n` sequential requests."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.request(method, path, json=body)
        out.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:200]}")
    return statistics.median(out)


def compare(engines: dict[str, Any], rounds: int, n: int) -> dict[str, dict[str, float]]:
    """Per route: each engine's median latency, and the ratios guarded/plain and (the noise
    floor: two engines that differ in nothing) plain2/plain."""
    out = {}
    clients = {arm: httpx.Client(base_url=e.base_url, headers=e.headers, timeout=120)
               for arm, e in engines.items()}
    arms = list(clients)
    try:
        for name, (method, path, body) in routes(engines["guarded"].model_name).items():
            for c in clients.values():  # warm-up
                timed(c, method, path, body, max(5, n // 10))
            meds: dict[str, list[float]] = {arm: [] for arm in arms}
            for i in range(rounds):  # each arm goes first, second, third in turn
                for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
                    meds[arm].append(timed(clients[arm], method, path, body, n))
            m = {arm: statistics.median(v) for arm, v in meds.items()}
            out[name] = {**{f"{arm}_p50_ms": round(v * 1e3, 3) for arm, v in m.items()},
                         "ratio": round(m["guarded"] / m["plain"], 3),
                         "added_us": round((m["guarded"] - m["plain"]) * 1e6, 1),
                         "noise_ratio": round(m["plain2"] / m["plain"], 3),
                         "noise_us": round((m["plain2"] - m["plain"]) * 1e6, 1)}
            print(name, json.dumps(out[name]), flush=True)
    finally:
        for c in clients.values():
            c.close()
    return out


def middleware_alone(keys_file: Path, key: str, n: int = 20000) -> dict[str, float]:
    """Microseconds per request: `RequireKey` around a do-nothing ASGI app, and the app alone."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(msg: Any) -> None:
        return None

    guard = RequireKey(app, keys_file=keys_file)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [
        (b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
        (b"authorization", b"Bearer " + key.encode())]}

    async def run(handler: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            await handler(scope, receive, send)
        return (time.perf_counter() - t0) / n * 1e6

    async def both() -> tuple[float, float]:
        a, b = [], []
        for _ in range(5):
            a.append(await run(guard))
            b.append(await run(app))
        return min(a), min(b)

    with_guard, without = asyncio.run(both())
    return {"guard_us": round(with_guard, 2), "app_alone_us": round(without, 2),
            "added_us": round(with_guard - without, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--requests", type=int, default=200, help="per round, engine and route")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="model folder (default: the project's tiny model, built if missing)")
    a = p.parse_args()
    from harnessrl.local.engine import start_engine  # torch: not for --help
    from harnessrl.model import build_tiny_model, default_model_dir

    model_dir = a.model_dir or build_tiny_model(default_model_dir())
    with tempfile.TemporaryDirectory(prefix="engine-guard-") as tmp:
        engines = {arm: start_engine(model_dir, workdir=Path(tmp) / arm, max_model_len=1024,
                                     guard=arm == "guarded")
                   for arm in ("guarded", "plain", "plain2")}
        try:
            for e in engines.values():
                e.wait_healthy(900)
            guarded = engines["guarded"]
            r = httpx.get(guarded.base_url + "/v1/models", timeout=30)
            assert r.status_code == 401, f"the guarded engine answered {r.status_code}"
            result: dict[str, Any] = {"routes": compare(engines, a.rounds, a.requests)}
            assert guarded.keys is not None
            result["middleware_alone"] = middleware_alone(guarded.keys.keys_file,
                                                          guarded.api_key)
            print("middleware_alone", json.dumps(result["middleware_alone"]), flush=True)
        finally:
            for e in engines.values():
                e.stop(timeout=30)
    result.update(rounds=a.rounds, requests=a.requests)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
