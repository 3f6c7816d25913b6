"""Writes recorded calls to the store with group commit, holding them through store outages.

`record(call)` returns once the store has the call (STORED, or DUPLICATE of an earlier
delivery of the same call). Concurrent calls share batches, sent over a long-lived
`Store.RecordCalls` stream (per batch about half the CPU and latency of a unary AppendCalls);
each writer keeps one stream with one batch in flight, and the calls that arrive meanwhile
form the next batch. While the store is unreachable, calls wait in memory and are retried
with backoff on a new stream; a call not delivered within `hold_timeout_s` raises
`HoldTimeout`, and the harness then gets HTTP 503 instead of a response, so no response a
harness received is ever missing from the store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import grpc

from harnessrl.clients import AsyncStoreClient
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb

log = logging.getLogger("harnessrl.gateway.recorder")

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.RESOURCE_EXHAUSTED)


class RecordRejected(Exception):
    """The store refused the call (e.g. its attempt is no longer running)."""


class HoldTimeout(Exception):
    """The store stayed unreachable for longer than the hold timeout."""


@dataclass(slots=True)
class _Item:
    call: c.Call
    deadline: float
    future: asyncio.Future[None]


class _StreamEnded(Exception):
    """The store ended a RecordCalls stream without an error status."""


class CallRecorder:
    def __init__(self, store: AsyncStoreClient, hold_timeout_s: float, batch_max: int = 256,
                 writers: int = 1, batch_timeout_s: float = 10.0) -> None:
        self.store = store
        self.hold_timeout_s = hold_timeout_s
        self.batch_max = batch_max
        self.batch_timeout_s = batch_timeout_s
        self._loop = asyncio.get_running_loop()
        self._queue: deque[_Item] = deque()
        self._ready = asyncio.Event()
        self._tasks = [asyncio.create_task(self._writer(i)) for i in range(max(1, writers))]
        self.held = 0  # calls waiting now (gauge)
        self.store_down_since: float | None = None

    async def record(self, call: c.Call) -> None:
        item = _Item(call, time.monotonic() + self.hold_timeout_s, self._loop.create_future())
        self._queue.append(item)
        self._ready.set()
        self.held += 1
        try:
            await item.future
        finally:
            self.held -= 1

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _take(self) -> list[_Item]:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        batch: list[_Item] = []
        while self._queue and len(batch) < self.batch_max:
            batch.append(self._queue.popleft())
        return batch

    async def _writer(self, index: int) -> None:
        stream = _RecordStream(self.store, self.batch_timeout_s)
        try:
            while True:
                batch = await self._take()
                try:
                    await self._deliver(batch, stream)
                except Exception as exc:  # noqa: BLE001 - a writer must never die silently
                    log.exception("recording a batch failed")
                    stream.close()
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(RecordRejected(f"recorder error: {exc}"))
        finally:
            stream.close()

    async def _deliver(self, batch: list[_Item], stream: "_RecordStream") -> None:
        """Delivers one batch, retrying it through store outages until the items' deadlines."""
        backoff = 0.05
        while True:
            now = time.monotonic()
            live = []
            for item in batch:
                if item.future.done():  # its request was cancelled (the client went away)
                    continue
                if now >= item.deadline:
                    item.future.set_exception(HoldTimeout(
                        f"the store was unreachable for {self.hold_timeout_s:.0f}s; call not "
                        "recorded"))
                else:
                    live.append(item)
            if not live:
                return
            try:
                resp = await stream.exchange([i.call for i in live])
            except (grpc.aio.AioRpcError, _StreamEnded, asyncio.TimeoutError,
                    asyncio.InvalidStateError) as err:
                stream.close()
                code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
                if code is not None and code not in _RETRYABLE:
                    for item in live:
                        if not item.future.done():
                            item.future.set_exception(RecordRejected(
                                f"store refused the batch: {code.name}: "
                                f"{err.details()}"))  # type: ignore[union-attr]
                    return
                if self.store_down_since is None:
                    self.store_down_since = time.monotonic()
                    log.warning("store unreachable (%s); holding calls",
                                code.name if code is not None else type(err).__name__)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                batch = live
                continue
            if self.store_down_since is not None:
                log.info("store reachable again after %.1fs; delivering held calls",
                         time.monotonic() - self.store_down_since)
                self.store_down_since = None
            for item, result, reason in zip(live, resp.results, resp.reasons):
                if item.future.done():  # cancelled while the batch was in flight
                    continue
                if result in (spb.APPEND_RESULT_STORED, spb.APPEND_RESULT_DUPLICATE):
                    item.future.set_result(None)
                else:
                    item.future.set_exception(RecordRejected(reason or "rejected by the store"))
            return


class _RecordStream:
    """One writer's `Store.RecordCalls` stream: opened on first use, closed after a failure
    (the next batch opens a new one)."""

    def __init__(self, store: AsyncStoreClient, batch_timeout_s: float) -> None:
        self.store = store
        self.batch_timeout_s = batch_timeout_s
        self.call: Any = None

    async def exchange(self, calls: list[c.Call]) -> spb.AppendCallsResponse:
        """Writes one batch and reads its answer, within `batch_timeout_s` (a store that hangs
        counts as down)."""
        if self.call is None:
            self.call = self.store.record_calls()
        await self.call.write(spb.AppendCallsRequest(calls=calls))
        resp = await asyncio.wait_for(self.call.read(), self.batch_timeout_s)
        if resp is grpc.aio.EOF:
            raise _StreamEnded("the store ended the RecordCalls stream")
        if len(resp.results) != len(calls):
            raise RuntimeError(f"store answered {len(resp.results)} results for {len(calls)} "
                               "calls")
        return resp  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
            self.call = None
