"""The trainer across several processes: the process group, FSDP2 sharding, and the small set of
collectives the loop and the step use.

A trainer of world size N runs as N processes (ranks), started by `torchrun` or by the service
itself (`--nproc N`, see `launch.py`); each reads the usual torchrun environment (`RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`). At world size 1 nothing here does
anything: no process group, no sharding, the trainer runs exactly as a single process always
did.

At world size N > 1:

- The process group is gloo on CPU and NCCL on GPU (with gloo beside it for the small object
  collectives), over a 1-D device mesh of all ranks.
- The model is sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`): each decoder layer is
  its own unit, then the root (embeddings, final norm, output head: a tied head stays one
  parameter). Parameters become `DTensor`s sharded on dim 0; the optimizer (AdamW) is built
  over them, so its state is sharded too.
- Gradients are *summed* over ranks, not averaged (`set_gradient_divide_factor(1.0)`): every
  rank's loss is already normalised over the whole global batch (see `step.train_step`), so
  the sum of the ranks' gradients is the gradient of the one batch loss.
- On GPU, `mixed_precision` computes in bfloat16 parameters and reduces gradients in float32;
  `activation_checkpointing` recomputes each decoder layer's activations in the backward pass.
  (Neither can run on these CPU machines; they are off by default and untested here.)

`Dist` carries the rank and world size and is passed where collectives happen; `Dist.single()`
is the world of one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger("harnessrl.trainer")

T = TypeVar("T")


@dataclass(frozen=True)
class ShardingConfig:
    """How the model is sharded when the world size is above 1."""

    mixed_precision: bool = False
    """GPU: bfloat16 parameters in forward/backward, float32 gradient reduction (the sharded
    master weights and the optimizer stay in the model's dtype)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~1/3 more
    compute)."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward (ZeRO-3); False keeps them until
    backward (ZeRO-2 like: more memory, one all-gather less per layer)."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the trainer's world."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @staticmethod
    def single() -> "Dist":
        return Dist()

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that talks to the rest of the system."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    # -- collectives (no-ops at world size 1) ------------------------------------------------
    def share(self, items: list[T], lengths: Sequence[int]) -> list[T]:
        """This rank's share of `items` (all of them unsharded), balanced by `lengths`
        (`split_by_tokens`)."""
        if not self.sharded:
            return items
        return [items[i] for i in split_by_tokens(lengths, self.world_size)[self.rank]]

    def agree(self, value: T) -> T:
        """Rank 0's `value` on every rank (a picklable object)."""
        if not self.sharded:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=object_group())
        return box[0]  # type: ignore[return-value]

    def all_gather(self, value: T) -> list[T]:
        """Every rank's `value`, in rank order."""
        if not self.sharded:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=object_group())
        return out

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over ranks, in float64."""
        if not self.sharded:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, group=object_group())
        return t.tolist()

    def max(self, value: int) -> int:
        if not self.sharded:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=object_group())
        return int(t.item())

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier(group=object_group())


_OBJECT_GROUP: Any = None


def object_group() -> Any:
    """A gloo group over all ranks for small CPU collectives, with its own (longer) timeout:
    NCCL cannot carry pickled objects without a device round trip, and the followers wait
    here while rank 0 runs a step's rollouts."""
    return _OBJECT_GROUP


def init_distributed(device: str, timeout_s: float = 600.0,
                     wait_timeout_s: float | None = None) -> Dist:
    """Joins the trainer's process group from the torchrun environment (`RANK`,
    `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`); world size 1 (or no such
    environment): `Dist.single()`, no group. `timeout_s` bounds every collective: a rank that
    died makes the others fail within it rather than hang (a dead peer's closed connections
    usually fail them at once). `wait_timeout_s` (default `timeout_s`) bounds the object
    collectives (`Dist.agree` ...), where the other ranks wait while rank 0 runs a step's
    rollouts: it must exceed the longest such wait."""
    global _OBJECT_GROUP
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Dist.single()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"WORLD_SIZE={world_size} but {missing} not set: start the "
                               "trainer with torchrun, or with --nproc N")
        on_gpu = device.startswith("cuda")
        if on_gpu:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    _OBJECT_GROUP = dist.new_group(backend="gloo", timeout=timedelta(
        seconds=max(timeout_s, wait_timeout_s or 0.0)))
    log.info("rank %d of %d joined the trainer's process group (%s)", rank, world_size,
             dist.get_backend())
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank)


def close_distributed() -> None:
    global _OBJECT_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _OBJECT_GROUP = None


def device_for(device: str, d: Dist) -> str:
    """The rank's own device: `cuda` becomes `cuda:<local_rank>` when sharded."""
    if d.sharded and device == "cuda":
        return f"cuda:{d.local_rank}"
    return device


def shard_model(model: torch.nn.Module, d: Dist, cfg: ShardingConfig | None = None
                ) -> torch.nn.Module:
    """FSDP2 over all ranks (see the module docstring); the model unchanged at world size 1."""
    if not d.sharded:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    cfg = cfg or ShardingConfig()
    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (d.world_size,))
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.mixed_precision:
        if device_type != "cuda":
            raise ValueError("mixed_precision needs the trainer on cuda (bfloat16 compute on "
                             "CPU is not what the engines serve); set it off or device=cuda")
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (`model.model.layers`), or peft's."""
    inner = getattr(getattr(model, "get_base_model", lambda: model)(), "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers to shard; the sharded "
                         "trainer supports Hugging Face decoder-only models (Llama, Qwen, ...)")
    return list(layers)


def split_by_tokens(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Sample indices per rank, balanced by tokens: longest first, each to the rank with the
    fewest tokens so far (ties: the lower rank); each rank's indices in ascending order.
    Deterministic; every rank computes the same split."""
    loads = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += lengths[i]
    return [sorted(p) for p in parts]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter: a collective for a `DTensor`
    (every rank must call it, in the same order), the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
