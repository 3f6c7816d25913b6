"""A sync step's controller run and its groups: `loop.Trainer.generate` and `read_groups` in
sync mode (docs/modes.md).

- `mode.sync_spare_groups` 0 (plain sync): the run of the step's `tasks_per_step` tasks
  (`rollouts.run_step`), waited for to its end, then every group of it read off the stream
  (`StreamReader.read`).
- S > 0 (**sync-first**: sync taking the first complete groups, as the pool modes do): the run
  holds the step's tasks (`step_tasks`, as plain sync) and S spares (`spare_tasks`: a draw of
  its own seed, without the step's tasks). It is started without waiting
  (`RunLauncher.start`) and the stream polled (`StreamReader.poll_step`) until
  `tasks_per_step` of its groups have completed (fewer when dead letters leave fewer): the
  first ones in stream order are the step's, trained in the run's task order (its own tasks,
  then spares). The run is then cancelled (`RunLauncher.cancel`). Its other groups —
  completed in the same poll, or completing after the cancel (a cancelled rollout ends its
  group too) — are acknowledged untrained as **surplus**, not drops: right after the cancel,
  or by a later step's polls when they complete later still (`surplus` counts them, each is
  logged). Nothing is pushed while the step's run runs, so every call of its groups was
  served by the step's version, as in plain sync; the version check stays. The step's
  `rollouts` / `rollouts_failed` count the groups it took (as in the pool modes): rollouts
  cancelled on purpose are not failures.
- Restart: the run id is the step's (`rollouts.run_id_for`), so a step redone after a crash
  re-attaches to its run, cancelled or not (`cancelled_ok`). The groups its earlier life took
  were delivered and not acknowledged: they come back first in stream order (what it
  acknowledged as surplus does not), so the redo takes the same groups. Groups of later steps
  found pending then are held for their step (`StreamReader.poll_step`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from typing import Any

from harnessrl.v1 import common_pb2 as c

from .checkpoint import TrainState
from .config import TrainerConfig
from .records import StepRecord
from .rollouts import RunLauncher, StreamReader, canonical_order, run_step, step_spec, step_tasks

log = logging.getLogger("harnessrl.trainer")


def spare_tasks(tasks: Sequence[dict[str, Any]], seed: int, step: int,
                own: Sequence[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """Sync-first's `k` spare tasks of `step`: drawn without replacement from the tasks that are
    not the step's own (`own`), by a `random.Random` seeded apart from the step's draw (all of
    them, shuffled, when there are fewer than `k`)."""
    mine = {str(t["id"]) for t in own}
    rest = [t for t in tasks if str(t["id"]) not in mine]
    return random.Random(f"{seed}:{step}:spares").sample(rest, min(k, len(rest)))


class SyncSteps:
    """Rank 0's source of a sync step's groups (see the module docstring)."""

    def __init__(self, cfg: TrainerConfig, launcher: RunLauncher | None) -> None:
        self.cfg, self.launcher = cfg, launcher
        self.spares = cfg.mode.sync_spare_groups  # 0: plain sync
        self.taken: list[c.Group] = []  # sync-first: the step's groups, until `read`
        self.surplus = 0  # groups acknowledged untrained (this trainer life)

    def generate(self, reader: StreamReader | None, tasks: Sequence[dict[str, Any]],
                 state: TrainState, s: StepRecord) -> list[str]:
        """Runs step `s.step`'s run `s.run_id`; the ids of its tasks in order (the step's own,
        then the spares). The step's rollout counts go into `s`."""
        assert self.launcher is not None
        if not self.spares:
            run, ids = run_step(self.launcher, self.cfg, tasks, s.run_id, s.step)
            s.counts.update(rollouts=run.num_rollouts,
                            rollouts_failed=run.num_failed + run.num_cancelled)
            return ids
        assert reader is not None
        own = step_tasks(tasks, self.cfg.seed, s.step, self.cfg.tasks_per_step)
        chosen = own + spare_tasks(tasks, self.cfg.seed, s.step, own, self.spares)
        ids = [str(t["id"]) for t in chosen]
        started = self.launcher.start(s.run_id, step_spec(self.cfg, chosen), cancelled_ok=True)
        known = set(state.consumed_entries)
        ended = started.status != c.RUN_STATUS_RUNNING  # a redo: what it has is in the stream
        self.taken = self._take(reader, s, ids, known, ended)
        run = self.launcher.cancel(s.run_id)
        log.info("step %d: took %d groups of run %s; cancelled it (%d rollouts cancelled)",
                 s.step, len(self.taken), s.run_id, run.num_cancelled,
                 extra={"step": s.step, "run": s.run_id})
        new, late = reader.poll_step(s.run_id, s.step, known | self._entries(), block_ms=0)
        self._surplus(reader, new + late, s.step)  # the cancel's: its groups ended by now
        s.counts.update(rollouts=sum(len(g.rollouts) for g in self.taken),
                        rollouts_failed=sum(ro.status != c.ROLLOUT_STATUS_SUCCEEDED
                                            for g in self.taken for ro in g.rollouts))
        return ids

    def read(self, reader: StreamReader, run_id: str, step: int, task_order: Sequence[str],
             unacked: set[str]) -> list[c.Group]:
        """The step's groups: plain sync reads every group of its run, sync-first hands over
        those `generate` took."""
        if not self.spares:
            return reader.read(run_id, step, task_order, unacked)
        taken, self.taken = self.taken, []
        return taken

    def _entries(self) -> set[str]:
        return {g.entry_id for g in self.taken}

    def _take(self, reader: StreamReader, s: StepRecord, ids: list[str], known: set[str],
              ended: bool = False) -> list[c.Group]:
        """The first `tasks_per_step` groups of the run to complete (stream order), waiting up
        to `run_timeout_s`, in the run's task order; the others read meanwhile are surplus.
        `ended`: the run had ended before this step (re)started it (a step redone after a
        crash): no group comes after those in the stream, so fewer are taken when a dead
        letter left fewer (the spares it would have waited for were acknowledged as surplus)."""
        deadline = time.monotonic() + self.cfg.run_timeout_s
        got: list[c.Group] = []
        while True:
            new, late = reader.poll_step(s.run_id, s.step, known | {g.entry_id for g in got})
            self._surplus(reader, late, s.step)
            got += new
            dead = reader.dead_groups(s.run_id) - {g.group_id for g in got}
            need = min(self.cfg.tasks_per_step, len(ids) - len(dead))
            if len(got) >= need or (ended and not new and not late):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {s.step}: {len(got)} of {need} groups of run "
                                   f"{s.run_id} after {self.cfg.run_timeout_s:.0f}s")
            if not new:
                time.sleep(0.05)
        taken, extra = got[:need], got[need:]
        self._surplus(reader, extra, s.step)
        order = {t: i for i, t in enumerate(ids)}
        taken.sort(key=lambda g: (order.get(g.task_id, len(ids)), g.task_id))
        for g in taken:  # canonical order: the same batch, whatever order groups completed in
            canonical_order(g)
        return taken

    def _surplus(self, reader: StreamReader, groups: Sequence[c.Group], step: int) -> None:
        """Acknowledges `groups` untrained: completed after their step took its groups."""
        if not groups:
            return
        reader.ack([g.entry_id for g in groups])
        self.surplus += len(groups)
        log.info("step %d: %d surplus groups acknowledged untrained (completed after their "
                 "step took its groups): %s", step, len(groups),
                 ", ".join(f"{g.group_id} (run {g.run_id})" for g in groups),
                 extra={"step": step})
