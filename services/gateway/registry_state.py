"""The engine registry kept in the store, so a restarted gateway serves at once with the
engines, policy versions, MARKED states and pauses its earlier life was given.

Each engine is one `Engine` record (name, base_url, model, policy_version, state, reason,
paused) under the store's `PutState` namespace `state_namespace`. Every GatewayAdmin change is
written before the RPC answers; while the store is down the answer waits for it up to
`state_write_timeout_s` (a weight push during a store restart just takes longer), then is
UNAVAILABLE (the change is in effect in this gateway but not saved: the caller retries; every
change is idempotent). At start-up the stored records are loaded first; an engine of the
start-up configuration (`--engines`) with the same name and base_url keeps its stored state
(the gateway restarted, the engine did not), one that differs replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc

from harnessrl.clients import AsyncStoreClient
from harnessrl.errors import Unavailable
from harnessrl.v1 import gateway_pb2 as gpb
from services.gateway.config import EngineSpec
from services.gateway.adapters import AdapterState
from services.gateway.engines import EngineRegistry, EngineState, normalize_base_url

log = logging.getLogger("harnessrl.gateway.state")


_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class RegistryState:
    def __init__(self, store: AsyncStoreClient, namespace: str, write_timeout_s: float = 20.0
                 ) -> None:
        self.store = store
        self.namespace = namespace
        self.write_timeout_s = write_timeout_s
        # engines with a write in flight: their state here is newer than the store's, so a
        # reload (a peer's change, or this replica catching up after its announcement
        # expired, say while the store restarts) leaves them as they are
        self._writing: dict[str, int] = {}
        # engines a reload left as they were: read again once their writes are done (a peer's
        # write may have reached the store after this replica's)
        self._skipped: set[str] = set()
        self._registry: EngineRegistry | None = None

    async def _write(self, what: str, fn: Callable[[], Awaitable[object]]) -> None:
        """Runs one store write, retrying a store that is unavailable for `write_timeout_s`."""
        deadline = time.monotonic() + self.write_timeout_s
        delay = 0.1
        while True:
            try:
                await fn()
                return
            except grpc.aio.AioRpcError as err:
                if err.code() not in _RETRYABLE or time.monotonic() + delay > deadline:
                    raise Unavailable(f"{what}: the store did not take it: {err.code().name} "
                                      f"{err.details()}") from err
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    @contextlib.contextmanager
    def _in_flight(self, names: list[str]) -> Iterator[None]:
        for n in names:
            self._writing[n] = self._writing.get(n, 0) + 1
        try:
            yield
        finally:
            for n in names:
                self._writing[n] -= 1
                if not self._writing[n]:
                    del self._writing[n]

    async def save(self, *engines: EngineState) -> None:
        with self._in_flight([eng.name for eng in engines]):
            for eng in engines:
                record = eng.to_proto()
                record.inflight = record.served_calls = 0
                if eng.marked:
                    record.reason = eng.reason
                data = record.SerializeToString()
                await self._write(f"saving engine {eng.name}", functools.partial(
                    self.store.put_state, self.namespace, eng.name, data))
        await self._read_skipped([eng.name for eng in engines])

    async def delete(self, name: str) -> None:
        with self._in_flight([name]):
            await self._write(f"removing engine {name}",
                              lambda: self.store.delete_state(self.namespace, name))
        await self._read_skipped([name])

    async def _read_skipped(self, names: list[str]) -> None:
        """Reads again the engines among `names` a reload skipped while they were written and
        now have no write in flight: the store holds whichever write came last."""
        due = [n for n in names if n in self._skipped and n not in self._writing]
        if due and self._registry is not None:
            self._skipped.difference_update(due)
            try:
                await self.reload(self._registry, due, self.write_timeout_s)
            except grpc.aio.AioRpcError as err:  # saved all the same; the next reload reads it
                self._skipped.update(due)
                log.warning("reading %s again after saving it failed: %s", due, err.code().name)

    async def load(self, timeout_s: float) -> list[gpb.Engine]:
        """The stored engines; retries a store that is unavailable for up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                resp = await self.store.list_state(self.namespace)
                return [gpb.Engine.FromString(e.value) for e in resp.entries]
            except grpc.aio.AioRpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED) or \
                        time.monotonic() > deadline:
                    raise
                log.warning("store unavailable (%s); retrying to load the engine registry",
                            err.code().name)
                await asyncio.sleep(0.5)

    async def restore(self, registry: EngineRegistry, configured: list[EngineSpec],
                      timeout_s: float) -> None:
        """Fills `registry`: the stored engines, then the configured ones (see the module)."""
        for rec in await self.load(timeout_s):
            eng = apply(registry, rec)
            log.info("engine %s restored from the store: version %d%s%s", rec.name,
                     rec.policy_version, ", MARKED" if eng.marked else "",
                     ", paused" if eng.paused else "")
        for spec in configured:
            known = registry.engines.get(spec.name)
            if known is not None and known.base_url == normalize_base_url(spec.base_url):
                continue
            if known is not None:
                registry.remove(spec.name)
            eng = registry.register(spec.name, spec.base_url, spec.model, spec.policy_version,
                                    spec.lora_support())
            await self.save(eng)

    async def reload(self, registry: EngineRegistry, names: list[str], timeout_s: float
                     ) -> None:
        """Another replica changed these engines (all when empty): `registry` takes the
        stored records, and drops the named ones the store no longer has; an engine this
        replica is saving keeps its own state (the newer) until the save is done, then is read
        again."""
        stored = {rec.name: rec for rec in await self.load(timeout_s)}
        self._registry = registry
        for name in names or list(set(stored) | set(registry.engines)):
            if name in self._writing:
                self._skipped.add(name)
                continue
            if name in stored:
                apply(registry, stored[name])
            elif name in registry.engines:
                registry.remove(name)


def apply(registry: EngineRegistry, rec: gpb.Engine) -> EngineState:
    """Makes `registry`'s engine `rec.name` what the stored record says."""
    known = registry.engines.get(rec.name)
    if known is not None and known.base_url != normalize_base_url(rec.base_url):
        registry.remove(rec.name)
    eng = registry.register(rec.name, rec.base_url, rec.model, rec.policy_version,
                            rec.lora if rec.HasField("lora") else None)
    registry.update(rec.name, None, rec.state, rec.reason)
    if known is None:
        eng.adapters = {a.name: AdapterState.from_proto(a) for a in rec.adapters}
    else:
        for a in rec.adapters:
            if a.state not in (gpb.ENGINE_STATE_READY, gpb.ENGINE_STATE_MARKED):
                continue
            registry.set_adapter(rec.name, a.name, a.policy_version, a.lora_name, a.lora_path,
                                 a.state, a.reason)
            eng.adapters[a.name].paused = a.paused
        for gone in set(eng.adapters) - {a.name for a in rec.adapters}:
            del eng.adapters[gone]  # removed through another replica (RemoveAdapter)
    (registry.pause if rec.paused else registry.resume)([rec.name])
    return eng
