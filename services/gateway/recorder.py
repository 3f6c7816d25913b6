"""Writes recorded calls to the store with group commit, holding them through store outages.

`record(call)` returns once the store has the call (STORED, or DUPLICATE of an earlier
delivery of the same call). While the store is unreachable, calls wait in memory and are
retried with backoff; a call not delivered within `hold_timeout_s` raises `HoldTimeout`, and
the harness then gets HTTP 503 instead of a response, so no response a harness received is
ever missing from the store. Concurrent calls share AppendCalls batches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb

log = logging.getLogger("harnessrl.gateway.recorder")

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.RESOURCE_EXHAUSTED)


class RecordRejected(Exception):
    """The store refused the call (e.g. its attempt is no longer running)."""


class HoldTimeout(Exception):
    """The store stayed unreachable for longer than the hold timeout."""


@dataclass
class _Item:
    call: c.Call
    deadline: float
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop()
                                         .create_future())


class CallRecorder:
    def __init__(self, store: StoreClient, hold_timeout_s: float, batch_max: int = 256,
                 writers: int = 2) -> None:
        self.store = store
        self.hold_timeout_s = hold_timeout_s
        self.batch_max = batch_max
        self._queue: deque[_Item] = deque()
        self._ready = asyncio.Event()
        self._tasks = [asyncio.create_task(self._writer(i)) for i in range(max(1, writers))]
        self.held = 0  # calls waiting now (gauge)
        self.store_down_since: float | None = None

    async def record(self, call: c.Call) -> None:
        item = _Item(call, time.monotonic() + self.hold_timeout_s)
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
        batch = []
        while self._queue and len(batch) < self.batch_max:
            batch.append(self._queue.popleft())
        return batch

    async def _writer(self, index: int) -> None:
        while True:
            batch = await self._take()
            try:
                await self._deliver(batch)
            except Exception as exc:  # noqa: BLE001 - a writer must never die silently
                log.exception("recording a batch failed")
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(RecordRejected(f"recorder error: {exc}"))

    async def _deliver(self, batch: list[_Item]) -> None:
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
                resp = await self.store.append_calls([i.call for i in live], timeout=10.0)
            except grpc.aio.AioRpcError as err:
                if err.code() not in _RETRYABLE:
                    for item in live:
                        if not item.future.done():
                            item.future.set_exception(RecordRejected(
                                f"store refused the batch: {err.code().name}: "
                                f"{err.details()}"))
                    return
                if self.store_down_since is None:
                    self.store_down_since = time.monotonic()
                    log.warning("store unreachable (%s); holding calls", err.code().name)
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
