"""vLLM worker side of the gloo weight transport (loaded inside vLLM through our plugin).

Mirrors vLLM's dense NCCL engine (`vllm.distributed.weight_transfer.nccl_engine`) so a trainer
drives both the same way: `init_transfer_engine` joins a process group with the trainer
(trainer rank 0, this worker `rank_offset` + its global rank); the per-round update info is
the same `names` / `dtype_names` / `shapes` metadata; `start_weight_update` and
`finish_weight_update` run vLLM's layerwise reload; `receive_weights` receives the buckets the
trainer broadcasts and feeds them, as they arrive, to one `model.load_weights` call (applying
bucket k while the next ones travel). The bucket plan is derived on both sides from the
metadata (`harnessrl.weight_transfer.buckets`).

Each update is timed here (`RoundTiming`: set-up, receive+apply and the part of it spent
waiting for bytes, finalisation), logged, and readable through vLLM's `/collective_rpc`
(`__call__`), which can also re-apply one push's buckets from memory: the engine's share of a
push's floor (`bench/weight_sync.py`, docs/weight-sync.md).

The group is a gloo group from `stateless_init_torch_distributed_process_group`; tensors are
received with the group object's own `broadcast(tensor, 0).wait()` (the
`torch.distributed.broadcast(group=...)` form does not work for such groups).

Failure: if a receive fails (the trainer died or raised mid-push, a timeout), the layerwise
reload is finalised so that no layer is left on the meta device (the engine stays memory-safe,
but holds a mix of old and new weights), the group is dropped, and the error propagates to the
HTTP caller. The trainer must then mark the engine and re-run `/init_weight_transfer_engine`
and a full push.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from harnessrl.weight_transfer.buckets import Bucket, dtype_from_name, plan_buckets, unpack

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Under the "vllm" logger, so it goes where vLLM logs (vLLM configures only that tree).
log = logging.getLogger("vllm.plugins.harnessrl_gloo")

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
DEFAULT_NUM_BUFFERS = 8


@contextmanager
def _threads_on_every_cpu() -> Iterator[None]:
    """Threads started inside may run on every CPU this process may use.

    vLLM's CPU worker pins itself (`VLLM_CPU_OMP_THREADS_BIND=auto`: its cores for generation,
    the others reserved for its other processes), and threads inherit their creator's CPUs.
    Gloo's threads, started with the group, would then receive on the very core that applies
    the received weights, and the two could not overlap. They only work during a push, while
    generation is paused, so they get every CPU; the calling thread is pinned back after."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    every = set(range(os.cpu_count() or 1))
    try:
        os.sched_setaffinity(0, every)
    except OSError:  # a cpuset may forbid some; keep vLLM's binding then
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass
class RoundTiming:
    """One weight update as the engine saw it (milliseconds, measured in the worker)."""

    start_ms: float = 0.0  # /start_weight_update: layerwise-reload set-up
    receive_ms: float = 0.0  # /update_weights: receiving and applying, overlapped
    wait_ms: float = 0.0  # of receive_ms: blocked waiting for a bucket to arrive
    finish_ms: float = 0.0  # /finish_weight_update: layerwise-reload finalisation
    bytes: int = 0
    buckets: int = 0

    def __str__(self) -> str:
        return (f"{self.bytes / 1e6:.1f} MB in {self.buckets} buckets: start "
                f"{self.start_ms:.1f} ms, receive+apply {self.receive_ms:.1f} ms (waiting "
                f"{self.wait_ms:.1f} ms), finish {self.finish_ms:.1f} ms")


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init info; same rendezvous fields and wire params as vLLM's NCCL one."""

    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int
    packed: bool = True  # False: one tensor per broadcast
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES  # bucket size
    solo_bytes: int = 0  # tensors at least this large travel alone (see buckets.py)
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS  # receives kept in flight
    timeout_s: float = 300.0  # gloo timeout for the rendezvous and each broadcast


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-round metadata, identical to vLLM's `NCCLWeightTransferUpdateInfo`."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"update info lengths differ: {len(self.names)} names, "
                             f"{len(self.dtype_names)} dtype_names, {len(self.shapes)} shapes")


