"""gRPC `harnessrl.v1.Store`: maps requests onto `RolloutStore`, and Redis outages onto
UNAVAILABLE (callers retry; every write is idempotent)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from harnessrl.errors import InvalidArgument, Unavailable
from harnessrl.rpc import map_errors
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from harnessrl.v1 import store_pb2_grpc
from services.store.call_bytes import CallBatch
from services.store.images import ImageStore
from services.store.metrics import count_appended
from services.store.redis_store import RolloutStore
from services.store.state_space import require as _require

log = logging.getLogger("harnessrl.store")
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
    def __init__(self, store: RolloutStore, max_state_value_bytes: int = 1024 * 1024,
                 max_state_keys: int = 10_000, images: ImageStore | None = None) -> None:
        self.store = store
        self.images = images or ImageStore(store.r, store.p, 20 * 1024 * 1024, 2 * 1024 ** 3)
        self.max_state_value_bytes = max_state_value_bytes
        self.max_state_keys = max_state_keys

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
    async def AppendCalls(self, request: CallBatch,  # type: ignore[override]
                          context: grpc.aio.ServicerContext) -> spb.AppendCallsResponse:
        """(Requests read by `call_bytes.decode`: each call with the bytes it came in.)"""
        results, reasons = await self.store.append_calls(request.calls, request.states,
                                                         request.data)
        count_appended(results)
        return spb.AppendCallsResponse(results=results,  # type: ignore[arg-type]
                                       reasons=reasons)

    async def RecordCalls(self,  # type: ignore[override]
                          request_iterator: AsyncIterator[CallBatch],
                          context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[spb.AppendCallsResponse]:
        """AppendCalls per batch, answered in order. The store's own errors are answered in
        the stream, never as a status (a caller takes any status for a broken stream and
        resends): a batch that fails is appended call by call, and a call that fails alone is
        APPEND_RESULT_FAILED with the reason, so one rollout's broken keys fail only its own
        calls. Redis unreachable ends the stream with UNAVAILABLE."""
        async for request in request_iterator:
            try:
                try:
                    results, reasons = await self.store.append_calls(
                        request.calls, request.states, request.data)
                except _REDIS_DOWN:
                    raise
                except Exception:  # noqa: BLE001 - answered per call below
                    log.exception("appending a batch of %d calls failed; appending them one by "
                                  "one", len(request.calls))
                    results, reasons = await self._one_by_one(request)
            except _REDIS_DOWN as exc:
                raise Unavailable(f"redis unavailable: {exc}") from exc
            count_appended(results)
            yield spb.AppendCallsResponse(results=results,  # type: ignore[arg-type]
                                          reasons=reasons)

    async def _one_by_one(self, request: CallBatch) -> tuple[list[int], list[str]]:
        results, reasons = [], []
        states = list(request.states)
        for i, call in enumerate(request.calls):
            try:
                (result,), (reason,) = await self.store.append_calls(
                    [call], states[i:i + 1] if len(states) == len(request.calls) else (),
                    request.data[i:i + 1])
            except _REDIS_DOWN:
                raise
            except Exception as exc:  # noqa: BLE001 - the store's error, answered as FAILED
                result, reason = spb.APPEND_RESULT_FAILED, (f"store error: {type(exc).__name__}:"
                                                            f" {exc}")
            results.append(result)
            reasons.append(reason)
        return results, reasons

    @_redis_unavailable
    async def GetGatewayState(self, request: spb.GetGatewayStateRequest,
                              context: grpc.aio.ServicerContext) -> spb.GatewayState:
        _require(request.rollout_id, "rollout_id")
        return await self.store.calls.gateway_state(request)

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
    async def SetGroupRewards(self, request: spb.SetGroupRewardsRequest,
                              context: grpc.aio.ServicerContext) -> spb.SetGroupRewardsResponse:
        rollouts, published = await self.store.set_group_rewards(request)
        return spb.SetGroupRewardsResponse(rollouts=rollouts, published=published)

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
        groups = await self.store.groups.read(
            request.stream or "train", request.consumer_group or "trainer",
            request.consumer or "trainer-0", _bounded(request.max_groups or 1, 10_000),
            _bounded(request.block_ms, 60_000), request.include_calls,
            max(0, request.max_deliveries), request.new_only)
        return spb.ReadGroupsResponse(groups=groups)

    @_redis_unavailable
    async def AckGroups(self, request: spb.AckGroupsRequest,
                        context: grpc.aio.ServicerContext) -> spb.AckGroupsResponse:
        n = await self.store.groups.ack(request.stream or "train",
                                        request.consumer_group or "trainer", request.entry_ids)
        return spb.AckGroupsResponse(acknowledged=n)

    @_redis_unavailable
    async def NackGroups(self, request: spb.NackGroupsRequest,
                         context: grpc.aio.ServicerContext) -> spb.NackGroupsResponse:
        stream = request.stream or "train"
        redelivered, dead = await self.store.groups.nack(
            stream, request.consumer_group or "trainer", request.consumer or "trainer-0",
            list(request.entry_ids), request.reason, max(0, request.max_deliveries),
            request.redeliver, request.include_calls)
        letters = []
        if dead:  # the newest dead letters hold them
            wanted = set(dead)
            letters = [d for d in await self.store.groups.dead_letters(stream, 10 * len(dead) + 100)
                       if d.original_entry_id in wanted]
        return spb.NackGroupsResponse(dead_letters=letters, redelivered=redelivered)

    @_redis_unavailable
    async def ListDeadLetters(self, request: spb.ListDeadLettersRequest,
                              context: grpc.aio.ServicerContext) -> spb.ListDeadLettersResponse:
        letters = await self.store.groups.dead_letters(request.stream or "train", request.limit)
        return spb.ListDeadLettersResponse(dead_letters=letters)

    @_redis_unavailable
    async def TrimGroups(self, request: spb.TrimGroupsRequest,
                         context: grpc.aio.ServicerContext) -> spb.TrimGroupsResponse:
        trimmed, min_id = await self.store.groups.trim(request.stream or "train",
                                                        request.below_entry_id)
        return spb.TrimGroupsResponse(trimmed=trimmed, min_entry_id=min_id)

    @_redis_unavailable
    async def PutState(self, request: spb.PutStateRequest,
                       context: grpc.aio.ServicerContext) -> spb.PutStateResponse:
        if len(request.value) > self.max_state_value_bytes:
            raise InvalidArgument(f"state value of {len(request.value)} bytes is over the "
                                  f"{self.max_state_value_bytes}-byte limit")
        _check_name(request.namespace, "namespace")
        _check_name(request.key, "key")
        await self.store.state.put(request.namespace, request.key, request.value,
                                   self.max_state_keys)
        return spb.PutStateResponse()

    @_redis_unavailable
    async def DeleteState(self, request: spb.DeleteStateRequest,
                          context: grpc.aio.ServicerContext) -> spb.DeleteStateResponse:
        _check_name(request.namespace, "namespace")
        _check_name(request.key, "key")
        return spb.DeleteStateResponse(
            deleted=await self.store.state.delete(request.namespace, request.key))

    @_redis_unavailable
    async def GetState(self, request: spb.GetStateRequest,
                       context: grpc.aio.ServicerContext) -> spb.GetStateResponse:
        _check_name(request.namespace, "namespace")
        _check_name(request.key, "key")
        value = await self.store.state.get(request.namespace, request.key)
        return spb.GetStateResponse(found=value is not None, value=value or b"")

    @_redis_unavailable
    async def ListState(self, request: spb.ListStateRequest,
                        context: grpc.aio.ServicerContext) -> spb.ListStateResponse:
        _check_name(request.namespace, "namespace")
        entries = await self.store.state.list(request.namespace)
        return spb.ListStateResponse(entries=[spb.StateEntry(key=k, value=v)
                                              for k, v in entries])

    @_redis_unavailable
    async def PutImages(self, request: spb.PutImagesRequest,
                        context: grpc.aio.ServicerContext) -> spb.PutImagesResponse:
        return await self.images.put(request.images, request.rollout_id,
                                     request.max_rollout_bytes, request.present)

    @_redis_unavailable
    async def GetImages(self, request: spb.GetImagesRequest,
                        context: grpc.aio.ServicerContext) -> spb.GetImagesResponse:
        return spb.GetImagesResponse(images=await self.images.get(request.sha256))


def _bounded(value: int, most: int) -> int:
    return max(0, min(value, most))


def _check_name(value: str, what: str) -> None:
    if not value:
        raise InvalidArgument(f"{what} is required")
    if len(value) > 256:
        raise InvalidArgument(f"{what} is longer than 256 characters")
