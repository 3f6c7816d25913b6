"""gRPC `harnessrl.v1.GatewayAdmin`: engines, policy versions, pause and resume."""

from __future__ import annotations

import math

import grpc

from harnessrl.errors import InvalidArgument
from harnessrl.rpc import map_errors
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.v1 import gateway_pb2_grpc
from services.gateway.engines import EngineRegistry, EngineState
from services.gateway.registry_state import RegistryState
from services.gateway.weightcheck import WeightCheck


@map_errors
class GatewayAdminServicer(gateway_pb2_grpc.GatewayAdminServicer):
    """Every change is saved in the store (`registry_state`) before the RPC answers."""

    def __init__(self, registry: EngineRegistry, weights: WeightCheck | None = None,
                 state: RegistryState | None = None) -> None:
        self.registry = registry
        self.weights = weights  # checks an engine's own weights before it is resumed
        self.state = state

    async def _save(self, *engines: EngineState) -> None:
        if self.state is not None:
            await self.state.save(*engines)

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
            await self._save(*engines)
            if request.drain:
                await self.registry.drain_adapter(held, timeout_s)
        else:
            engines = self.registry.pause(list(request.engines))
            await self._save(*engines)
            if request.drain:
                await self.registry.drain(engines, timeout_s)
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