class GlooWeightTransferEngine(
    WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]
):
    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: "VllmConfig",
                 device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.init_info: GlooWeightTransferInitInfo | None = None
        self._reload_active = False
        self._round: RoundTiming | None = None  # the update in progress
        self.last_round: RoundTiming | None = None  # the last one finished
        self._keep_next = False
        self._kept: list[tuple[Bucket, torch.Tensor]] = []

    # -- lifecycle --------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        if self.group is not None:  # a trainer re-joining (after a failure or a restart)
            self.shutdown()
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        log.info("gloo weight transfer: joining %s:%d as rank %d of %d",
                 init_info.master_address, init_info.master_port, rank, init_info.world_size)
        with _threads_on_every_cpu():  # gloo's threads are started here
            self.group = stateless_init_torch_distributed_process_group(
                init_info.master_address, init_info.master_port, rank, init_info.world_size,
                backend="gloo", timeout=timedelta(seconds=init_info.timeout_s))
        self.init_info = init_info

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        t = time.perf_counter()
        initialize_layerwise_reload(self.model)
        self._reload_active = True
        self._round = RoundTiming(start_ms=(time.perf_counter() - t) * 1e3)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        self._reload_active = False
        r = self._round or RoundTiming()
        r.finish_ms = (time.perf_counter() - t) * 1e3
        self.last_round, self._round = r, None
        log.info("gloo weight transfer: %s", r)

    def shutdown(self) -> None:
        """Drops the group. A gloo group's connections close when the last reference to it
        goes (`ProcessGroup.shutdown()` alone leaves them open, and the peer blocked)."""
        group, self.group = self.group, None
        if group is not None:
            from vllm.distributed.utils import (
                stateless_destroy_torch_distributed_process_group,
            )

            try:
                stateless_destroy_torch_distributed_process_group(group)
            except Exception:  # already broken by a failed collective
                log.exception("gloo weight transfer: shutting the group down failed")
            del group

    # -- receive ----------------------------------------------------------------------------

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # As the base class, but the device sync only where there is an accelerator (the base
        # class's unconditional `torch.accelerator.synchronize()` raises on a plain CPU).
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None or self.init_info is None:
            raise RuntimeError("gloo weight transfer not initialised: call "
                               "/init_weight_transfer_engine first")
        info = self.init_info
        plan = plan_buckets(update_info.names,
                            [dtype_from_name(d) for d in update_info.dtype_names],
                            update_info.shapes,
                            info.packed_buffer_size_bytes if info.packed else 0,
                            info.solo_bytes)
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        try:
            with disable_mtp_completeness_check():
                self._receive(plan, max(1, info.packed_num_buffers))
        except BaseException:
            log.exception("gloo weight transfer: receive failed; the model now holds a mix of "
                          "old and new weights until a full push succeeds")
            self._abandon()
            raise

    def _receive(self, plan: list[Bucket], depth: int) -> None:
        """Keeps up to `depth` broadcasts in flight while the model loads what has arrived.

        One `load_weights` call consumes a generator that yields each bucket's tensors as
        its broadcast completes (vLLM's loader walks its input lazily), so bucket k is
        applied while buckets k+1.. travel. Each bucket gets a fresh buffer: layerwise
        reload keeps views of the received tensors until their layer is complete, which
        may be several buckets later."""
        in_flight: deque[tuple[Bucket, torch.Tensor, Any]] = deque()
        todo = iter(plan)
        r = self._round if self._round is not None else RoundTiming()
        self._round = r
        keep = self._keep_next
        self._keep_next = False
        kept: list[tuple[Bucket, torch.Tensor]] = []
        received = 0

        def post() -> None:
            bucket = next(todo, None)
            if bucket is not None:
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
                in_flight.append((bucket, buf, self.group.broadcast(buf, 0)))

        def arrivals() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal received
            for _ in range(depth):
                post()
            while in_flight:
                bucket, buf, work = in_flight.popleft()
                t0 = time.perf_counter()
                work.wait()
                r.wait_ms += (time.perf_counter() - t0) * 1e3
                del work
                post()
                received += 1
                r.bytes += bucket.nbytes
                r.buckets += 1
                if keep:
                    kept.append((bucket, buf))
                yield from unpack(buf, bucket)

        t = time.perf_counter()
        try:
            self.model.load_weights(arrivals())
            if in_flight or received != len(plan):
                raise RuntimeError(f"the model's loader stopped after {received} of "
                                   f"{len(plan)} buckets")
        except BaseException:
            # Pending works keep the group (and its connections) alive; the traceback keeps
            # this frame. Drop them so that closing the group closes the connections and the
            # trainer's side fails at once instead of at its timeout.
            in_flight.clear()
            kept.clear()
            raise
        r.receive_ms = (time.perf_counter() - t) * 1e3
        if keep:
            self._kept = kept

    # -- measurements (POST /collective_rpc {"method": "weight_transfer_engine", ...}) -------

    def __call__(self, op: str, reps: str = "3") -> Any:
        """Entry point for vLLM's `/collective_rpc`: it calls a worker attribute by name, and
        this engine is the worker's `weight_transfer_engine`. Operations (kwargs arrive as
        strings):

        - `stats`: the last weight update's timings (`RoundTiming`), measured in here;
        - `keep_next`: the next update keeps its received buckets in memory;
        - `apply_kept` (`reps`): applies the kept buckets `reps` times from memory through the
          same load path as an update (layerwise-reload set-up, `load_weights`, finalisation),
          without any transfer, and drops them: the engine's share of a push's floor. Run it
          while the engine is paused; the weights it applies are the ones it already holds.
        """
        if op == "stats":
            return asdict(self.last_round) if self.last_round is not None else None
        if op == "keep_next":
            self._keep_next = True
            return None
        if op == "apply_kept":
            return self._apply_kept(int(reps))
        raise ValueError(f"unknown weight_transfer_engine op {op!r}; "
                         "known: stats, keep_next, apply_kept")

    def _apply_kept(self, reps: int) -> dict[str, Any]:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        kept, self._kept = self._kept, []
        if not kept:
            raise RuntimeError("nothing kept: call keep_next, then push")
        if self._reload_active:
            raise RuntimeError("a weight update is in progress")
        rounds = []
        try:
            for _ in range(max(1, reps)):
                self.start_weight_update()
                t = time.perf_counter()
                with disable_mtp_completeness_check():
                    self.model.load_weights(
                        (n, v) for bucket, buf in kept for n, v in unpack(buf, bucket))
                assert self._round is not None
                self._round.receive_ms = (time.perf_counter() - t) * 1e3
                self._round.bytes = sum(b.nbytes for b, _ in kept)
                self._round.buckets = len(kept)
                self.finish_weight_update()
                assert self.last_round is not None
                rounds.append(asdict(self.last_round))
        except BaseException:
            self._abandon_reload()
            raise
        best = min(rounds, key=lambda x: x["start_ms"] + x["receive_ms"] + x["finish_ms"])
        return {"best": best, "rounds": rounds}

    def _abandon(self) -> None:
        """After a failed receive: put every layer back on real storage and drop the group
        (a failed collective leaves it out of step with the trainer)."""
        self._abandon_reload()
        self.shutdown()

    def _abandon_reload(self) -> None:
        if self._reload_active:
            try:
                self.finish_weight_update()
            except Exception:
                log.exception("gloo weight transfer: finalising the interrupted reload failed")
