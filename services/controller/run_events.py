"""A run's events for its watchers (WatchRun): each rollout's state as it changes, then the
run's end. Every watcher has a queue of its own; a watcher that joins late first gets every
rollout's current state."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb


class RunEvents:
    def __init__(self) -> None:
        self._subscribers: set[asyncio.Queue[cpb.RunEvent]] = set()

    def publish(self, event: cpb.RunEvent) -> None:
        for q in self._subscribers:
            q.put_nowait(event)

    async def watch(self, rollouts: Callable[[], Iterable[c.Rollout]],
                    ended: Callable[[], c.Run | None]) -> AsyncIterator[cpb.RunEvent]:
        """`rollouts()`' current states, then live events, ending with KIND_RUN_DONE (at once
        when `ended()` gives the run's final record already)."""
        q: asyncio.Queue[cpb.RunEvent] = asyncio.Queue()
        self._subscribers.add(q)
        try:
            for ro in list(rollouts()):
                yield cpb.RunEvent(kind=cpb.RunEvent.KIND_ROLLOUT, rollout=ro)
            run = ended()
            if run is not None:
                yield cpb.RunEvent(kind=cpb.RunEvent.KIND_RUN_DONE, run=run)
                return
            while True:
                event = await q.get()
                yield event
                if event.kind == cpb.RunEvent.KIND_RUN_DONE:
                    return
        finally:
            self._subscribers.discard(q)
