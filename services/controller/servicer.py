"""The `harnessrl.v1.Controller` gRPC service."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from harnessrl.rpc import map_errors
from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb, controller_pb2_grpc
from services.controller.run_manager import RunManager


@map_errors
class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(self, runs: RunManager) -> None:
        self.runs = runs

    async def CreateRun(self, request: cpb.CreateRunRequest,
                        context: grpc.aio.ServicerContext) -> c.Run:
        return await self.runs.create(request.spec, request.run_id)

    async def GetRun(self, request: c.GetRunRequest, context: grpc.aio.ServicerContext) -> c.Run:
        return await self.runs.get(request.run_id)

    async def ListRunRollouts(self, request: cpb.ListRunRolloutsRequest,
                              context: grpc.aio.ServicerContext) -> cpb.ListRunRolloutsResponse:
        rollouts = await self.runs.list_rollouts(request.run_id, request.include_calls)
        return cpb.ListRunRolloutsResponse(rollouts=rollouts)

    async def CancelRun(self, request: cpb.CancelRunRequest,
                        context: grpc.aio.ServicerContext) -> c.Run:
        return await self.runs.cancel(request.run_id)

    async def AdmissionUpdate(self, request: cpb.AdmissionUpdateRequest,
                              context: grpc.aio.ServicerContext) -> cpb.AdmissionStatus:
        return await self.runs.admission_update(request)

    async def WatchRun(self, request: cpb.WatchRunRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.RunEvent]:
        async for event in self.runs.watch(request.run_id):
            yield event
