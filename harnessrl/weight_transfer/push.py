"""Pushes a trainer's weights into running vLLM engines through vLLM's weight-transfer HTTP
protocol (`VLLM_SERVER_DEV_MODE=1` endpoints) and a `WeightTransport` data plane.

Per engine, once: `GET /get_world_size`, then `POST /init_weight_transfer_engine` with the
transport's init info while the trainer joins the group as rank 0.

Per push and engine:

    /pause?mode=keep -> /update_weight_version "incomplete:<v>" beside /start_weight_update ->
    /update_weights (metadata; in flight while the trainer broadcasts the buckets) ->
    /finish_weight_update (sets the engine's weight version "<v>"; sent as soon as the
    broadcasts are done, it waits in the engine behind /update_weights) -> /resume

Design choices:

- Several engines: each has its own process group and transport, and the engines are pushed
  concurrently, each in its own thread. One engine failing then cannot stall or corrupt the
  others' transfers, and a failed engine is re-initialised alone. The price is that the trainer
  sends the bytes once per engine rather than once in total.
- Failure: any error or timeout on an engine (HTTP error, transport error, the trainer's own
  weights raising mid-push) tears that engine's group down (which makes its worker's pending
  receive fail at once), closes the engine's update session best-effort, and leaves the engine
  PAUSED: requests already inside it stay frozen rather than run on a mix of old and new
  weights. The engine's own weight version says `incomplete:<v>` from before the first weight
  changes until a push completes, so even a trainer killed mid-push (no hook runs) leaves a
  trace the gateway acts on (`harnessrl.weight_versions`). Its `hooks.on_failure` is called (the gateway marks it: no traffic), and after all
  engines finish, `PushError` names every failed engine and why. The next `push` re-runs
  `/init_weight_transfer_engine` for a failed engine and, on success, resumes it.
- Gateway interaction is a small optional `PushHooks` object: `before_push` (hold new calls for
  that engine), `after_push` (set the engine's policy version, mark it ready, release held
  calls) and `on_failure` (mark the engine). `GatewayHooks` implements it over
  `harnessrl.clients.GatewayAdminClient`.
- Tied embeddings: `weights_of(model)` lists parameters with `remove_duplicate=False`, so a
  tied output head travels under both names (`model.embed_tokens.weight` and
  `lm_head.weight`); vLLM on CPU keeps the head stale otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import (
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    Future,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import torch
from pydantic import BaseModel, Field

from harnessrl.engine_guard import process_key
from harnessrl.weight_transfer.transports import (
    NamedTensors,
    WeightTransport,
    make_transport,
    tensor_bytes,
)
from harnessrl.weight_versions import complete, incomplete

log = logging.getLogger(__name__)


class PushConfig(BaseModel):
    """How the trainer pushes weights into engines."""

    backend: str = Field("gloo", description="Weight transport: 'gloo' (CPU, our vLLM plugin), "
                         "'nccl' (GPU, separate devices) or 'ipc' (GPU, trainer and engine on "
                         "the same devices: CUDA IPC), both vLLM's built-in backends; must "
                         "match the engines' --weight-transfer-config backend.")
    master_address: str = Field("127.0.0.1", description="Address of the trainer that the "
                                "engines' workers connect to for the weight process group.")
    bucket_mb: float = Field(32.0, description="Bucket size in MiB: tensors are packed into "
                             "flat buffers of at most this size, one broadcast per bucket.")
    solo_mb: float = Field(1.0, description="gloo: tensors of at least this many MiB travel "
                           "in a broadcast of their own, sent from their storage without a "
                           "copy; smaller ones are packed into buckets. 0 packs everything.")
    num_buffers: int = Field(8, description="Buckets in flight at once on each side (the "
                             "trainer packs / the engine applies one while the next ones "
                             "travel). 8 pushed a 100M model in about half the time of 2 on 2 "
                             "cores (docs/weight-sync.md).")
    http_timeout_s: float = Field(60.0, description="Timeout of each control request "
                                  "(pause, start, finish, version, resume).")
    transfer_timeout_s: float = Field(600.0, description="Timeout of the group rendezvous and "
                                      "of the transfer (broadcasts plus /update_weights).")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1024 * 1024)

    @property
    def solo_bytes(self) -> int:
        return int(self.solo_mb * 1024 * 1024)


@dataclass(frozen=True)
class EngineRef:
    """An engine as the gateway knows it: its name and its vLLM server's base URL."""

    name: str
    base_url: str


