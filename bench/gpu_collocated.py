"""Collocated training on one GPU, with torch alone: the trainer's offload and onload, a CUDA
IPC weight push into a second process on the same GPU, and that process freeing and
re-allocating a KV-cache-sized buffer for sleep and wake (docs/modes.md, "One device pool").

The machine this runs on has torch and CUDA but no vLLM, so the "engine" is a child process
that holds what vLLM holds (the model's weights and a KV cache of `--engine-util` of the device
minus the weights) and does what vLLM's sleep API and `ipc` weight-transfer backend do:
level-1 sleep (weights copied to host memory, KV cache freed), wake by tag, and loading weights
from the trainer's IPC handles (`reduce_tensor` args keyed by the GPU's UUID, as
harnessrl.weight_transfer.transports.IpcTransport sends them and vLLM's `ipc_engine` rebuilds
them). The trainer side runs the project's own `services.trainer.offload.TrainerOffload` on a
~0.5B decoder (Qwen3-0.6B's shape, random init, float32 weights and AdamW state).

One collocated step, in the trainer's order (services/trainer/collocation.py): engine sleeps ->
trainer onloads -> one optimizer step -> trainer offloads its optimizer state -> engine wakes its
weights -> IPC push -> trainer offloads its parameters -> engine wakes its KV cache. For each
phase: its time, the device's peak memory in use (all processes, polled every 2 ms with
`torch.cuda.mem_get_info`), and a check against what the settings promise: during rollouts the
trainer holds nothing on the device, during the step the engine holds nothing, during the push
only the engine's weights and the trainer's parameters; the device never holds both sides'
full memory. Ends with one JSON line; without CUDA it prints {"ran": false} and exits 0.

    python bench/gpu_collocated.py                      # on a CUDA GPU, about a minute
    python bench/gpu_collocated.py --layers 4 --engine-util 0.3   # smaller and quicker
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

GIB = 1024 ** 3
SLACK = int(1.5 * GIB)  # CUDA contexts (about 0.5 GiB each), allocator rounding, the stream


class Block(nn.Module):
    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 2 * ff, bias=False), nn.Linear(ff, d, bias=False)
        self.heads = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        g, u = self.up(self.norm2(x)).chunk(2, -1)
        return x + self.down(nn.functional.silu(g) * u)


class Decoder(nn.Module):
    """Qwen3-0.6B's shape by default (28 layers, hidden 1024, vocab 151,936, tied head)."""

    def __init__(self, vocab: int, d: int, ff: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, ff) for _ in range(layers))
        self.norm = nn.RMSNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x) @ self.embed.weight.T


def engine_main(conn: Any, shapes: list[tuple[str, list[int]]], kv_bytes: int) -> None:
    """The child: vLLM's part (weights + KV cache, sleep/wake, loading IPC handles)."""
    dev = torch.device("cuda", 0)
    weights = {n: torch.zeros(s, device=dev) for n, s in shapes}
    held: dict[str, torch.Tensor | None] = {  # the KV cache, allocated while awake
        "kv": torch.empty(kv_bytes, dtype=torch.uint8, device=dev)}
    host: dict[str, torch.Tensor] = {}
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    while True:
        op, arg = conn.recv()
        t0 = time.perf_counter()
        if op == "sleep":  # level 1: weights to host memory, KV cache discarded
            host = {n: w.to("cpu") for n, w in weights.items()}
            weights, held["kv"] = {}, None
            torch.cuda.empty_cache()  # vLLM's sleep unmaps the memory: the device gets it
        elif op == "wake_weights":
            weights = {n: h.to(dev) for n, h in host.items()}
            host = {}
        elif op == "wake_kv":
            held["kv"] = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
        elif op == "load":  # vLLM's ipc_engine.receive_weights, then load_weights
            import base64
            import pickle

            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            for name, handle in zip(arg["names"], pickle.loads(base64.b64decode(
                    arg["ipc_handles_pickled"]))):
                args = list(handle[uuid])
                args[6] = 0  # the receiver's device index
                weights[name].copy_(rebuild_cuda_tensor(*args))
            torch.cuda.synchronize()
        elif op == "checksum":
            sums = {n: float(w.double().sum()) for n, w in weights.items()}
            torch.cuda.empty_cache()
            conn.send(sums)
            continue
        elif op == "stop":
            conn.send(None)
            return
        torch.cuda.synchronize()
        conn.send({"s": time.perf_counter() - t0, "allocated": torch.cuda.memory_allocated()})


class DevicePeak:
    """The device's memory in use (every process), polled in a thread; `phase()` resets."""

    def __init__(self) -> None:
        self.total = torch.cuda.mem_get_info()[1]
        self.peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:  # a reading and its update, never across a phase() reset
                self.peak = max(self.peak, self.used())
            time.sleep(0.002)

    def phase(self) -> None:
        with self._lock:
            self.peak = self.used()

    def close(self) -> None:
        self._stop.set()
        self._t.join()


