"""gRPC `harnessrl.v1.Store`: maps requests onto `RolloutStore`, and Redis outages onto
UNAVAILABLE (callers retry; every write is idempotent)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from harnessrl.errors import Unavailable
from harnessrl.rpc import map_errors
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from harnessrl.v1 import store_pb2_grpc
from services.store.metrics import count_appended
from services.store.redis_store import RolloutStore

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


def _redis_unavailable(fn: F) -> F:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except _REDIS_DOWN as exc:
            raise Unavailable(f"redis unavailable: {exc}") from exc
    return wrapper  # type: ignore[return-value]


@map_errors
class StoreServicer(store_pb2_grpc.StoreServicer):
    def __init__(self, store: RolloutStore) -> None:
        self.store = store

    @_redis_unavailable
    async def PutRun(self, request: spb.PutRunRequest, context: grpc.aio.ServicerContext
                     ) -> c.Run:
        return await self.store.put_run(request.run)

    @_redis_unavailable
    async def GetRun(self, request: c.GetRunRequest, context: grpc.aio.ServicerContext) -> c.Run:
        return await self.store.get_run(request.run_id)

    @_redis_unavailable
    async def ListRuns(self, request: spb.ListRunsRequest, context: grpc.aio.ServicerContext
                       ) -> spb.ListRunsResponse:
        return spb.ListRunsResponse(runs=await self.store.list_runs(request.limit))

    @_redis_unavailable
    async def CreateRollouts(self, request: spb.CreateRolloutsRequest,
                             context: grpc.aio.ServicerContext) -> spb.CreateRolloutsResponse:
        created, existing = await self.store.create_rollouts(request.rollouts)
        return spb.CreateRolloutsResponse(created=created, existing=existing)

    @_redis_unavailable
    async def StartAttempt(self, request: spb.StartAttemptRequest,
                           context: grpc.aio.ServicerContext) -> c.Rollout:
        return await self.store.start_attempt(request.rollout_id, request.attempt,
                                              request.workdir)

    @_redis_unavailable
    async def AppendCalls(self, request: spb.AppendCallsRequest,
                          context: grpc.aio.ServicerContext) -> spb.AppendCallsResponse:
        results, reasons = await self.store.append_calls(request.calls)
        count_appended(results)
        return spb.AppendCallsResponse(results=results,  # type: ignore[arg-type]
                                       reasons=reasons)

    async def RecordCalls(self, request_iterator: AsyncIterator[spb.AppendCallsRequest],
                          context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[spb.AppendCallsResponse]:
        async for request in request_iterator:
            try:
                results, reasons = await self.store.append_calls(request.calls)
            except _REDIS_DOWN as exc:
                raise Unavailable(f"redis unavailable: {exc}") from exc
            count_appended(results)
            yield spb.AppendCallsResponse(results=results,  # type: ignore[arg-type]
                                          reasons=reasons)

    @_redis_unavailable
    async def ReportReward(self, request: spb.ReportRewardRequest,
                           context: grpc.aio.ServicerContext) -> c.Rollout:
        return await self.store.report_reward(request.rollout_id, request.attempt,
                                              request.reward)

    @_redis_unavailable
    async def FinishAttempt(self, request: spb.FinishAttemptRequest,
                            context: grpc.aio.ServicerContext) -> c.Rollout:
        return await self.store.finish_attempt(request)

    @_redis_unavailable
    async def GetRollout(self, request: spb.GetRolloutRequest,
                         context: grpc.aio.ServicerContext) -> c.Rollout:
        return await self.store.get_rollout(request.rollout_id, request.include_calls)

    @_redis_unavailable
    async def ListRollouts(self, request: spb.ListRolloutsRequest,
                           context: grpc.aio.ServicerContext) -> spb.ListRolloutsResponse:
        rollouts = await self.store.list_rollouts(request.run_id, request.group_id,
                                                  request.include_calls)
        return spb.ListRolloutsResponse(rollouts=rollouts)

    @_redis_unavailable
    async def ReadGroups(self, request: spb.ReadGroupsRequest,
                         context: grpc.aio.ServicerContext) -> spb.ReadGroupsResponse:
        groups = await self.store.read_groups(
            request.stream or "train", request.consumer_group or "trainer",
            request.consumer or "trainer-0", request.max_groups or 1, request.block_ms,
            request.include_calls)
        return spb.ReadGroupsResponse(groups=groups)

    @_redis_unavailable
    async def AckGroups(self, request: spb.AckGroupsRequest,
                        context: grpc.aio.ServicerContext) -> spb.AckGroupsResponse:
        n = await self.store.ack_groups(request.stream or "train",
                                        request.consumer_group or "trainer", request.entry_ids)
        return spb.AckGroupsResponse(acknowledged=n)