class EngineFailure(RuntimeError):
    def __init__(self, engine: str, stage: str, cause: BaseException) -> None:
        super().__init__(f"engine {engine!r}: weight push failed at {stage}: "
                         f"{type(cause).__name__}: {cause}")
        self.engine, self.stage, self.cause = engine, stage, cause


class PushError(RuntimeError):
    """Raised when the push failed on at least one engine; `failures` maps engine name to
    its `EngineFailure`. Engines not named here were updated (`done`: their timings)."""

    def __init__(self, version: int, failures: dict[str, EngineFailure],
                 done: dict[str, EngineTiming] | None = None, bytes: int = 0,
                 wall_s: float = 0.0) -> None:
        lines = "; ".join(str(f) for f in failures.values())
        super().__init__(f"weight push of version {version} failed on "
                         f"{sorted(failures)}: {lines}")
        self.version, self.failures = version, failures
        self.done = dict(done or {})
        self.bytes, self.wall_s = bytes, wall_s

    @property
    def failed_engines(self) -> list[str]:
        return sorted(self.failures)


@dataclass
class EngineTiming:
    """What one push cost one engine, seen from the trainer."""

    paused_s: float  # from sending /pause to /resume answered
    transfer_s: float  # from sending /start_weight_update to /finish_weight_update answered
    bytes: int


@dataclass
class PushReport:
    version: int
    bytes: int
    wall_s: float
    engines: dict[str, EngineTiming] = field(default_factory=dict)  # the engines updated
    failed: dict[str, EngineFailure] = field(default_factory=dict)  # left MARKED (see trainer)


class PushHooks(Protocol):
    """The gateway's part in a push (all calls made from the engine's push thread)."""

    def before_push(self, engine: str) -> None: ...

    def after_push(self, engine: str, version: int) -> None: ...

    def on_failure(self, engine: str, reason: str) -> None: ...


class GatewayHooks:
    """`PushHooks` over the gateway's admin API: hold the engine's new calls during the push,
    then record its new policy version and mark it ready; mark it on failure (it then takes
    no traffic until a later push succeeds)."""

    def __init__(self, admin: Any) -> None:  # harnessrl.clients.GatewayAdminClient
        self.admin = admin
        # collocated steps with sleep: the engine is not awake yet after its push; the
        # trainer marks it READY and resumes it itself once it is (services/trainer/collocation)
        self.defer_ready = False

    def before_push(self, engine: str) -> None:
        self.admin.pause([engine], drain=False)

    def after_push(self, engine: str, version: int) -> None:
        from harnessrl.v1 import gateway_pb2 as gpb

        if self.defer_ready:
            self.admin.update_engine(engine, policy_version=version)
            return
        self.admin.update_engine(engine, policy_version=version, state=gpb.ENGINE_STATE_READY)
        self.admin.resume([engine])

    def on_failure(self, engine: str, reason: str) -> None:
        from harnessrl.v1 import gateway_pb2 as gpb

        self.admin.update_engine(engine, state=gpb.ENGINE_STATE_MARKED, reason=reason[:1000])
        self.admin.resume([engine])  # held calls may go to the other engines


