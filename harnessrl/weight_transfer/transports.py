"""Trainer side of the weight data plane: one `WeightTransport` per engine, the trainer as
rank 0 of a process group with that engine's workers.

Three implementations with one protocol (the pusher cannot tell them apart):

- `GlooTransport` (CPU): talks to our `gloo` vLLM backend (`gloo_engine.py`, registered by
  the `harnessrl_gloo` vLLM plugin).
- `NcclTransport` (GPU, separate devices): vLLM's own trainer-side NCCL helpers
  (`nccl_common.trainer_init`, `packed_nccl_broadcast_producer`) against vLLM's built-in `nccl`
  backend.
- `IpcTransport` (GPU, trainer and engine on the same devices, where NCCL refuses two ranks on
  one device): CUDA IPC handles against vLLM's built-in `ipc` backend
  (`vllm/distributed/weight_transfer/ipc_engine.py`). No process group and no broadcast: the
  `/update_weights` request carries a handle per tensor and the engine maps the trainer's own
  memory.

Protocol, as vLLM's dense NCCL engine defines it: `prepare(world_size)` reserves the rendezvous
endpoint and returns the worker init info (POSTed to `/init_weight_transfer_engine`); `join()`
is the trainer's rank-0 rendezvous, called while that request is in flight; the per-round
metadata is `update_info(params)` (names / dtype_names / shapes, POSTed to `/update_weights`);
`send(params)` broadcasts the tensors, packed into buckets of `bucket_bytes`, while that
request is in flight.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

import torch

from harnessrl.weight_transfer.buckets import dtype_name, pack_into, plan_buckets

log = logging.getLogger(__name__)

NamedTensors = Sequence[tuple[str, torch.Tensor]]


def tensor_meta(params: NamedTensors) -> tuple[list[str], list[torch.dtype], list[Any]]:
    """Names, dtypes and shapes of `params`; from its `meta` when it has one (weights of a
    sharded model, `sharded.GatheredWeights`: reading a tensor there gathers it)."""
    meta = getattr(params, "meta", None)
    if meta is not None:
        names, dtypes, shapes = meta
        return list(names), list(dtypes), [tuple(s) for s in shapes]
    return ([n for n, _ in params], [t.dtype for _, t in params],
            [tuple(t.shape) for _, t in params])


def tensor_bytes(params: NamedTensors) -> int:
    _, dtypes, shapes = tensor_meta(params)
    return sum(math.prod(s) * d.itemsize for d, s in zip(dtypes, shapes))


def update_info(params: NamedTensors) -> dict[str, Any]:
    """The per-round `/update_weights` payload, the same for every backend."""
    names, dtypes, shapes = tensor_meta(params)
    return {
        "names": names,
        "dtype_names": [dtype_name(d) for d in dtypes],
        "shapes": [list(s) for s in shapes],
    }


class WeightTransport(ABC):
    """The trainer's end of one engine's weight process group."""

    backend: ClassVar[str]  # the engine's `--weight-transfer-config` backend name

    def __init__(self, *, master_address: str = "127.0.0.1",
                 bucket_bytes: int = 32 * 1024 * 1024, solo_bytes: int = 1024 * 1024,
                 num_buffers: int = 8, timeout_s: float = 300.0) -> None:
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.solo_bytes = solo_bytes  # gloo: tensors this large go alone, uncopied
        self.num_buffers = max(1, num_buffers)
        self.timeout_s = timeout_s

    @abstractmethod
    def prepare(self, world_size: int) -> dict[str, Any]:
        """Reserves the rendezvous endpoint for a group of `world_size` ranks (trainer +
        workers); returns the init info for `/init_weight_transfer_engine`."""

    @abstractmethod
    def join(self) -> None:
        """Rendezvous as rank 0; returns once every worker has joined."""

    def update_info(self, params: NamedTensors) -> dict[str, Any]:
        """The `/update_weights` payload of one push (module `update_info`, plus what the
        backend adds)."""
        return update_info(params)

    @abstractmethod
    def send(self, params: NamedTensors) -> None:
        """Broadcasts `params` in order, in buckets; returns when all of it is sent."""

    def finished(self) -> None:
        """The push's `/finish_weight_update` was answered: the engine holds its own copy."""

    @abstractmethod
    def close(self) -> None:
        """Tears the group down (a receive blocked on the other side then fails)."""


