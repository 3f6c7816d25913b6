"""The `harnessrl.v1.Trainer` gRPC service: status, checkpoint now, stop.

It runs in the gRPC server's thread and talks to the training loop only through
`TrainerControl`: status snapshots, and requests the loop answers between steps.
"""

from __future__ import annotations

import asyncio

import grpc

from harnessrl import rpc
from harnessrl.errors import FailedPrecondition
from harnessrl.v1 import trainer_pb2 as tpb
from harnessrl.v1 import trainer_pb2_grpc

from .control import TrainerControl


@rpc.map_errors
class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, control: TrainerControl) -> None:
        self.control = control

    async def GetStatus(self, request: tpb.GetStatusRequest, context: grpc.aio.ServicerContext
                        ) -> tpb.TrainerStatus:
        return self.control.snapshot()

    async def CheckpointNow(self, request: tpb.CheckpointNowRequest,
                            context: grpc.aio.ServicerContext) -> tpb.CheckpointNowResponse:
        """Answers once the step in progress is done and checkpointed (give the call a
        deadline longer than a step); FAILED_PRECONDITION when the loop has ended."""
        fut = self.control.request_checkpoint()
        try:
            path, step = await asyncio.wrap_future(fut)
        except RuntimeError as e:
            raise FailedPrecondition(str(e)) from e
        return tpb.CheckpointNowResponse(path=path, step=step)

    async def Stop(self, request: tpb.StopRequest, context: grpc.aio.ServicerContext
                   ) -> tpb.TrainerStatus:
        """Asks the loop to stop after the step in progress; returns the status at once."""
        self.control.request_stop(skip_checkpoint=request.skip_checkpoint)
        return self.control.snapshot()