def weights_of(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors to push, in module order, tied parameters under every name they have."""
    return [(n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False)]


class EngineHTTP:
    """vLLM's weight-sync HTTP routes for one engine; raises on any non-2xx answer."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(base_url=self.base_url, timeout=timeout_s,
                                   auth=process_key())  # the engine key, engine_guard.py

    def post(self, path: str, json: Any = None, timeout: float | None = None,
             params: dict[str, str] | None = None) -> Any:
        kwargs: dict[str, Any] = {"json": json, "params": params}
        if timeout is not None:
            kwargs["timeout"] = timeout
        r = self.client.post(path, **kwargs)
        if r.status_code >= 300:
            raise RuntimeError(f"POST {self.base_url}{path} -> {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def world_size(self) -> int:
        r = self.client.get("/get_world_size", params={"include_dp": "true"})
        r.raise_for_status()
        return int(r.json()["world_size"])

    def close(self) -> None:
        self.client.close()


@dataclass
class _Link:
    engine: EngineRef
    http: EngineHTTP
    transport: WeightTransport | None = None  # None until joined, and again after a failure


class WeightPusher:
    """Pushes weights into a set of engines; see the module docstring for the protocol."""

    def __init__(self, engines: Sequence[EngineRef], config: PushConfig | None = None,
                 hooks: PushHooks | None = None) -> None:
        self.config = config or PushConfig()
        self.hooks = hooks
        # collocated steps with sleep: the engine's scheduler is paused by its sleep and stays
        # so until its KV cache is awake; the push neither pauses nor resumes it
        self.keep_paused = False
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()
        for e in engines:
            self.add_engine(e)

    # -- engines ----------------------------------------------------------------------------

    def add_engine(self, engine: EngineRef) -> None:
        with self._lock:
            if engine.name in self._links:
                raise ValueError(f"engine {engine.name!r} already added")
            self._links[engine.name] = _Link(
                engine, EngineHTTP(engine.base_url, self.config.http_timeout_s))

    def remove_engine(self, name: str) -> None:
        with self._lock:
            link = self._links.pop(name)
        self._drop_transport(link)
        link.http.close()

    @property
    def engines(self) -> list[str]:
        return sorted(self._links)

    def close(self) -> None:
        for name in list(self._links):
            self.remove_engine(name)

    def __enter__(self) -> "WeightPusher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- push -------------------------------------------------------------------------------

    def push(self, weights: torch.nn.Module | NamedTensors, version: int,
             engines: Collection[str] | None = None) -> PushReport:
        """Pushes `weights` (a module, or (name, tensor) pairs in the names vLLM's
        `load_weights` accepts) as policy `version` to every engine (or to the named
        `engines` only); raises `PushError` naming each engine that failed (all the others
        were updated)."""
        params: NamedTensors
        if isinstance(weights, torch.nn.Module):
            params = weights_of(weights)
        elif hasattr(weights, "meta"):  # gathered lazily (sharded.GatheredWeights): no list()
            params = weights
        else:
            params = list(weights)
        nbytes = tensor_bytes(params)
        links = [link for name, link in self._links.items()
                 if engines is None or name in engines]
        if not links:
            raise ValueError("no engines to push to")
        t0 = time.perf_counter()
        report = PushReport(version=version, bytes=nbytes, wall_s=0.0)
        failures: dict[str, EngineFailure] = {}
        with ThreadPoolExecutor(len(links), thread_name_prefix="push") as pool:
            futures = {link.engine.name: pool.submit(self._push_one, link, params, version)
                       for link in links}
            for name, fut in futures.items():
                try:
                    report.engines[name] = fut.result()
                except EngineFailure as e:
                    failures[name] = e
        report.wall_s = time.perf_counter() - t0
        if failures:
            raise PushError(version, failures, report.engines, nbytes, report.wall_s)
        log.info("pushed version %d (%.1f MB) to %s in %.3fs", version, nbytes / 1e6,
                 sorted(report.engines), report.wall_s)
        return report

    def _push_one(self, link: _Link, params: NamedTensors, version: int) -> EngineTiming:
        name, http, cfg = link.engine.name, link.http, self.config
        stage = "before_push hook"
        started = False
        update: Future[Any] | None = None
        side = ThreadPoolExecutor(3, thread_name_prefix=f"push-{name}")
        try:
            if self.hooks is not None:
                self.hooks.before_push(name)
            if link.transport is None:
                stage = "init_weight_transfer_engine"
                self._connect(link, side)
            stage = "pause"
            t_pause = time.perf_counter()
            if not self.keep_paused:
                http.post("/pause", params={"mode": "keep"})
            # The engine's weight version says "incomplete" before any weight changes: the
            # marker travels beside /start_weight_update (which changes none), and the update
            # is sent once both are answered.
            stage = "start_weight_update"
            t_start = time.perf_counter()
            marker = side.submit(http.post, "/update_weight_version",
                                 {"new_version": incomplete(version)})
            started = True
            http.post("/start_weight_update")
            stage = "update_weight_version"
            marker.result(timeout=cfg.http_timeout_s)
            stage = "update_weights"
            transport = link.transport
            assert transport is not None
            update = side.submit(http.post, "/update_weights",
                                 {"update_info": transport.update_info(params)},
                                 cfg.transfer_timeout_s)
            send = side.submit(transport.send, params)
            _sent(send, update, timeout=cfg.transfer_timeout_s)
            # Our send is complete, so the worker is inside /update_weights: a finish sent now
            # queues behind it in the engine (one RPC at a time) and its round trip overlaps
            # the engine applying the last buckets.
            finish = side.submit(http.post, "/finish_weight_update",
                                 {"weight_version": complete(version)}, cfg.transfer_timeout_s)
            _first_error(update, timeout=cfg.transfer_timeout_s)
            stage = "finish_weight_update"  # also sets the engine's weight version
            finish.result(timeout=cfg.transfer_timeout_s)
            transport.finished()  # the engine holds its copy now (ipc: the handles go)
            started = False
            t_finish = time.perf_counter()
            stage = "resume"
            if not self.keep_paused:
                http.post("/resume")
            t_resume = time.perf_counter()
            stage = "after_push hook"
            if self.hooks is not None:
                self.hooks.after_push(name, version)
            return EngineTiming(paused_s=t_resume - t_pause, transfer_s=t_finish - t_start,
                                bytes=tensor_bytes(params))
        except BaseException as exc:
            failure = EngineFailure(name, stage, exc)
            log.error("%s", failure)
            self._abort(link, started, update)
            if self.hooks is not None:
                try:
                    self.hooks.on_failure(name, str(failure))
                except Exception:
                    log.exception("engine %r: on_failure hook failed", name)
            raise failure from exc
        finally:
            side.shutdown(wait=False)

    def _connect(self, link: _Link, side: ThreadPoolExecutor) -> None:
        cfg = self.config
        transport = make_transport(cfg.backend, master_address=cfg.master_address,
                                   bucket_bytes=cfg.bucket_bytes, solo_bytes=cfg.solo_bytes,
                                   num_buffers=cfg.num_buffers,
                                   timeout_s=cfg.transfer_timeout_s)
        try:
            init_info = transport.prepare(1 + link.http.world_size())
            init = side.submit(link.http.post, "/init_weight_transfer_engine",
                               {"init_info": init_info}, cfg.transfer_timeout_s)
            # The rendezvous runs in a daemon thread: if the engine rejects the init, the
            # join would otherwise block until its timeout.
            joined: Future[None] = Future()

            def join() -> None:
                try:
                    transport.join()
                    joined.set_result(None)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    joined.set_exception(e)

            threading.Thread(target=join, name=f"join-{link.engine.name}", daemon=True).start()
            _first_error(init, joined, timeout=cfg.transfer_timeout_s)
        except BaseException:
            transport.close()
            raise
        link.transport = transport
        log.info("engine %r: weight transfer group joined (%s)", link.engine.name, cfg.backend)

    def _abort(self, link: _Link, started: bool, update: Future[Any] | None) -> None:
        """Best-effort cleanup after a failed push; the engine stays paused."""
        self._drop_transport(link)  # the worker's pending receive fails now
        if update is not None:
            try:
                update.result(timeout=min(30.0, self.config.transfer_timeout_s))
            except BaseException:  # noqa: BLE001 - expected: the receive was cut off
                pass
        if started:  # closes the engine's update session if the failure left it open
            try:
                link.http.post("/finish_weight_update", timeout=self.config.http_timeout_s)
            except Exception as e:  # noqa: BLE001
                log.info("engine %r: closing the update session: %s", link.engine.name, e)

    @staticmethod
    def _drop_transport(link: _Link) -> None:
        transport, link.transport = link.transport, None
        if transport is not None:
            try:
                transport.close()
            except Exception:
                log.exception("engine %r: closing the transport failed", link.engine.name)


def _sent(send: Future[Any], update: Future[Any], timeout: float) -> None:
    """Waits for `send` to complete; raises its error, or `update`'s as soon as that fails
    (the engine gave up: the send would only block), or TimeoutError."""
    deadline = time.monotonic() + timeout
    while not send.done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the transfer is still running after {timeout}s")
        wait((send, update), timeout=remaining, return_when=FIRST_COMPLETED)
        if update.done() and update.exception() is not None:
            raise update.exception()  # type: ignore[misc]
    send.result()


def _first_error(*futures: Future[Any], timeout: float) -> None:
    """Waits for all `futures`; raises the first error as soon as it happens, or
    TimeoutError."""
    done, pending = wait(futures, timeout=timeout, return_when=FIRST_EXCEPTION)
    for f in done:
        if f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    if pending:
        raise TimeoutError(f"{len(pending)} of {len(futures)} steps still running after "
                           f"{timeout}s")