class GlooTransport(WeightTransport):
    """Gloo broadcast from the trainer (CPU tensors). Buckets are packed into a small pool of
    reused buffers while the previous bucket is on the wire; a bucket holding a single
    contiguous CPU tensor is sent straight from that tensor's storage, without a copy."""

    backend = "gloo"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._listen: socket.socket | None = None
        self._port = 0
        self._world_size = 0
        self._group: Any = None
        self._pool: list[torch.Tensor] = []

    def prepare(self, world_size: int) -> dict[str, Any]:
        # Bound now and handed to the TCPStore in join(): no window for another process to
        # take the port in between.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self.master_address, 0))
        sock.listen()
        self._listen, self._port, self._world_size = sock, sock.getsockname()[1], world_size
        return {
            "master_address": self.master_address, "master_port": self._port,
            "rank_offset": 1, "world_size": world_size, "packed": True,
            "packed_buffer_size_bytes": self.bucket_bytes, "solo_bytes": self.solo_bytes,
            "packed_num_buffers": self.num_buffers, "timeout_s": self.timeout_s,
        }

    def join(self) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        if self._listen is None:
            raise RuntimeError("prepare() first")
        sock, self._listen = self._listen, None
        self._group = stateless_init_torch_distributed_process_group(
            self.master_address, self._port, 0, self._world_size, backend="gloo",
            listen_socket=sock, timeout=timedelta(seconds=self.timeout_s))

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        while len(self._pool) <= slot:
            self._pool.append(torch.empty(0, dtype=torch.uint8))
        if self._pool[slot].numel() < nbytes:
            self._pool[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return self._pool[slot][:nbytes]

    def send(self, params: NamedTensors) -> None:
        group = self._group
        if group is None:
            raise RuntimeError("gloo transport is not joined")
        plan = plan_buckets(*tensor_meta(params), self.bucket_bytes, self.solo_bytes)
        in_flight: deque[Any] = deque()
        busy: dict[int, Any] = {}  # pool slot -> the broadcast still reading it
        next_slot = 0
        work: Any = None
        t_start = time.perf_counter()
        t_pack = 0.0
        try:
            for bucket in plan:
                tensors = [params[s.index][1].detach() for s in bucket.slots]
                one = tensors[0]
                if len(tensors) == 1 and one.device.type == "cpu" and one.is_contiguous():
                    wire, slot = one.reshape(-1).view(torch.uint8), None
                else:
                    slot = next_slot
                    next_slot = (next_slot + 1) % self.num_buffers
                    if slot in busy:
                        busy.pop(slot).wait()
                    wire = self._buffer(slot, bucket.nbytes)
                    t0 = time.perf_counter()
                    pack_into(wire, bucket, tensors)
                    t_pack += time.perf_counter() - t0
                work = group.broadcast(wire, 0)
                in_flight.append(work)
                if slot is not None:
                    busy[slot] = work
                work = None
                while len(in_flight) > self.num_buffers:
                    in_flight.popleft().wait()
            while in_flight:
                in_flight[0].wait()
                in_flight.popleft()
        except BaseException:
            # Pending works keep the group's connections open (and this frame lives on in
            # the traceback): drop them so that close() cuts the workers off at once.
            in_flight.clear()
            busy.clear()
            work = group = None  # noqa: F841
            raise
        log.debug("gloo send: %d buckets in %.1f ms, packing %.1f ms", len(plan),
                  (time.perf_counter() - t_start) * 1e3, t_pack * 1e3)

    def close(self) -> None:
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        if self._listen is not None:
            self._listen.close()
            self._listen = None
        group, self._group = self._group, None
        if group is not None:
            # The connections close when the last reference goes (see send()).
            stateless_destroy_torch_distributed_process_group(group)
            del group


class NcclTransport(WeightTransport):
    """vLLM's built-in NCCL data plane (GPU), packed, driven through vLLM's own trainer-side
    helpers. Needs CUDA on the trainer; the worker side is vLLM's `nccl` backend."""

    backend = "nccl"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rendezvous: dict[str, Any] = {}
        self._group: Any = None

    def prepare(self, world_size: int) -> dict[str, Any]:
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            worker_init_payload,
        )

        from harnessrl.procs import free_port

        self._rendezvous = {"master_address": self.master_address, "master_port": free_port(),
                            "world_size": world_size}
        return worker_init_payload(NCCLWeightTransferInitInfo(
            **self._rendezvous, rank_offset=1, packed=True,
            packed_buffer_size_bytes=self.bucket_bytes, packed_num_buffers=self.num_buffers))

    def join(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self._group = trainer_init(self._rendezvous, rank=0)

    def send(self, params: NamedTensors) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        if self._group is None:
            raise RuntimeError("nccl transport is not joined")
        packed_nccl_broadcast_producer(
            iterator=((n, t.detach()) for n, t in params), group=self._group, src=0,
            post_iter_func=lambda item: item[1], buffer_size_bytes=self.bucket_bytes,
            num_buffers=self.num_buffers)
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.destroy()


class IpcTransport(WeightTransport):
    """vLLM's `ipc` backend: one CUDA IPC handle per tensor, keyed by the GPU's UUID, pickled
    and base64-encoded as vLLM's own HTTP client sends them (the engine needs
    `VLLM_ALLOW_INSECURE_SERIALIZATION=1`; only the trainer reaches its dev-mode routes). The
    engine copies from the trainer's tensors inside `/update_weights`, so `send` has nothing
    left to do; the tensors are kept referenced until `/finish_weight_update` is answered
    (`finished`), then let go so that the trainer's offload can free them."""

    backend = "ipc"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._refs: list[torch.Tensor] = []

    def prepare(self, world_size: int) -> dict[str, Any]:
        return {"packed": False}

    def join(self) -> None:
        pass  # no rendezvous: the handles travel with each update

    def update_info(self, params: NamedTensors) -> dict[str, Any]:
        import base64
        import pickle

        from torch.multiprocessing.reductions import reduce_tensor

        info = update_info(params)
        refs = [t.detach().contiguous() for _, t in params]
        on_host = sorted({str(t.device) for t in refs if t.device.type != "cuda"})
        if on_host:
            raise ValueError(f"ipc weight transfer needs CUDA tensors, got {on_host}")
        for dev in {t.device for t in refs}:
            torch.cuda.synchronize(dev)  # the engine reads what the trainer last wrote
        self._refs, handles = refs, []
        for t in refs:
            uuid = str(torch.cuda.get_device_properties(t.device).uuid)
            handles.append({uuid: reduce_tensor(t)[1]})
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode()
        return info

    def send(self, params: NamedTensors) -> None:
        pass  # the engine copied the tensors inside /update_weights

    def finished(self) -> None:
        # vLLM's layerwise reload may read the shared tensors until finish: only now may the
        # trainer's offload free their memory (the refs would keep it on the device)
        self._refs = []
        torch.cuda.ipc_collect()

    def close(self) -> None:
        self._refs = []
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


TRANSPORTS: dict[str, type[WeightTransport]] = {
    GlooTransport.backend: GlooTransport,
    NcclTransport.backend: NcclTransport,
    IpcTransport.backend: IpcTransport,
}


def make_transport(backend: str, **kwargs: Any) -> WeightTransport:
    try:
        cls = TRANSPORTS[backend]
    except KeyError:
        raise ValueError(f"unknown weight transport {backend!r}; "
                         f"known: {sorted(TRANSPORTS)}") from None
    return cls(**kwargs)
