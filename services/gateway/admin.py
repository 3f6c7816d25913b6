"""gRPC `harnessrl.v1.GatewayAdmin`: engines, policy versions, pause and resume.

Every change is saved in the store, then applied by every live replica (`replicas.forward`:
a `Sync` naming the changed engines; a pause also drains each replica's calls) before the RPC
answers."""

from __future__ import annotations

import asyncio
import math

import grpc

from harnessrl.errors import FailedPrecondition, InvalidArgument, Unavailable
from harnessrl.rpc import map_errors
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.v1 import gateway_pb2_grpc
from services.gateway.engines import EngineRegistry, EngineState
from services.gateway.registry_state import RegistryState
from services.gateway.replicas import ReplicaSet
from services.gateway.weightcheck import WeightCheck


@map_errors
class GatewayAdminServicer(gateway_pb2_grpc.GatewayAdminServicer):
    """Every change is saved in the store (`registry_state`) before the RPC answers."""

    def __init__(self, registry: EngineRegistry, weights: WeightCheck | None = None,
                 state: RegistryState | None = None, replicas: ReplicaSet | None = None,
                 load_timeout_s: float = 20.0) -> None:
        self.registry = registry
        self.weights = weights  # checks an engine's own weights before it is resumed
        self.state = state
        self.replicas = replicas  # the other gateway replicas sharing the store
        self.load_timeout_s = load_timeout_s

    async def _save(self, *engines: EngineState, names: list[str] | None = None,
                    drain_timeout_s: float = 0.0, adapter: str = "") -> None:
        """Saves the change, then has every other replica apply it (and drain, when
        `drain_timeout_s`)."""
        if self.state is not None:
            await self.state.save(*engines)
        if self.replicas is not None:
            sync = gpb.SyncRequest(engines=names if names is not None else
                                   [e.name for e in engines], drain=drain_timeout_s > 0,
                                   drain_timeout_s=drain_timeout_s, adapter=adapter)
            # a peer that has not applied it within its drain + replica_ttl_s is flagged stale
            await self.replicas.forward(sync, drain_timeout_s + self.replicas.ttl_s)

    async def Sync(self, request: gpb.SyncRequest, context: grpc.aio.ServicerContext
                   ) -> gpb.SyncResponse:
        if self.state is None:
            raise InvalidArgument("this gateway keeps no registry in the store")
        timeout_s = request.drain_timeout_s or 60.0
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise InvalidArgument("drain_timeout_s must be a finite number >= 0")
        await self.state.reload(self.registry, list(request.engines), self.load_timeout_s)
        if request.drain:
            engines = [self.registry.engines[n] for n in request.engines
                       if n in self.registry.engines] if request.engines else \
                list(self.registry.engines.values())
            try:
                if request.adapter:
                    await self.registry.drain_adapter(
                        [e.adapters[request.adapter] for e in engines
                         if request.adapter in e.adapters], timeout_s)
                else:
                    await self.registry.drain(engines, timeout_s)
            except Unavailable as err:  # reached and applied, not drained: the change fails
                raise FailedPrecondition(str(err)) from err
        return gpb.SyncResponse(replica=self.replicas.name if self.replicas else "")

    async def RegisterEngine(self, request: gpb.RegisterEngineRequest,
                             context: grpc.aio.ServicerContext) -> gpb.Engine:
        e = request.engine
        eng = self.registry.register(e.name, e.base_url, e.model, e.policy_version,
                                     e.lora if e.HasField("lora") else None)
        await self._save(eng)
        return eng.to_proto()

    async def RemoveEngine(self, request: gpb.RemoveEngineRequest,
                           context: grpc.aio.ServicerContext) -> gpb.RemoveEngineResponse:
        self.registry.remove(request.name)
        if self.state is not None:
            await self.state.delete(request.name)
        await self._save(names=[request.name])
        return gpb.RemoveEngineResponse()

    async def ListEngines(self, request: gpb.ListEnginesRequest,
                          context: grpc.aio.ServicerContext) -> gpb.ListEnginesResponse:
        return gpb.ListEnginesResponse(
            engines=[e.to_proto() for e in self.registry.engines.values()])

    async def UpdateEngine(self, request: gpb.UpdateEngineRequest,
                           context: grpc.aio.ServicerContext) -> gpb.Engine:
        version = request.policy_version if request.HasField("policy_version") else None
        eng = self.registry.update(request.name, version, request.state, request.reason)
        await self._save(eng)
        return eng.to_proto()

    async def Pause(self, request: gpb.PauseRequest, context: grpc.aio.ServicerContext
                    ) -> gpb.PauseResponse:
        timeout_s = request.drain_timeout_s or 60.0
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise InvalidArgument("drain_timeout_s must be a finite number >= 0")
        if request.adapter:  # only the calls of the runs serving this adapter
            held = self.registry.hold_adapter(list(request.engines), request.adapter, True)
            engines = [self.registry.get(a.engine) for a in held]
            if request.drain:  # saved and drained here and on every other replica at once
                await asyncio.gather(self.registry.drain_adapter(held, timeout_s), self._save(
                    *engines, drain_timeout_s=timeout_s, adapter=request.adapter))
            else:
                await self._save(*engines)
        else:
            engines = self.registry.pause(list(request.engines))
            if request.drain:
                await asyncio.gather(self.registry.drain(engines, timeout_s),
                                     self._save(*engines, drain_timeout_s=timeout_s))
            else:
                await self._save(*engines)
        return gpb.PauseResponse(engines=[e.to_proto() for e in engines])

    async def Resume(self, request: gpb.ResumeRequest, context: grpc.aio.ServicerContext
                     ) -> gpb.ResumeResponse:
        if request.adapter:
            held = self.registry.hold_adapter(list(request.engines), request.adapter, False)
            engines = [self.registry.get(a.engine) for a in held]
            await self._save(*engines)
            return gpb.ResumeResponse(engines=[e.to_proto() for e in engines])
        if self.weights is not None:  # an engine holding other weights is MARKED first
            for eng in self.registry.select(list(request.engines)):
                if eng.paused and eng.reachable and not eng.marked:
                    await self.weights.verify(eng)
        engines = self.registry.resume(list(request.engines))
        await self._save(*engines)
        return gpb.ResumeResponse(engines=[e.to_proto() for e in engines])

    async def SetAdapter(self, request: gpb.SetAdapterRequest,
                         context: grpc.aio.ServicerContext) -> gpb.Adapter:
        version = request.policy_version if request.HasField("policy_version") else None
        a = self.registry.set_adapter(request.engine, request.name, version, request.lora_name,
                                      request.lora_path, request.state, request.reason)
        await self._save(self.registry.get(request.engine))
        return a.to_proto()

    async def RemoveAdapter(self, request: gpb.RemoveAdapterRequest,
                            context: grpc.aio.ServicerContext) -> gpb.RemoveAdapterResponse:
        """No new call to the adapter (saved: every replica), its calls in flight drained on
        every replica, then unloaded and forgotten (saved again). A drain that times out
        fails the RPC with the adapter left MARKED (no traffic); calling again finishes."""
        timeout_s = request.drain_timeout_s or 60.0
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise InvalidArgument("drain_timeout_s must be a finite number >= 0")
        ended = self.registry.end_adapter(list(request.engines), request.name)
        engines = [self.registry.get(a.engine) for a in ended]
        try:
            await asyncio.gather(self.registry.drain_adapter(ended, timeout_s), self._save(
                *engines, drain_timeout_s=timeout_s, adapter=request.name))
        except Unavailable as err:
            raise FailedPrecondition(f"adapter {request.name!r} is MARKED, not removed: {err}"
                                     ) from err
        unloaded = await self.registry.drop_adapter(ended)
        await self._save(*engines)
        return gpb.RemoveAdapterResponse(engines=[e.name for e in engines], unloaded=unloaded)
