"""Throughput and peak memory of the trainer's optimizer step for a ~0.5B Qwen3-style model.

Builds the model from a config (random init, nothing from a model hub), makes synthetic
samples shaped like agent rollouts (a prompt, then a completion with recorded behaviour
logprobs), and times `services.trainer.step.train_step` — the trainer's own step: bf16
weights, float32 logprobs and entropy, micro-batching with gradient accumulation, gradient
clipping, AdamW. Ends with one JSON line.

    python bench/gpu_trainer_step.py                 # on a machine with a CUDA GPU
    python bench/gpu_trainer_step.py --cpu-smoke     # a tiny config on CPU: checks the script
    python bench/gpu_trainer_step.py --nproc 8       # sharded (FSDP2) over 8 GPUs of a node
    python bench/gpu_trainer_step.py --cpu-smoke --nproc 2   # the sharded path on CPU (gloo)

`--nproc N` (N > 1) starts N ranks of this script (`services.trainer.launch.RankGroup`; under
torchrun, WORLD_SIZE is set and it runs as one of torchrun's ranks), shards the model with
the trainer's own FSDP2 sharding (`services.trainer.sharding`) and splits each step's samples
across the ranks by tokens, as the trainer does. It needs N GPUs (NCCL cannot put two ranks on
one GPU). Reported: tokens/s over all ranks, MFU (6 x parameters x tokens/s over the ranks'
peak bf16 FLOP/s; attention's quadratic FLOPs are not counted, so MFU is a lower bound), and
peak memory per GPU (each rank's).

With no CUDA GPU and no --cpu-smoke it says so, prints a JSON line with "ran": false, and
exits 0: it never reports CPU figures as GPU ones.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from services.trainer.loss import LossConfig  # noqa: E402
from services.trainer.samples import Sample  # noqa: E402
from services.trainer.sharding import (  # noqa: E402
    ShardingConfig, close_distributed, init_distributed, shard_model, split_by_tokens,
)
from services.trainer.step import StepConfig, make_optimizer, train_step  # noqa: E402

# dense bf16 peak FLOP/s per GPU, for MFU (override with --peak-tflops)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}

# Qwen3-0.6B's shape: 28 layers, hidden 1024, GQA 16/8 heads of 128, tied embeddings
# (about 0.44B parameters without the embeddings, 0.6B with them).
GPU_CONFIG = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
    tie_word_embeddings=True, rope_theta=1_000_000.0,
)
CPU_SMOKE_CONFIG = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
    tie_word_embeddings=True,
)


def synthetic_samples(n: int, prompt_len: int, completion_len: int, vocab: int,
                      seed: int) -> list[Sample]:
    """`n` samples of prompt + completion; half with advantage +1, half -1, two per rollout.
    Behaviour logprobs near a fresh model's (about -log(vocab)) so ratios start near 1."""
    rng = random.Random(seed)
    base = -math.log(vocab)
    samples = []
    for i in range(n):
        p = rng.randint(prompt_len // 2, prompt_len)
        c = rng.randint(completion_len // 2, completion_len)
        samples.append(Sample(
            input_ids=[rng.randrange(vocab) for _ in range(p + c)],
            loss_mask=[0] * p + [1] * c,
            behaviour_logprobs=[0.0] * p + [base + rng.uniform(-0.05, 0.05) for _ in range(c)],
            advantage=1.0 if i % 2 == 0 else -1.0, reward=float(i % 2 == 0),
            rollout_id=f"r{i // 2}",
        ))
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run a tiny config on CPU to check the script (figures mean nothing)")
    ap.add_argument("--samples", type=int, default=64, help="samples per optimizer step")
    ap.add_argument("--prompt-len", type=int, default=512, help="longest prompt (tokens)")
    ap.add_argument("--completion-len", type=int, default=1536, help="longest completion")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--micro-batch-max-tokens", type=int, default=8192,
                    help="padded tokens per forward pass (lower it on an 80 GB GPU if needed)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after 1 warm-up step)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="dtype of weights, activations and optimizer state")
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=1,
                    help="world size: ranks (GPUs) the model is sharded over with FSDP2")
    ap.add_argument("--mixed-precision", action="store_true",
                    help="sharded: float32 master weights, bfloat16 compute, float32 reduction "
                         "(with --dtype fp32)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak bf16 TFLOP/s of one GPU for MFU (default: from the GPU's name)")
    args = ap.parse_args()

    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        if not args.cpu_smoke and torch.cuda.device_count() < args.nproc:
            print(f"gpu_trainer_step: --nproc {args.nproc} needs {args.nproc} CUDA GPUs, this "
                  f"machine has {torch.cuda.device_count()}; nothing measured", file=sys.stderr)
            print(json.dumps({"bench": "gpu_trainer_step", "ran": False, "nproc": args.nproc,
                              "reason": f"{torch.cuda.device_count()} CUDA GPUs"}))
            return 0
        from services.trainer.launch import RankGroup

        return RankGroup([sys.executable, __file__, *sys.argv[1:]], args.nproc).start().wait()

    if args.cpu_smoke:
        device, cfg = torch.device("cpu"), CPU_SMOKE_CONFIG
        args.samples, args.prompt_len, args.completion_len = 8, 24, 40
        args.micro_batch_size, args.micro_batch_max_tokens, args.steps = 3, None, 2
        dtype = torch.float32
    elif torch.cuda.is_available():
        device, cfg = torch.device("cuda"), GPU_CONFIG
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    else:
        print("gpu_trainer_step: no CUDA GPU on this machine; nothing measured "
              "(use --cpu-smoke to check that the script runs)", file=sys.stderr)
        print(json.dumps({"bench": "gpu_trainer_step", "ran": False,
                          "reason": "no CUDA GPU available"}))
        return 0

    d = init_distributed(device.type, timeout_s=600)
    if d.sharded and device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the cores
    elif d.sharded:
        device = torch.device(f"cuda:{d.local_rank}")
    torch.manual_seed(args.seed)
    config = Qwen3Config(**cfg)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    if d.sharded:
        model = shard_model(model, d, ShardingConfig(
            mixed_precision=args.mixed_precision,
            activation_checkpointing=args.grad_checkpointing))
    elif args.grad_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = make_optimizer(model, lr=args.lr)
    step_cfg = StepConfig(loss=LossConfig(), micro_batch_size=args.micro_batch_size,
                          micro_batch_max_tokens=args.micro_batch_max_tokens, max_grad_norm=1.0)

    timings = []
    for step in range(args.steps + 1):
        samples = synthetic_samples(args.samples, args.prompt_len, args.completion_len,
                                    config.vocab_size, seed=args.seed * 1000 + step)
        if device.type == "cuda" and step == 1:
            torch.cuda.reset_peak_memory_stats(device)
        if d.sharded:  # this rank's share, balanced by tokens, as the trainer splits
            mine = split_by_tokens([len(x) for x in samples], d.world_size)[d.rank]
            samples = [samples[i] for i in mine]
        t0 = time.perf_counter()
        m = train_step(model, optimizer, samples, step_cfg, d)
        wall = time.perf_counter() - t0
        if not math.isfinite(m.loss) or not math.isfinite(m.grad_norm):
            raise RuntimeError(f"step {step}: non-finite loss {m.loss} / grad norm {m.grad_norm}")
        if d.is_main:
            print(f"step {step}{' (warm-up)' if step == 0 else ''}: {m.input_tokens} tokens "
                  f"({m.tokens} trained) in {wall:.3f} s, {m.micro_batches} micro-batches, "
                  f"loss {m.loss:.4f} kl {m.kl:.2e} grad_norm {m.grad_norm:.3f}",
                  file=sys.stderr)
        if step > 0:
            timings.append((wall, m.input_tokens, m.tokens))

    total_s = sum(t for t, _, _ in timings)
    peaks = d.all_gather(torch.cuda.max_memory_allocated(device) / 2**30
                         if device.type == "cuda" else None)
    tokens_per_s = sum(n for _, n, _ in timings) / total_s
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    mfu = (6 * n_params * tokens_per_s / (peak * 1e12 * d.world_size)
           if peak and device.type == "cuda" else None)
    close_distributed()
    if not d.is_main:
        return 0
    result = {
        "bench": "gpu_trainer_step",
        "ran": True,
        "smoke": args.cpu_smoke,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "logprob_dtype": "float32",
        "params": n_params,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "vocab": config.vocab_size,
        "samples_per_step": args.samples,
        "micro_batch_size": args.micro_batch_size,
        "micro_batch_max_tokens": args.micro_batch_max_tokens,
        "grad_checkpointing": args.grad_checkpointing,
        "timed_steps": len(timings),
        "step_time_s": total_s / len(timings),
        "world_size": d.world_size,
        "mixed_precision": args.mixed_precision,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / d.world_size,
        "mfu": mfu,
        "peak_tflops_per_gpu": peak,
        "trained_tokens_per_s": sum(n for _, _, n in timings) / total_s,
        "peak_memory_gib": peaks[0],
        "peak_memory_gib_per_rank": peaks,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
