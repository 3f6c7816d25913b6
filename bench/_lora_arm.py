"""The LoRA arm of `python bench/weight_sync.py --lora`, on the model the full-weight arm pushed, in
the same run (docs/lora.md):

1. adapter push time: each version is written as a PEFT folder by the trainer's own save
   (`services.trainer.lora.save_adapter`) and loaded into a LoRA vLLM (`--enable-lora`) by the
   trainer's own load call (`AdapterWeights.load_one`: `POST /v1/load_lora_adapter`, a new
   name and path per version); a one-token completion through the new adapter checks that it
   serves. Median of `--pushes`, set against the full-weight arm's `transfer_ms` on the same
   model. Not in it: the gateway's `SetAdapter` (one gRPC call) and the clean-up of replaced
   versions, which a push also makes.
2. trainer peak memory: one process per arm (a process's peak would hide the other's) loads
   the model, wraps it with LoRA (rank `--lora-rank`, every linear layer of Qwen3) or not,
   makes the trainer's optimizer (`make_optimizer`) and runs the trainer's `train_step` twice
   on the same samples (the AdamW state exists after the first); its peak RSS (`ru_maxrss`).
   At two batches: a step's worth (8 x 512 tokens), where the step's activations dominate, and
   a small one (1 x 64), where the weights' own state does (gradients and AdamW moments: what
   LoRA saves).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.weight_transfer.devtools import VllmServer

# the peak-memory arms' batches (samples, tokens each): a step's worth, and a small one
BATCHES = {"step": (8, 512), "small": (1, 64)}


def _peak_rss(model_dir: str, lora_rank: int, batch: tuple[int, int], out: Any) -> None:
    from transformers import Qwen3ForCausalLM

    from services.trainer import lora
    from services.trainer.samples import Sample
    from services.trainer.step import StepConfig, make_optimizer, train_step

    model: Any = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora_rank:
        model = lora.apply_lora(model, lora.LoraConfig(rank=lora_rank))
    trainable, total = lora.trainable_fraction(model)
    loaded_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    opt = make_optimizer(model, lr=1e-5)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    n, tokens = batch
    half = tokens // 2
    samples = [Sample(input_ids=[rng.randrange(vocab) for _ in range(tokens)],
                      loss_mask=[0] * half + [1] * half,
                      behaviour_logprobs=[0.0] * half + [-5.0] * half,
                      advantage=1.0 if i % 2 else -1.0, reward=float(i % 2), rollout_id=f"r{i}")
               for i in range(n)]
    t = time.perf_counter()
    for _ in range(2):
        train_step(model, opt, samples, StepConfig())
    out.put({"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
             "after_load_rss_mb": round(loaded_kb / 1024, 1),
             "trainable_params": trainable, "params": total,
             "two_steps_s": round(time.perf_counter() - t, 2)})


def peak_memory(model_dir: Path, lora_rank: int, batch: tuple[int, int]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_peak_rss, args=(str(model_dir), lora_rank, batch, q))
    p.start()
    try:
        res: dict[str, Any] = q.get(timeout=1800)
    finally:
        p.join(timeout=60)
    return res


def adapter_pushes(model_dir: Path, workdir: Path, lora_rank: int, pushes: int,
                   start_timeout: float) -> dict[str, Any]:
    from transformers import Qwen3ForCausalLM

    from services.trainer import lora
    from services.trainer.adapter_push import AdapterWeights

    model = lora.apply_lora(Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                            lora.LoraConfig(rank=lora_rank))
    root = workdir / "adapters" / "bench"
    loader = AdapterWeights(admin=None)  # type: ignore[arg-type] - only its engine call is used
    save_s, load_s, total_s, sizes = [], [], [], []
    args = ("--enable-lora", "--max-lora-rank", str(max(16, lora_rank)), "--max-loras", "2")
    with VllmServer(model_dir, workdir / "lora-run", max_model_len=512, extra_args=args,
                    extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
                    start_timeout=start_timeout) as server:
        engine = gpb.Engine(name="e0", base_url=server.base_url)
        for v in range(pushes + 1):  # the first one warms up
            with torch.no_grad():  # a new policy each time: B starts at zero
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.add_(0.001)
            path = root / f"v{v}-{v:08x}"
            t0 = time.perf_counter()
            lora.save_adapter(model, path)
            t1 = time.perf_counter()
            loader.load_one(engine, AdapterWeights.lora_name(path), str(path), retry=False)
            t2 = time.perf_counter()
            r = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
                "model": AdapterWeights.lora_name(path), "prompt": [0, 5, 9], "max_tokens": 1})
            r.raise_for_status()
            if v:
                save_s.append(t1 - t0)
                load_s.append(t2 - t1)
                total_s.append(t2 - t0)
                sizes.append(sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
            print(f"[lora] push {v}: save {(t1 - t0) * 1e3:.1f} ms, load {(t2 - t1) * 1e3:.1f} "
                  f"ms{' (warm-up)' if not v else ''}", flush=True)
    loader.http.close()
    return {"adapter_push_ms": round(statistics.median(total_s) * 1e3, 2),
            "adapter_save_ms": round(statistics.median(save_s) * 1e3, 2),
            "adapter_load_ms": round(statistics.median(load_s) * 1e3, 2),
            "adapter_bytes": int(statistics.median(sizes))}


def bench_lora(model_dir: Path, workdir: Path, full_transfer_ms: float, lora_rank: int,
               pushes: int, start_timeout: float) -> dict[str, Any]:
    """The figures of the module docstring, with the two ratios: full-weight push time over
    adapter push time, and LoRA's trainer peak memory over full fine-tuning's."""
    push = adapter_pushes(model_dir, workdir, lora_rank, pushes, start_timeout)
    out: dict[str, Any] = {
        **push, "lora_rank": lora_rank, "full_transfer_ms": full_transfer_ms,
        "full_over_adapter_push": round(full_transfer_ms / push["adapter_push_ms"], 2),
        "trainer_peak_rss_mb": {}, "lora_over_full_peak_rss": {}, "memory_arms": {}}
    print(f"[lora] adapter push {push['adapter_push_ms']} ms vs full push {full_transfer_ms} "
          "ms", flush=True)
    for kind, batch in BATCHES.items():
        full, adapted = peak_memory(model_dir, 0, batch), peak_memory(model_dir, lora_rank, batch)
        print(f"[lora] {kind} batch {batch[0]} x {batch[1]}: trainer peak RSS "
              f"{adapted['peak_rss_mb']} MB (LoRA) vs {full['peak_rss_mb']} MB (full)",
              flush=True)
        out["trainer_peak_rss_mb"][kind] = {"full": full["peak_rss_mb"],
                                            "lora": adapted["peak_rss_mb"], "batch": batch}
        out["lora_over_full_peak_rss"][kind] = round(adapted["peak_rss_mb"]
                                                     / full["peak_rss_mb"], 3)
        out["memory_arms"][kind] = {"full": full, "lora": adapted}
        out["trainable_fraction"] = round(adapted["trainable_params"] / adapted["params"], 5)
    return out
