"""The controller's store client: every call survives the store restarting.

Store writes are idempotent (rollout id + attempt), so a call that found no store
(UNAVAILABLE) or got no answer in time (DEADLINE_EXCEEDED) is simply repeated, with backoff,
for a bounded time; past that bound `StoreUnavailable` is raised and the run fails loudly.
Other errors come back as the matching `harnessrl.errors` exception.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from harnessrl import rpc
from harnessrl.clients import AsyncStoreClient, StoreClient
from harnessrl.errors import Unavailable, from_rpc_error
from harnessrl.v1 import common_pb2 as c, store_pb2 as spb

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Reconnect quickly once a restarted store listens again (gRPC's default backoff grows to 120 s).
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class StoreUnavailable(Unavailable):
    """The store did not answer within the retry bound."""


class ResilientStore:
    def __init__(self, address: str, call_timeout_s: float = 15.0,
                 retry_s: float = 120.0) -> None:
        self.address = address
        self.retry_s = retry_s
        channel = rpc.aio_channel(address, StoreClient.peer, extra_options=_RECONNECT_OPTIONS)
        self.client: AsyncStoreClient = StoreClient(channel, timeout=call_timeout_s)

    async def close(self) -> None:
        await self.client.close()

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]],
                    retry_s: float | None = None) -> T:
        bound = self.retry_s if retry_s is None else retry_s
        start = time.monotonic()
        delay, warned_at = 0.1, 0.0
        while True:
            try:
                result = await fn()
                if warned_at:
                    log.info("store is back after %.1fs (%s)", time.monotonic() - start, what)
                return result
            except grpc.aio.AioRpcError as err:
                if err.code() not in RETRYABLE:
                    raise from_rpc_error(err) from err
                waited = time.monotonic() - start
                if waited >= bound:
                    msg = (f"store at {self.address} unavailable for {waited:.1f}s (bound "
                           f"{bound:g}s) during {what}: {err.code().name} {err.details()}")
                    log.error(msg)
                    raise StoreUnavailable(msg) from err
                if not warned_at or time.monotonic() - warned_at > 10:
                    log.warning("store unavailable (%s: %s), retrying %s for up to %gs",
                                err.code().name, err.details(), what, bound)
                    warned_at = time.monotonic()
                await asyncio.sleep(min(delay, max(0.0, bound - waited)))
                delay = min(delay * 2, 1.0)

    async def put_run(self, run: c.Run, retry_s: float | None = None) -> c.Run:
        return await self._call(f"PutRun {run.run_id}",
                                lambda: self.client.put_run(run), retry_s)

    async def list_runs(self, limit: int, retry_s: float | None = None) -> list[c.Run]:
        """The newest `limit` runs."""
        resp = await self._call("ListRuns", lambda: self.client.list_runs(limit), retry_s)
        return list(resp.runs)

    async def get_run(self, run_id: str, retry_s: float | None = None) -> c.Run:
        return await self._call(f"GetRun {run_id}", lambda: self.client.get_run(run_id),
                                retry_s)

    async def create_rollouts(self, rollouts: list[c.Rollout], retry_s: float | None = None
                              ) -> spb.CreateRolloutsResponse:
        return await self._call(f"CreateRollouts ({len(rollouts)})",
                                lambda: self.client.create_rollouts(rollouts), retry_s)

    async def start_attempt(self, rollout_id: str, attempt: int, workdir: str) -> c.Rollout:
        return await self._call(f"StartAttempt {rollout_id}#{attempt}",
                                lambda: self.client.start_attempt(rollout_id, attempt, workdir))

    async def finish_attempt(self, req: spb.FinishAttemptRequest) -> c.Rollout:
        return await self._call(f"FinishAttempt {req.rollout_id}#{req.attempt}",
                                lambda: self.client.finish_attempt(req))

    async def set_group_rewards(self, req: spb.SetGroupRewardsRequest
                                ) -> spb.SetGroupRewardsResponse:
        return await self._call(f"SetGroupRewards {req.group_id}",
                                lambda: self.client.set_group_rewards(req))

    async def list_group(self, group_id: str) -> list[c.Rollout]:
        """The group's rollouts with their current attempts' calls."""
        resp = await self._call(f"ListRollouts group {group_id}", lambda: self.client.list_rollouts(
            "", group_id=group_id, include_calls=True))
        return list(resp.rollouts)

    async def get_rollout(self, rollout_id: str) -> c.Rollout:
        return await self._call(f"GetRollout {rollout_id}",
                                lambda: self.client.get_rollout(rollout_id))

    async def list_rollouts(self, run_id: str, include_calls: bool = False,
                            retry_s: float | None = None) -> list[c.Rollout]:
        resp = await self._call(f"ListRollouts {run_id}",
                                lambda: self.client.list_rollouts(run_id,
                                                                  include_calls=include_calls),
                                retry_s)
        return list(resp.rollouts)
