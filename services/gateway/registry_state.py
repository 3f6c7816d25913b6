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
import functools
import logging
import time
from collections.abc import Awaitable, Callable

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

    async def save(self, *engines: EngineState) -> None:
        for eng in engines:
            record = eng.to_proto()
            record.inflight = record.served_calls = 0
            if eng.marked:
                record.reason = eng.reason
            data = record.SerializeToString()
            await self._write(f"saving engine {eng.name}", functools.partial(
                self.store.put_state, self.namespace, eng.name, data))

    async def delete(self, name: str) -> None:
        await self._write(f"removing engine {name}",
                          lambda: self.store.delete_state(self.namespace, name))

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
            eng = registry.register(rec.name, rec.base_url, rec.model, rec.policy_version,
                                    rec.lora if rec.HasField("lora") else None)
            registry.update(rec.name, None, rec.state, rec.reason)
            eng.adapters = {a.name: AdapterState.from_proto(a) for a in rec.adapters}
            if rec.paused:
                registry.pause([rec.name])
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
