"""vLLM worker side of the gloo weight transport (loaded inside vLLM through our plugin).

Mirrors vLLM's dense NCCL engine (`vllm.distributed.weight_transfer.nccl_engine`) so a trainer
drives both the same way: `init_transfer_engine` joins a process group with the trainer
(trainer rank 0, this worker `rank_offset` + its global rank); the per-round update info is
the same `names` / `dtype_names` / `shapes` metadata; `start_weight_update` and
`finish_weight_update` run vLLM's layerwise reload; `receive_weights` receives the buckets the
trainer broadcasts and hands each to `model.load_weights`. The bucket plan is derived on both
sides from the metadata (`harnessrl.weight_transfer.buckets`).

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
import time
from collections import deque
from dataclasses import dataclass
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
DEFAULT_NUM_BUFFERS = 2


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

    # -- lifecycle --------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        if self.group is not None:  # a trainer re-joining (after a failure or a restart)
            self.shutdown()
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        log.info("gloo weight transfer: joining %s:%d as rank %d of %d",
                 init_info.master_address, init_info.master_port, rank, init_info.world_size)
        self.group = stateless_init_torch_distributed_process_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size,
            backend="gloo", timeout=timedelta(seconds=init_info.timeout_s))
        self.init_info = init_info

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        t = time.perf_counter()
        initialize_layerwise_reload(self.model)
        self._reload_active = True
        log.info("gloo weight transfer: reload initialised in %.1f ms",
                 (time.perf_counter() - t) * 1e3)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        self._reload_active = False
        log.info("gloo weight transfer: reload finalised in %.1f ms",
                 (time.perf_counter() - t) * 1e3)

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
        """Keeps up to `depth` broadcasts in flight while loading the bucket that arrived.

        Each bucket gets a fresh buffer: layerwise reload keeps views of the received tensors
        until their layer is complete, which may be several buckets later."""
        in_flight: deque[tuple[Bucket, torch.Tensor, Any]] = deque()
        todo = iter(plan)

        def post() -> None:
            bucket = next(todo, None)
            if bucket is not None:
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
                in_flight.append((bucket, buf, self.group.broadcast(buf, 0)))

        t_wait = t_load = 0.0
        nbytes = 0
        try:
            for _ in range(depth):
                post()
            while in_flight:
                bucket, buf, work = in_flight.popleft()
                t0 = time.perf_counter()
                work.wait()
                work = None
                t1 = time.perf_counter()
                post()
                self.model.load_weights(unpack(buf, bucket))
                t_load += time.perf_counter() - t1
                t_wait += t1 - t0
                nbytes += bucket.nbytes
        except BaseException:
            # Pending works keep the group (and its connections) alive; the traceback keeps
            # this frame. Drop them so that closing the group closes the connections and the
            # trainer's side fails at once instead of at its timeout.
            in_flight.clear()
            work = None  # noqa: F841
            raise
        log.info("gloo weight transfer: received %.1f MB in %d buckets; waited %.1f ms, "
                 "loaded %.1f ms", nbytes / 1e6, len(plan), t_wait * 1e3, t_load * 1e3)

    def _abandon(self) -> None:
        """After a failed receive: put every layer back on real storage and drop the group
        (a failed collective leaves it out of step with the trainer)."""
        if self._reload_active:
            try:
                self.finish_weight_update()
            except Exception:
                log.exception("gloo weight transfer: finalising the interrupted reload failed")
        self.shutdown()
