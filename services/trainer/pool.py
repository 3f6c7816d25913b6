"""Async and collocated modes' pool (docs/modes.md): one admission-controlled controller run of
every step's tasks (`rollouts.pool_spec`), the completed groups read from the stream and not
taken yet, and what the controller hears of the trainer's consumption (its admission window
moves with it). Rank 0 alone has one; `loop.Trainer` hands every rank the groups it takes.

`take` gives a step the first `tasks_per_step` completed groups (stream order) whose calls are
at most `mode.max_staleness` versions old (`staleness.select_groups`); older ones before them
are dropped, each with its reason, into the step's record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from harnessrl.v1 import common_pb2 as c

from .checkpoint import TrainState
from .config import TrainerConfig
from .gauges import GatewayHold
from .records import StepRecord
from .rollouts import AdmissionReporter, RunLauncher, StreamReader, canonical_order, pool_spec
from .staleness import call_versions, select_groups

log = logging.getLogger("harnessrl.trainer")


class AsyncPool:
    """The pool run and its groups read, not taken yet. It reads the trainer's `TrainState`
    (consumed entries and counts, policy version) and owns none of it."""

    def __init__(self, cfg: TrainerConfig, launcher: RunLauncher | None,
                 admission: AdmissionReporter | None, hold: GatewayHold | None) -> None:
        self.cfg = cfg
        self.launcher = launcher
        self.admission = admission  # tells the controller what the trainer consumed
        self.hold = hold  # collocated: its windows tell which calls were held
        self.run_id = ""  # the pool's controller run ("" until `open`)
        self.waiting: dict[str, c.Group] = {}  # completed groups read, not taken (entry order)

    def open(self, state: TrainState, tasks: Sequence[dict[str, Any]]) -> None:
        """Creates (or re-attaches to) the pool run, without waiting for it; the controller
        admits its groups as the trainer consumes them."""
        assert self.launcher is not None
        self.run_id = f"{state.run_prefix}-{self.cfg.mode.kind}"
        spec = pool_spec(self.cfg, tasks)
        if self.hold is not None:  # collocated: refused before the run is created
            self.hold.refuse_judges(spec.group_grader_command)
        self.launcher.start(self.run_id, spec)
        self.report(state)

    def report(self, state: TrainState, taken: int = 0) -> None:
        """Tells the controller the groups consumed: trained or dropped by the steps done, and
        `taken` by the step that waits (so the window keeps moving while it waits, and a
        restarted controller hears from the trainer)."""
        if self.admission is not None and self.run_id:
            self.admission.report(self.run_id, state.groups_trained + state.groups_dropped
                                  + taken, state.policy_version)

    def take(self, reader: StreamReader, s: StepRecord, state: TrainState) -> list[c.Group]:
        """Step `s`'s groups (the module docstring), waiting up to `run_timeout_s` for them."""
        t0 = time.perf_counter()
        version, batch = state.policy_version, self.cfg.tasks_per_step
        deadline = time.monotonic() + self.cfg.run_timeout_s
        kept: list[c.Group] = []
        while True:
            known = set(state.consumed_entries) | set(self.waiting) | \
                {g.entry_id for g in kept + s.dropped}
            for g in reader.poll(self.run_id, known):
                self.waiting[g.entry_id] = g
            sel = select_groups(list(self.waiting.values()), version,
                                self.cfg.mode.max_staleness, batch - len(kept))
            for g, reason in sel.dropped:
                del self.waiting[g.entry_id]
                s.drop(g, reason)
                log.warning("step %d: dropping group %s: %s", s.step, g.group_id, reason,
                            extra={"step": s.step})
            for g in sel.kept:
                del self.waiting[g.entry_id]
                kept.append(g)
            self.report(state, len(kept) + len(s.dropped))
            if len(kept) == batch:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {s.step}: {len(kept)} of {batch} groups of run "
                                   f"{self.run_id} after {self.cfg.run_timeout_s:.0f}s")
            time.sleep(0.2)
        for g in kept:
            canonical_order(g)
            s.staleness += [version - min(call_versions(g) or [version])] * len(g.rollouts)
            if self.hold is not None:
                s.held_calls += sum(1 for r in g.rollouts for call in r.calls
                                    if self.hold.held(call.started_at))
        s.counts.update(rollouts=sum(len(g.rollouts) for g in kept),
                        rollouts_failed=sum(1 for g in kept for r in g.rollouts
                                            if r.status != c.ROLLOUT_STATUS_SUCCEEDED))
        s.run_id = self.run_id
        s.timed("generate_s", t0)
        return kept

    def close(self) -> None:
        """The pool run's groups never admitted are not needed any more: cancelled."""
        if self.run_id and self.launcher is not None:
            self.launcher.cancel(self.run_id)
