"""The weight push from a model sharded over several trainer processes (FSDP2 `DTensor`
parameters).

Only rank 0 talks to the engines; the other ranks hold shards it needs. The full tensors are
gathered *bucket by bucket*, when the transport reaches them:

- rank 0 pushes a `GatheredWeights` (a sequence of (name, full tensor) that the pusher and
  the transports take like any other): its metadata (names, dtypes, global shapes) needs no
  gathering; reading a tensor gathers the whole gather bucket that holds it — rank 0 tells
  the other ranks which bucket (a broadcast), every rank calls `DTensor.full_tensor()` on the
  bucket's parameters in the same order — and keeps only that bucket. So rank 0 holds at most
  one bucket of full tensors (`bucket_bytes`, or one tensor when a single one is larger)
  besides its shards, whatever the model's size.
- every other rank runs `follow_gathers` for the same push: it answers rank 0's bucket
  requests until rank 0 closes the push (`GatheredWeights.close()`, also after a failure).

Retries and several engines need nothing special: each read of a bucket not held is one more
round of the same protocol (engines pushed concurrently may gather a bucket once each).
Tied parameters appear under every name (`remove_duplicate=False`), as in `weights_of`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from harnessrl.weight_transfer.buckets import plan_buckets

_DONE = -1


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _named_params(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False)]


def gather_plan(params: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[int]]:
    """Indices of `params` per gather bucket (global sizes; every rank computes the same)."""
    buckets = plan_buckets([n for n, _ in params], [t.dtype for _, t in params],
                           [tuple(t.shape) for _, t in params], bucket_bytes)
    return [[s.index for s in b.slots] for b in buckets]


class GatheredWeights(Sequence[tuple[str, torch.Tensor]]):
    """Rank 0's view of a sharded model's weights as full tensors, gathered bucket by bucket
    (see the module docstring). Use as a context manager, or call `close()` when the push is
    over: the other ranks wait in `follow_gathers` until then."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int, group: Any = None) -> None:
        self._params = _named_params(model)
        self._plan = gather_plan(self._params, bucket_bytes)
        self._bucket_of = {i: b for b, idx in enumerate(self._plan) for i in idx}
        self._group = group
        self._lock = threading.Lock()
        self._held: dict[int, torch.Tensor] = {}
        self._closed = False
        self.gathers = 0
        """Buckets gathered so far."""
        self.peak_bytes = 0
        """Most bytes of full tensors held at once."""

    @property
    def meta(self) -> tuple[list[str], list[torch.dtype], list[tuple[int, ...]]]:
        """Names, dtypes and full shapes, without gathering anything."""
        return ([n for n, _ in self._params], [t.dtype for _, t in self._params],
                [tuple(t.shape) for _, t in self._params])

    def __len__(self) -> int:
        return len(self._params)

    def __getitem__(self, i: int) -> tuple[str, torch.Tensor]:  # type: ignore[override]
        with self._lock:
            if i not in self._held:
                if self._closed:
                    raise RuntimeError("GatheredWeights read after close()")
                b = self._bucket_of[i]
                self._held = {}  # drop the previous bucket before gathering the next
                _announce(b, self._group)
                self._held = {j: _full(self._params[j][1]) for j in self._plan[b]}
                self.gathers += 1
                self.peak_bytes = max(self.peak_bytes, sum(
                    t.numel() * t.element_size() for t in self._held.values()))
            return self._params[i][0], self._held[i]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        """Ends the push for the other ranks (idempotent)."""
        with self._lock:
            if not self._closed:
                self._closed, self._held = True, {}
                _announce(_DONE, self._group)

    def __enter__(self) -> "GatheredWeights":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def follow_gathers(model: torch.nn.Module, bucket_bytes: int, group: Any = None) -> int:
    """A non-zero rank's part of a push: gathers the buckets rank 0 asks for, until it closes
    the push. Returns the number of buckets gathered."""
    params = _named_params(model)
    plan = gather_plan(params, bucket_bytes)
    n = 0
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        b = int(box[0])
        if b == _DONE:
            return n
        for j in plan[b]:
            _full(params[j][1])
        n += 1


def _announce(bucket: int, group: Any) -> None:
    dist.broadcast_object_list([bucket], src=0, group=group)
