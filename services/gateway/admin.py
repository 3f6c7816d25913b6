"""gRPC `harnessrl.v1.GatewayAdmin`: engines, policy versions, pause and resume."""

from __future__ import annotations

import grpc

from harnessrl.rpc import map_errors
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.v1 import gateway_pb2_grpc
from services.gateway.engines import EngineRegistry
from services.gateway.weightcheck import WeightCheck


@map_errors
class GatewayAdminServicer(gateway_pb2_grpc.GatewayAdminServicer):
    def __init__(self, registry: EngineRegistry, weights: WeightCheck | None = None) -> None:
        self.registry = registry
        self.weights = weights  # checks an engine's own weights before it is resumed

    async def RegisterEngine(self, request: gpb.RegisterEngineRequest,
                             context: grpc.aio.ServicerContext) -> gpb.Engine:
        e = request.engine
        return self.registry.register(e.name, e.base_url, e.model, e.policy_version).to_proto()

    async def RemoveEngine(self, request: gpb.RemoveEngineRequest,
                           context: grpc.aio.ServicerContext) -> gpb.RemoveEngineResponse:
        self.registry.remove(request.name)
        return gpb.RemoveEngineResponse()

    async def ListEngines(self, request: gpb.ListEnginesRequest,
                          context: grpc.aio.ServicerContext) -> gpb.ListEnginesResponse:
        return gpb.ListEnginesResponse(
            engines=[e.to_proto() for e in self.registry.engines.values()])

    async def UpdateEngine(self, request: gpb.UpdateEngineRequest,
                           context: grpc.aio.ServicerContext) -> gpb.Engine:
        version = request.policy_version if request.HasField("policy_version") else None
        return self.registry.update(request.name, version, request.state,
                                    request.reason).to_proto()

    async def Pause(self, request: gpb.PauseRequest, context: grpc.aio.ServicerContext
                    ) -> gpb.PauseResponse:
        engines = self.registry.pause(list(request.engines))
        if request.drain:
            await self.registry.drain(engines, request.drain_timeout_s or 60.0)
        return gpb.PauseResponse(engines=[e.to_proto() for e in engines])

    async def Resume(self, request: gpb.ResumeRequest, context: grpc.aio.ServicerContext
                     ) -> gpb.ResumeResponse:
        if self.weights is not None:  # an engine holding other weights is MARKED first
            for eng in self.registry.select(list(request.engines)):
                if eng.paused and eng.reachable and not eng.marked:
                    await self.weights.verify(eng)
        engines = self.registry.resume(list(request.engines))
        return gpb.ResumeResponse(engines=[e.to_proto() for e in engines])