def ipc_payload(params: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """What IpcTransport.update_info sends (names, pickled handles). Rewritten here, since the
    device machine's Python has no pydantic (which harnessrl.weight_transfer imports); like
    IpcTransport it references nothing after the engine's load (`finished`), so the trainer's
    offload frees the parameters."""
    import base64
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.synchronize()
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    handles = [{uuid: reduce_tensor(t.detach().contiguous())[1]} for _, t in params]
    return {"names": [n for n, _ in params],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--engine-util", type=float, default=0.85,
                    help="the engine's --gpu-memory-utilization: weights + KV cache")
    ap.add_argument("--seq", type=int, default=512, help="tokens in the step's batch row")
    ap.add_argument("--batch", type=int, default=2)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"ran": False, "why": "no CUDA device"}))
        return 0
    from services.trainer.offload import TrainerOffload

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    peak = DevicePeak()
    base = peak.used()  # this process's context
    model = Decoder(a.vocab, a.hidden, a.ff, a.layers).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    params = [(n, p) for n, p in model.named_parameters()]
    n_params = sum(p.numel() for _, p in params)
    param_bytes = sum(p.numel() * p.element_size() for _, p in params)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)

    def step() -> float:
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, a.vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    peak.phase()
    step()  # the optimizer state exists from here on (AdamW: two moments a parameter)
    torch.cuda.synchronize()
    step_peak = peak.peak - base  # parameters, moments, gradients and activations at once
    torch.cuda.empty_cache()
    trainer_full = peak.used() - base
    off = TrainerOffload(dev, True)
    off.offload_optimizer(model, opt)
    off.offload_params(model)
    trainer_idle = peak.used() - base

    kv_bytes = int(a.engine_util * peak.total) - param_bytes
    ctx = torch.multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=engine_main, args=(
        child, [(n, list(p.shape)) for n, p in params], kv_bytes), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    conn.send(("checksum", None))
    conn.recv()  # the engine holds its weights and KV cache
    engine_start_s = time.perf_counter() - t0
    engine_full = peak.used() - base - trainer_idle

    phases: dict[str, dict[str, float]] = {}

    def phase(name: str, fn: Any) -> Any:
        peak.phase()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        phases[name] = {"s": round(time.perf_counter() - t, 4),
                        "peak_used_gib": round(peak.peak / GIB, 3)}
        return out

    def engine(op: str, arg: Any = None) -> Any:
        conn.send((op, arg))
        return conn.recv()

    phases["rollouts"] = {"s": 0.0, "peak_used_gib": round(peak.used() / GIB, 3)}
    phase("engine_sleep", lambda: engine("sleep"))
    phase("trainer_onload", lambda: off.onload(model, opt))
    loss = phase("trainer_step", step)
    phase("trainer_offload_optimizer", lambda: off.offload_optimizer(model, opt))
    phase("engine_wake_weights", lambda: engine("wake_weights"))
    phase("ipc_push", lambda: engine("load", ipc_payload(params)))
    sums = engine("checksum")
    pushed_ok = all(abs(sums[n] - float(p.detach().double().sum())) <= 1e-6 * max(
        1.0, abs(sums[n])) for n, p in params)
    phase("trainer_offload_params", lambda: off.offload_params(model))
    phase("engine_wake_kv", lambda: engine("wake_kv"))
    engine("stop")
    proc.join(30)
    peak.close()

    ctx_bytes = base + SLACK
    promise = {  # phase -> what the device may hold at most (both processes' contexts aside)
        "rollouts": engine_full + trainer_idle,
        "engine_sleep": engine_full + trainer_idle,
        "trainer_onload": trainer_full,
        "trainer_step": step_peak,  # as the first step measured it, the engine asleep
        "trainer_offload_optimizer": trainer_full,
        "engine_wake_weights": 2 * param_bytes,
        "ipc_push": 2 * param_bytes,
        "trainer_offload_params": 2 * param_bytes,
        "engine_wake_kv": engine_full + param_bytes,
    }
    checks = {name: phases[name]["peak_used_gib"] * GIB <= promise[name] + 2 * ctx_bytes
              for name in promise}
    both_full = engine_full + trainer_full
    never_both = all(p["peak_used_gib"] * GIB < both_full for p in phases.values())
    out = {
        "ran": True, "device": torch.cuda.get_device_name(0),
        "device_gib": round(peak.total / GIB, 1), "parameters": n_params,
        "param_gib": round(param_bytes / GIB, 3),
        "trainer_full_gib": round(trainer_full / GIB, 3),
        "trainer_step_peak_gib": round(step_peak / GIB, 3),
        "trainer_idle_gib": round(trainer_idle / GIB, 3),
        "engine_full_gib": round(engine_full / GIB, 3), "kv_gib": round(kv_bytes / GIB, 3),
        "engine_start_s": round(engine_start_s, 2), "loss": round(loss, 4),
        "offload_s": {k: round(v, 4) for k, v in off.seconds.items()},
        "phases": phases, "within_budget": checks, "never_both_full": never_both,
        "push_matches": pushed_ok,
        "ok": all(checks.values()) and never_both and pushed_ok,
    }
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
