"""Admission control of one run (async training, docs/modes.md).

A run with `RunSpec.admission_batch_groups` B > 0 starts a group's rollouts only while

    groups admitted < (admission_max_staleness + 1) * B + groups consumed

i.e. in flight + done-but-untrained < (η + 1) * B, where "consumed" is what the trainer has
taken off the stream (trained, skipped as zero-variance, or dropped as too stale), reported
with `Controller.AdmissionUpdate`. This is AReaL's rule (in flight + done-untrained <=
(η + 1 + v) * B - trained) with v * B replaced by what the trainer actually consumed: each step
consumes B groups, and counting dropped groups too keeps drops from shrinking the window
(which AReaL's form, counting only trained groups, would need v to catch up for).

The rule bounds work in flight, so staleness cannot grow without bound; the trainer still
checks every call's version against `max_staleness` when it takes a group (a group can be
overtaken by faster ones indefinitely) and drops what is too old.

Restart safety: a group counts as admitted once any of its rollouts left PENDING (the store's
record, reloaded when a run resumes); the consumed count lives in the trainer's checkpoint and
is re-sent by the trainer (it reports on every poll), the latest report winning (a trainer
resumed from a checkpoint reports fewer: the groups it consumed since come back to it). Until the
first report after a controller restart the consumed count is 0, which only admits less.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from harnessrl.statuses import TERMINAL
from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb


class Admission:
    def __init__(self, run_id: str, max_staleness: int, batch_groups: int) -> None:
        self.run_id = run_id
        self.window = (max_staleness + 1) * batch_groups
        self.admitted: set[str] = set()
        self.done: set[str] = set()
        self.consumed = 0
        self.policy_version = 0
        self.waiting: set[str] = set()
        self._changed = asyncio.Event()

    @property
    def limit(self) -> int:
        return self.window + self.consumed

    def restore(self, started_groups: Iterable[str], done_groups: Iterable[str]) -> None:
        """Groups the store shows started (some rollout not PENDING) count as admitted."""
        self.admitted.update(started_groups)
        self.done.update(done_groups)

    def update(self, consumed: int, policy_version: int) -> cpb.AdmissionStatus:
        if consumed > self.consumed:
            self._changed.set()
        self.consumed = consumed  # the latest wins: a restarted trainer reports its checkpoint's
        self.policy_version = max(self.policy_version, policy_version)
        return self.status()

    def group_done(self, group_id: str) -> None:
        self.done.add(group_id)

    def try_admit(self, group_id: str) -> bool:
        """Admits `group_id` if the rule allows (or it was admitted before)."""
        if group_id in self.admitted:
            return True
        if len(self.admitted) < self.limit:
            self.admitted.add(group_id)
            self.waiting.discard(group_id)
            return True
        return False

    async def admit(self, group_id: str) -> None:
        """Returns once `group_id` may start (at once when it was admitted before)."""
        while not self.try_admit(group_id):
            self.waiting.add(group_id)
            self._changed.clear()
            await self._changed.wait()

    def status(self) -> cpb.AdmissionStatus:
        return cpb.AdmissionStatus(
            run_id=self.run_id, groups_admitted=len(self.admitted),
            groups_done=len(self.done & self.admitted), groups_consumed=self.consumed,
            limit=self.limit, groups_waiting=len(self.waiting),
            policy_version=self.policy_version)


def started_and_done_groups(rollouts: "Iterable[c.Rollout]") -> tuple[set[str], set[str]]:
    """Groups with a rollout past PENDING, and groups whose every rollout ended."""
    started: set[str] = set()
    open_groups: set[str] = set()
    seen: set[str] = set()
    for ro in rollouts:
        seen.add(ro.group_id)
        if ro.status != c.ROLLOUT_STATUS_PENDING:
            started.add(ro.group_id)
        if ro.status not in TERMINAL:
            open_groups.add(ro.group_id)
    return started, (seen - open_groups) & started
