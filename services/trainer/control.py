"""What the training loop and the Trainer gRPC service share: the status the loop publishes and
the requests (checkpoint now, stop) the service hands to the loop. Thread-safe: the loop runs
in the main thread, the gRPC server in its own thread."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from harnessrl.v1 import trainer_pb2 as tpb

RECENT_STEPS = 50


class TrainerControl:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status = tpb.TrainerStatus(state="starting")
        self._recent: deque[tpb.StepMetrics] = deque(maxlen=RECENT_STEPS)
        self._checkpoint_waiters: list[Future[tuple[str, int]]] = []
        self._stop = False
        self._skip_checkpoint = False
        self._ended = False

    # -- the loop's side ---------------------------------------------------------------------
    def set_state(self, state: str, **fields: Any) -> None:
        with self._lock:
            self._status.state = state
            for k, v in fields.items():
                setattr(self._status, k, v)

    def update(self, **fields: Any) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self._status, k, v)

    def show_counts(self, state: Any, **fields: Any) -> None:
        """The trainer state's (`checkpoint.TrainState`) step and group counts, with `fields`."""
        self.update(step=state.step, groups_trained=state.groups_trained,
                    groups_dropped=state.groups_dropped, staleness_max=state.staleness_max,
                    **fields)
        self.set_drop_reasons(state.drop_reasons)

    def set_drop_reasons(self, reasons: dict[str, int]) -> None:
        with self._lock:
            self._status.drop_reasons.clear()
            self._status.drop_reasons.update(reasons)

    def add_step(self, metrics: tpb.StepMetrics) -> None:
        with self._lock:
            self._recent.append(metrics)

    @property
    def stop_requested(self) -> bool:
        with self._lock:
            return self._stop

    @property
    def skip_checkpoint(self) -> bool:
        with self._lock:
            return self._skip_checkpoint

    def take_checkpoint_requests(self) -> list[Future[tuple[str, int]]]:
        with self._lock:
            waiters, self._checkpoint_waiters = self._checkpoint_waiters, []
            return waiters

    def end(self, error: str = "") -> None:
        """The loop is over: state "stopped"; pending checkpoint requests fail."""
        with self._lock:
            self._ended = True
            self._status.state = "stopped"
            self._status.error = error
            waiters, self._checkpoint_waiters = self._checkpoint_waiters, []
        for w in waiters:
            if not w.done():
                w.set_exception(RuntimeError("the training loop ended before the checkpoint"
                                             + (f": {error}" if error else "")))

    # -- the service's side ------------------------------------------------------------------
    def snapshot(self) -> tpb.TrainerStatus:
        with self._lock:
            status = tpb.TrainerStatus()
            status.CopyFrom(self._status)
            status.recent.extend(self._recent)
            return status

    def request_checkpoint(self) -> Future[tuple[str, int]]:
        """A future of (path, step), resolved after the step in progress is checkpointed."""
        fut: Future[tuple[str, int]] = Future()
        with self._lock:
            if self._ended:
                fut.set_exception(RuntimeError("the training loop has ended"))
            else:
                self._checkpoint_waiters.append(fut)
        return fut

    def request_stop(self, skip_checkpoint: bool = False) -> None:
        with self._lock:
            self._stop = True
            self._skip_checkpoint = self._skip_checkpoint or skip_checkpoint

    @property
    def ended(self) -> bool:
        with self._lock:
            return self._ended
