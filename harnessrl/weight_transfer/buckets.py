"""Bucket plan shared by the trainer (sender) and the vLLM worker (receiver) of the gloo
weight transport.

Both sides derive the same plan from the same metadata (names, dtypes, shapes in send order)
and the same bucket size, so nothing but the metadata travels over HTTP: the trainer packs
several tensors into one flat uint8 buffer per broadcast, the worker receives that buffer and
cuts it back into named views with the same offsets.

Rules: tensors are taken in order; a bucket is closed before a tensor that would push it past
`bucket_bytes` (so a bucket never exceeds it unless a single tensor is larger, which then
travels alone). A tensor of at least `solo_bytes` (when > 0) travels alone too: the trainer
then sends it straight from its own storage instead of copying it into a bucket (copying is
what costs on a CPU; each extra broadcast costs far less than copying a megabyte). Each tensor
starts at a multiple of `ALIGN` bytes inside its bucket. `bucket_bytes <= 0` means one tensor
per bucket (vLLM's "unpacked" mode).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dataclasses import dataclass

import torch

ALIGN = 64  # bytes; keeps every view aligned for any dtype and for vectorised copies


@dataclass(frozen=True)
class Slot:
    """One tensor inside a bucket."""

    index: int  # position in the metadata (send order)
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset inside the bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]
    nbytes: int  # size of the flat buffer (last slot's end)


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> "float32", the spelling vLLM's update info uses."""
    return str(dtype).removeprefix("torch.")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(names: Sequence[str], dtypes: Sequence[torch.dtype],
                 shapes: Sequence[Sequence[int]], bucket_bytes: int,
                 solo_bytes: int = 0) -> list[Bucket]:
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"metadata lengths differ: {len(names)} names, {len(dtypes)} dtypes, "
                         f"{len(shapes)} shapes")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    end = 0
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        nbytes = math.prod(shape) * dtype.itemsize
        offset = _align(end) if slots else 0
        solo = 0 < solo_bytes <= nbytes
        if slots and (bucket_bytes <= 0 or solo or offset + nbytes > bucket_bytes):
            buckets.append(Bucket(tuple(slots), end))
            slots, offset = [], 0
        slots.append(Slot(i, name, dtype, tuple(int(s) for s in shape), offset, nbytes))
        end = offset + nbytes
        if solo:
            buckets.append(Bucket(tuple(slots), end))
            slots, end = [], 0
    if slots:
        buckets.append(Bucket(tuple(slots), end))
    return buckets


def slot_view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor of `slot` as a view into a flat uint8 bucket buffer."""
    return buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def unpack(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    return [(s.name, slot_view(buffer, s)) for s in bucket.slots]


def pack_into(buffer: torch.Tensor, bucket: Bucket, tensors: Sequence[torch.Tensor]) -> None:
    """Copies `tensors` (one per slot, in order) into their places in the CPU `buffer`.

    Contiguous CPU tensors are copied by numpy (a plain single-threaded memcpy, GIL released):
    torch's copy_ splits large copies over its intra-op threads, which on an oversubscribed
    2-core machine ran 4-15x slower than one thread (OpenMP threads waiting on each other)."""
    raw = buffer.numpy()
    for slot, tensor in zip(bucket.slots, tensors, strict=True):
        t = tensor.detach()
        if t.device.type == "cpu" and t.is_contiguous():
            raw[slot.offset:slot.offset + slot.nbytes] = t.reshape(-1).view(torch.uint8).numpy()
        else:
            slot_view(buffer, slot).copy_(t)
