"""Writes recorded calls to the store with group commit, holding them through store outages.

`record(call)` returns once the store has the call (STORED, or DUPLICATE of an earlier
delivery of the same call). Concurrent calls share batches, sent over a long-lived
`Store.RecordCalls` stream (per batch about half the CPU and latency of a unary AppendCalls);
each writer keeps one stream with one batch in flight, and the calls that arrive meanwhile
form the next batch.

What the store said and what the transport did are told apart by one rule: the store's
answer is an `AppendCallsResponse` on the stream, and only that. Per call:
- STORED or DUPLICATE: recorded.
- REJECTED (unknown rollout, attempt not running): `RecordRejected`, HTTP 401 `rollout_closed`:
  the key no longer authorizes calls, as the gateway answers it at authentication once it
  knows. (Not 409: the OpenAI and Anthropic SDKs retry 409, and the retry would get 401.)
- INVALID (the call is malformed: the gateway's or its engine's fault): `RecordFailed`, 500.
- CONFLICT (another replica stored a call under its seq): `SeqConflict`; the app gives the call
  a new seq and records it again.
- FAILED (the store's own error storing it), an unknown result, or a response with the wrong
  number of results: `StoreFailed`, 502, with the store's reason.

Every other way a batch can fail is the transport's, and the batch is held and resent on a new
stream with backoff: the stream ending with any gRPC status (UNAVAILABLE when the store or its
Redis is down; INTERNAL "Internal error from Core", which grpc's asyncio client makes up itself
when a write meets a stream whose peer has died, e.g. the store killed mid-stream, and which the
store never sends; CANCELLED or INTERNAL from a reset HTTP/2 stream; a status from a store that
crashed in its servicer), the stream ending without a status, or no answer within
`batch_timeout_s` (a hung store; the wait never outlasts the batch's hold deadline). A store
that is up and fails answers FAILED in the stream (502 at once), so a status is never read as
the store's verdict, whatever its code: a store bug that ends the stream with one anyway is
held like an outage and answered 503 with that status as the last failure. Resending is safe: a call is keyed by (rollout, attempt, seq), so a batch the store took
before the stream broke comes back DUPLICATE and nothing is stored twice. A call not delivered
within `hold_timeout_s` raises `HoldTimeout`, 503 naming the last failure, so no response a
harness received is ever missing from the store.

Each error carries its HTTP status, error type and code (`app.py` answers with them).
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

_RECORDED = (spb.APPEND_RESULT_STORED, spb.APPEND_RESULT_DUPLICATE)
_NO_STATE = spb.GatewayCallState()


class RecordError(Exception):
    """The call was not recorded; `status`, `type`, `code`: the HTTP answer."""

    status, type, code = 500, "server_error", "record_failed"


class RecordRejected(RecordError):
    """The store refused the call: its attempt takes no calls (over, or unknown)."""

    status, type, code = 401, "authentication_error", "rollout_closed"


class RecordFailed(RecordError):
    """The gateway could not record the call: the store found it malformed, or a bug."""


class SeqConflict(RecordError):
    """Another call holds its seq (two replicas served the attempt at once): nothing stored."""

    code = "seq_conflict"


class StoreFailed(RecordError):
    """The store answered that it failed to store the call (its own error)."""

    status, type, code = 502, "server_error", "store_error"


class HoldTimeout(RecordError):
    """The store did not take the call within the hold timeout (unreachable, hung, broken)."""

    status, type, code = 503, "service_unavailable", "store_unavailable"


_ERRORS: dict[int, type[RecordError]] = {spb.APPEND_RESULT_REJECTED: RecordRejected,
                                         spb.APPEND_RESULT_INVALID: RecordFailed,
                                         spb.APPEND_RESULT_CONFLICT: SeqConflict}


@dataclass(slots=True)
class _Item:
    call: bytes  # the `Call`, serialised once (AppendCallsRequestBytes)
    state: spb.GatewayCallState | None  # what the store keeps for the attempt's later calls
    deadline: float
    future: asyncio.Future[None]


class _StreamEnded(Exception):
    """A RecordCalls stream ended without a status."""


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

    async def record(self, call: c.Call, state: spb.GatewayCallState | None = None) -> None:
        """Returns once the store has `call` (and `state`, written with it): the call as it is
        now, serialised once (the store keeps these bytes)."""
        item = _Item(call.SerializeToString(), state, time.monotonic() + self.hold_timeout_s,
                     self._loop.create_future())
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
        stream = _RecordStream(self.store)
        try:
            while True:
                batch = await self._take()
                try:
                    await self._deliver(batch, stream)
                except Exception as exc:  # noqa: BLE001 - a writer must never die silently
                    log.exception("recording a batch failed")
                    stream.close()
                    _fail(batch, RecordFailed(f"recorder error: {exc}"))
        finally:
            stream.close()

    async def _deliver(self, batch: list[_Item], stream: "_RecordStream") -> None:
        """Delivers one batch, resending it through transport failures until the items'
        deadlines (the module docstring has the rule)."""
        backoff = 0.05
        failure = "none"
        while True:
            now = time.monotonic()
            live = []
            for item in batch:
                if item.future.done():  # its request was cancelled (the client went away)
                    continue
                if now >= item.deadline:
                    item.future.set_exception(HoldTimeout(
                        f"the store did not take it within {self.hold_timeout_s:g}s (last "
                        f"failure: {failure})"))
                else:
                    live.append(item)
            if not live:
                return
            wait = min(self.batch_timeout_s, min(i.deadline for i in live) - now)
            try:
                resp = await stream.exchange(live, wait)
            except (grpc.aio.AioRpcError, _StreamEnded, asyncio.TimeoutError,
                    asyncio.InvalidStateError) as err:
                stream.close()
                failure = _describe(err, wait)
                if self.store_down_since is None:
                    self.store_down_since = time.monotonic()
                    log.warning("store unreachable (record stream: %s); holding calls", failure)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                batch = live
                continue
            if self.store_down_since is not None:
                log.info("store reachable again after %.1fs; delivering held calls",
                         time.monotonic() - self.store_down_since)
                self.store_down_since = None
            if len(resp.results) != len(live):
                _fail(live, StoreFailed(f"the store answered {len(resp.results)} results for "
                                        f"{len(live)} calls"))
                return
            reasons = list(resp.reasons) + [""] * (len(live) - len(resp.reasons))
            for item, result, reason in zip(live, resp.results, reasons):
                if item.future.done():  # cancelled while the batch was in flight
                    continue
                if result in _RECORDED:
                    item.future.set_result(None)
                else:
                    error = _ERRORS.get(result, StoreFailed)
                    item.future.set_exception(error(reason or f"the store answered {result}"))
            return


def _fail(items: list[_Item], err: RecordError) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(err)


def _describe(err: Exception, wait: float) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    if isinstance(err, asyncio.TimeoutError):
        return f"no answer in {wait:.2g}s"
    return str(err) or type(err).__name__


class _RecordStream:
    """One writer's `Store.RecordCalls` stream: opened on first use, closed after a failure
    (the next batch opens a new one)."""

    def __init__(self, store: AsyncStoreClient) -> None:
        self.store = store
        self.call: Any = None

    async def exchange(self, items: list[_Item], timeout: float) -> spb.AppendCallsResponse:
        """Writes one batch and reads its answer, within `timeout` (a store that hangs counts
        as down)."""
        if self.call is None:
            self.call = self.store.record_calls()
        call = self.call
        # the calls' bytes as they are (AppendCallsRequest's wire format: no copy of each
        # message into the request, no second serialisation)
        request = spb.AppendCallsRequestBytes(calls=[i.call for i in items])
        if any(i.state is not None for i in items):
            request.states.extend(i.state or _NO_STATE for i in items)
        async with asyncio.timeout(max(timeout, 0.001)):  # one timer, no task per batch
            await call.write(request)
            resp = await call.read()
        if resp is grpc.aio.EOF:
            raise _StreamEnded("the RecordCalls stream ended without a status")
        return resp  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
            self.call = None
