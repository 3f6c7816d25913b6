"""The store's Prometheus series (served on `metrics_bind`).

- `harnessrl_store_calls_appended_total{result}`: calls given to AppendCalls / RecordCalls, by
  outcome (stored, duplicate, rejected, invalid, failed);
- `harnessrl_store_stream_entries{stream}`: entries in each completed-group stream;
- `harnessrl_store_stream_lag{stream, group}`: entries a consumer group has not read yet;
- `harnessrl_store_stream_pending{stream, group}`: entries read and not acknowledged yet.

The stream series are refreshed from Redis every `metrics_refresh_s` (`refresh_streams`).
"""

from __future__ import annotations

import asyncio
import logging

from collections import Counter

from prometheus_client import Counter as PromCounter, Gauge

from harnessrl.v1 import store_pb2 as spb
from services.store.group_stream import GroupStream

log = logging.getLogger("harnessrl.store")

APPENDED = PromCounter("harnessrl_store_calls_appended", "Calls given to the store, by outcome",
                   ["result"])
STREAM_ENTRIES = Gauge("harnessrl_store_stream_entries",
                       "Entries in a completed-group stream", ["stream"])
STREAM_LAG = Gauge("harnessrl_store_stream_lag",
                   "Entries of a stream a consumer group has not read yet", ["stream", "group"])
STREAM_PENDING = Gauge("harnessrl_store_stream_pending",
                       "Entries of a stream read by a consumer group and not acknowledged",
                       ["stream", "group"])
_BY_RESULT: dict[int, PromCounter] = {
    spb.APPEND_RESULT_STORED: APPENDED.labels("stored"),
    spb.APPEND_RESULT_DUPLICATE: APPENDED.labels("duplicate"),
    spb.APPEND_RESULT_REJECTED: APPENDED.labels("rejected"),
    spb.APPEND_RESULT_INVALID: APPENDED.labels("invalid"),
    spb.APPEND_RESULT_FAILED: APPENDED.labels("failed"),
    spb.APPEND_RESULT_CONFLICT: APPENDED.labels("conflict"),
    spb.APPEND_RESULT_UNSPECIFIED: APPENDED.labels("unspecified")}


def count_appended(results: list[int]) -> None:
    """Counts a batch's outcomes (one increment per distinct outcome)."""
    if len(results) == 1:
        _BY_RESULT[results[0]].inc()
        return
    for result, n in Counter(results).items():
        _BY_RESULT[result].inc(n)


async def refresh_streams(streams: GroupStream, every_s: float) -> None:
    """Keeps the stream series current until cancelled (a Redis error is logged and retried)."""
    while True:
        try:
            for stream, length, groups in await streams.stats():
                STREAM_ENTRIES.labels(stream).set(length)
                for group, lag, pending in groups:
                    STREAM_LAG.labels(stream, group).set(lag)
                    STREAM_PENDING.labels(stream, group).set(pending)
        except Exception as exc:  # noqa: BLE001 - metrics must not stop the store
            log.warning("stream metrics not refreshed: %s", exc)
        await asyncio.sleep(every_s)
