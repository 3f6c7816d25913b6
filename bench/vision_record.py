"""What images cost the gateway (issue #45): storage per image and call latency with images
against text-only calls, side by side in one run.

Everything real: a Redis of the bench's own, the store on it, vLLM serving the project's tiny
VLM (`harnessrl/model/vision.py`), and one gateway in front of it with the model's processor
folder (`--processor-dirs`), every service authenticated as in a deployment. Calls go one at a
time (httpx, 1 connection), each arm's calls interleaved with the others' in `--rounds`
rounds, so the machine's load falls on every arm alike. Three arms, each asking for 4 tokens at
temperature 0 with the same question:

- `text`: the question alone;
- `image_new`: the question and a freshly drawn PNG (Pillow, 64-96 px, a few hundred bytes)
  in every call: the gateway checks it, stores it (`Store.PutImages`) and records the call;
- `image_large`: a fresh 256 x 256 PNG of random noise in every call (about 197 KB, a
  screenshot's order of size; the engine still resizes it to the model's 64 px);
- `image_seen`: the question and one PNG sent before: the gateway names it to the store
  (`PutImagesRequest.present`) instead of sending its bytes again.

Each call is also sent straight to vLLM with the body the gateway forwards (`logprobs`,
`return_token_ids`), alternating which goes first. The second of a pair is faster (vLLM caches a
processed image by its hash, and a prompt's prefix), so `added_ms` is the mean of the two
orders' medians of (gateway - direct), in which that advantage cancels: what the gateway adds
(authentication, the image checks and hash, storing the image, recording the call before the
answer returns).

Storage, read from the store's Redis with redis-py: per image, the bytes its key takes
(`MEMORY USAGE`, keys and hash overhead included) against its PNG size; per recorded call,
its stored size (`HSTRLEN` of its field in the attempt's calls hash) for text and image calls.

Ends with one JSON line: per arm `p50_ms` (through the gateway), `direct_p50_ms`, `added_ms`
(above), `added_ms_by_order` (the two medians), `call_bytes` (the recorded call, median) and,
for the arms that store images, `image_bytes` (the PNG) and `image_redis_bytes` (median); and
`over_text_added_ms`: each image arm's `added_ms` minus text's.

    python bench/vision_record.py [--rounds 5] [--calls 20]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import io
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis
from PIL import Image as PILImage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _services import bench_pki, running_attempt, start_gateway, start_store  # noqa: E402

from harnessrl import procs  # noqa: E402
from harnessrl.v1 import common_pb2  # noqa: E402

SECRET = "bench-secret-0123456789abcdef0123456789"
QUESTION = "What colour is the shape?"
COLOURS = ("red", "green", "blue", "yellow", "purple")
SHAPES = ("circle", "square", "triangle")
ARMS = ("text", "image_new", "image_large", "image_seen")
NEW = ("image_new", "image_large")  # the arms that store a new image each call


def png(rng: random.Random) -> bytes:
    from harnessrl.model.vision import draw_shape
    picture = draw_shape(rng.choice(COLOURS), rng.choice(SHAPES), rng, rng.randint(64, 96))
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return buf.getvalue()


def noise_png(rng: random.Random, size: int = 256) -> bytes:
    buf = io.BytesIO()
    PILImage.frombytes("RGB", (size, size), rng.randbytes(size * size * 3)).save(buf, "PNG")
    return buf.getvalue()


def body(model: str, image: bytes | None) -> dict[str, Any]:
    content: Any = QUESTION
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        content = [{"type": "text", "text": QUESTION},
                   {"type": "image_url", "image_url": {"url": url}}]
    return {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}


def timed_post(client: httpx.Client, url: str, payload: dict[str, Any],
               headers: dict[str, str]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    resp = client.post(url, json=payload, headers=headers)
    elapsed = (time.perf_counter() - t0) * 1000
    if resp.status_code != 200:
        raise SystemExit(f"vision_record: {url} answered {resp.status_code}: {resp.text[:300]}")
    return elapsed, resp.json()


def added_ms(by_order: tuple[list[float], list[float]]) -> float:
    """The mean of the two orders' medians of (gateway - direct): the second leg's advantage
    from the engine's caches cancels."""
    return (statistics.median(by_order[0]) + statistics.median(by_order[1])) / 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds; each runs every arm")
    p.add_argument("--calls", type=int, default=20, help="calls per arm and round")
    p.add_argument("--seed", type=int, default=45)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    if args.rounds < 1 or args.calls < 2:
        p.error("--rounds must be at least 1 and --calls at least 2 (both orders of a pair)")
    from harnessrl.local.engine import start_engine
    from harnessrl.model.vision import build_vision_model, default_vision_model_dir

    rng = random.Random(args.seed)
    with contextlib.ExitStack() as cleanup:
        work = args.workdir or Path(cleanup.enter_context(tempfile.TemporaryDirectory(
            prefix="vision-record-")))
        started: list[Any] = []
        cleanup.callback(lambda: [proc.stop() for proc in reversed(started)])
        bench_pki(work)
        redis_url, redis_proc = procs.start_redis(work / "redis")
        started.append(redis_proc)
        store_proc, store_addr = start_store(work, redis_url)
        started.append(store_proc)
        model_dir = build_vision_model(default_vision_model_dir())
        print("starting vLLM on", model_dir, flush=True)
        vllm = start_engine(model_dir, workdir=work / "engine", max_model_len=4096)
        started.append(vllm)
        assert vllm.keys is not None
        os.environ["HARNESSRL_ENGINE_API_KEY_FILE"] = str(vllm.keys.api_key_file)
        vllm.wait_healthy(300)
        model = vllm.model_name
        gw_proc, gw = start_gateway(
            work, store_addr, SECRET, [{"name": "vlm", "base_url": vllm.base_url,
                                        "model": model}],
            extra=("--processor-dirs", json.dumps({model: str(model_dir)})))
        started.append(gw_proc)
        gw_url = f"http://127.0.0.1:{gw['http_port']}/v1/chat/completions"
        direct_url = f"{vllm.base_url}/v1/chat/completions"
        rollout = "bench-vision/0"
        gw_headers = {"Authorization": f"Bearer {running_attempt(store_addr, rollout, SECRET)}"}
        direct_headers = {"Authorization": f"Bearer {vllm.api_key}"}
        seen = png(rng)
        client = cleanup.enter_context(httpx.Client(timeout=120))
        # warm-up: the engine's first image and text calls compile and fill caches
        for warm in (None, seen, png(rng)):
            timed_post(client, gw_url, body(model, warm), gw_headers)
            timed_post(client, direct_url, {**body(model, warm), "logprobs": True,
                                            "return_token_ids": True}, direct_headers)
        through: dict[str, list[float]] = {arm: [] for arm in ARMS}
        direct: dict[str, list[float]] = {arm: [] for arm in ARMS}
        added: dict[str, tuple[list[float], list[float]]] = {arm: ([], []) for arm in ARMS}
        stored: dict[str, list[bytes]] = {arm: [] for arm in NEW}
        gw_arms = ["warm"] * 3  # the arm of each call through the gateway, in order
        pairs = dict.fromkeys(ARMS, 0)  # each arm's pairs so far: its orders alternate
        for r in range(args.rounds):
            order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
            for _ in range(args.calls):
                for arm in order:
                    image = {"text": None, "image_seen": seen}.get(arm)
                    if arm in NEW:
                        image = png(rng) if arm == "image_new" else noise_png(rng)
                        stored[arm].append(image)
                    payload = body(model, image)
                    forwarded = {**payload, "logprobs": True, "return_token_ids": True}
                    legs = [("gw", gw_url, payload, gw_headers),
                            ("direct", direct_url, forwarded, direct_headers)]
                    gw_first = pairs[arm] % 2 == 0
                    if not gw_first:
                        legs.reverse()
                    pairs[arm] += 1
                    ms = {name: timed_post(client, url, pl, hd)[0] for name, url, pl, hd in legs}
                    gw_arms.append(arm)
                    through[arm].append(ms["gw"])
                    direct[arm].append(ms["direct"])
                    added[arm][0 if gw_first else 1].append(ms["gw"] - ms["direct"])
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{arm} added {added_ms(added[arm]):.1f} ms" for arm in ARMS), flush=True)
        rds = redis.Redis.from_url(redis_url)
        redis_bytes = {arm: [int(rds.memory_usage(f"hrl:img:{hashlib.sha256(i).hexdigest()}")
                                 or 0) for i in stored[arm]] for arm in NEW}
        if min(min(v) for v in redis_bytes.values()) == 0:
            raise SystemExit("vision_record: an image the gateway answered is not in the store")
        raw_calls: dict[bytes, bytes] = rds.hgetall(f"hrl:calls:{rollout}:1")  # type: ignore[assignment]
        calls = sorted((common_pb2.Call.FromString(v) for v in raw_calls.values()),
                       key=lambda call: call.seq)
        if len(calls) != len(gw_arms):
            raise SystemExit(f"vision_record: {len(calls)} calls recorded, {len(gw_arms)} made")
        call_bytes: dict[str, list[int]] = {arm: [] for arm in ARMS}
        for arm, call in zip(gw_arms, calls):
            if arm != "warm":
                call_bytes[arm].append(call.ByteSize())
        results: dict[str, Any] = {"model": model, "rounds": args.rounds, "calls": args.calls,
                                   "arms": {}}
        for arm in ARMS:
            row = results["arms"][arm] = {
                "p50_ms": round(statistics.median(through[arm]), 2),
                "direct_p50_ms": round(statistics.median(direct[arm]), 2),
                "added_ms": round(added_ms(added[arm]), 2),
                "added_ms_by_order": [round(statistics.median(v), 2) for v in added[arm]],
                "call_bytes": statistics.median(call_bytes[arm])}
            if arm in NEW:
                row["image_bytes"] = statistics.median(len(i) for i in stored[arm])
                row["image_redis_bytes"] = statistics.median(redis_bytes[arm])
        results["over_text_added_ms"] = {
            arm: round(results["arms"][arm]["added_ms"] - results["arms"]["text"]["added_ms"], 2)
            for arm in ARMS if arm != "text"}
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
