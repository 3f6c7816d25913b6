"""Where a step's groups come from: the step's tasks, its controller run, its stream entries.

- `step_tasks`: the tasks of step s, drawn without replacement from the task file by a
  `random.Random` seeded with (seed, s) — the same on every restart.
- `run_step` (sync mode), through `ControllerRuns.run`: `CreateRun` with the step's
  deterministic run id (idempotent: a restarted trainer re-attaches to the run its previous
  life created, finished or not) and `WatchRun` until the run is done. A watch cut short
  (controller restart) re-attaches.
- `StreamReader.read`: the completed groups of one run from the store's stream, through the
  trainer's consumer group (its first read reads the pending entries, so entries delivered to a
  crashed trainer and never acknowledged come back — one more delivery each; later reads take
  new entries only; `StreamReader.poll`, the async pool's read, does the same, since each
  read of a pending entry counts as a delivery). Entries of other runs found there are sorted
  out: entries of this trainer's own later steps are kept for their step, entries trained since
  the last checkpoint stay pending; entries of its earlier, checkpointed steps (their ack was
  lost) and of runs that are not this trainer's are acknowledged and skipped — the stream is
  the trainer's own (see the config). `StreamReader.poll_step`, sync-first's read
  (sync_first.py), polls one step's run the same way and hands back its earlier steps' entries
  (their surplus groups) apart. Groups delivered `max_deliveries` times go to the dead-letter
  stream (the store does it); the run's step then has fewer groups than tasks.
- `StreamReader.screen`: rank 0 builds each group's samples before the step trains: a group
  whose samples cannot be built is reported (NackGroups) and delivered again until it builds or
  is dead-lettered (`max_deliveries`); `fail` reports the groups of a step whose training
  failed; `trim` trims the stream below what the retained checkpoints consumed.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from harnessrl.clients import ControllerClient, StoreClient
from harnessrl.run_sandbox import sandbox_spec
from harnessrl.tasks import load_task_file
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import controller_pb2 as cpb
from harnessrl.v1 import store_pb2 as spb

log = logging.getLogger("harnessrl.trainer")


def load_tasks(path: str | Path) -> list[dict[str, Any]]:
    """The task file's tasks, each with its id (`harnessrl.tasks` rules) in "id"."""
    return [{**data, "id": tid} for tid, data in load_task_file(path)]


def step_tasks(tasks: Sequence[dict[str, Any]], seed: int, step: int, k: int
               ) -> list[dict[str, Any]]:
    """The `k` tasks of `step` (all of them, shuffled, when there are fewer than `k`)."""
    rng = random.Random(f"{seed}:{step}")
    return rng.sample(list(tasks), min(k, len(tasks)))


def run_id_for(prefix: str, step: int) -> str:
    return f"{prefix}-step{step:06d}"


def step_of_run(prefix: str, run_id: str) -> int | None:
    """The step a run id of this trainer belongs to; None for another trainer's run."""
    head = f"{prefix}-step"
    if run_id.startswith(head) and run_id[len(head):].isdigit():
        return int(run_id[len(head):])
    return None


def run_step(launcher: RunLauncher, cfg: Any, tasks: Sequence[dict[str, Any]], run_id: str,
             step: int) -> tuple[c.Run, list[str]]:
    """Sync mode's controller run `run_id` of `step`'s tasks, until it is done (an error
    unless it succeeded; cfg: `TrainerConfig`): the run and the ids of its tasks, in order."""
    chosen = step_tasks(tasks, cfg.seed, step, cfg.tasks_per_step)
    run = launcher.run(run_id, step_spec(cfg, chosen))
    if run.status != c.RUN_STATUS_SUCCEEDED:
        raise RuntimeError(f"run {run_id} ended {c.RunStatus.Name(run.status)}: {run.error}")
    if run.num_failed:
        log.warning("run %s: %d of %d rollouts failed", run_id, run.num_failed,
                    run.num_rollouts, extra={"run": run_id, "step": step})
    return run, [str(t["id"]) for t in chosen]


class RunLauncher(Protocol):
    """Produces rollouts: `run` runs `spec` under `run_id` until it is done (sync mode);
    `start` creates it and returns at once, `cancel` ends it (async mode's one run, a
    sync-first step's run). `start` refuses a run that ended unsucceeded, but with
    `cancelled_ok` one that was cancelled (a sync-first step redone after a restart)."""

    def run(self, run_id: str, spec: c.RunSpec) -> c.Run: ...

    def start(self, run_id: str, spec: c.RunSpec, cancelled_ok: bool = False) -> c.Run: ...

    def cancel(self, run_id: str) -> c.Run: ...


class AdmissionReporter(Protocol):
    """Tells the controller how many groups of `run_id` the trainer consumed (async mode)."""

    def report(self, run_id: str, consumed: int, version: int) -> None: ...


class ControllerRuns:
    """`RunLauncher` over the controller's gRPC API. A LoRA trainer's runs name its adapter
    (`RunSpec.adapter`): the gateway serves their calls with it."""

    def __init__(self, controller: ControllerClient, timeout_s: float, adapter: str = ""
                 ) -> None:
        self.controller = controller
        self.timeout_s = timeout_s
        self.adapter = adapter

    def run(self, run_id: str, spec: c.RunSpec) -> c.Run:
        spec.adapter = self.adapter
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                run = self.controller.create_run(spec, run_id=run_id)
                if run.status != c.RUN_STATUS_RUNNING:
                    return run
                left = deadline - time.monotonic()
                for event in self.controller.watch_run(run_id, timeout=max(left, 1.0)):
                    if event.kind == cpb.RunEvent.KIND_RUN_DONE:
                        return event.run
                log.warning("watch of run %s ended before the run did; re-attaching", run_id,
                            extra={"run": run_id})
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED or \
                        time.monotonic() > deadline:
                    raise TimeoutError(f"run {run_id} not done after {self.timeout_s:.0f}s"
                                       ) from e
                if e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                log.warning("run %s: %s (%s); retrying", run_id, e.code().name, e.details(),
                            extra={"run": run_id})
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} not done after {self.timeout_s:.0f}s")
            time.sleep(1.0)


    def start(self, run_id: str, spec: c.RunSpec, cancelled_ok: bool = False) -> c.Run:
        spec.adapter = self.adapter
        run = self.controller.create_run(spec, run_id=run_id)
        ok = (c.RUN_STATUS_RUNNING, c.RUN_STATUS_SUCCEEDED) + \
            ((c.RUN_STATUS_CANCELLED,) if cancelled_ok else ())
        if run.status not in ok:
            raise RuntimeError(f"run {run_id} is {c.RunStatus.Name(run.status)}: {run.error}")
        return run

    def cancel(self, run_id: str) -> c.Run:
        return self.controller.cancel_run(run_id)


PENDING_MAX = 10_000
"""The most groups an async trainer's previous life can have left pending (read, not
acknowledged: its pool and the steps since its checkpoint); its successor's first poll takes
them all (the store's own bound on one read). A sync step's first read asks for the entries
since the checkpoint plus its own, which is every pending one."""


class StreamReader:
    """Reads one run's groups from the trainer's stream (see the module docstring)."""

    def __init__(self, store: StoreClient, stream: str, consumer_group: str, consumer: str,
                 run_prefix: str, timeout_s: float, max_deliveries: int = 0) -> None:
        self.store = store
        self.stream, self.consumer_group, self.consumer = stream, consumer_group, consumer
        self.run_prefix = run_prefix
        self.timeout_s = timeout_s
        self.max_deliveries = max_deliveries
        self.started = False  # the pending entries are read once per trainer life
        self.held: dict[str, c.Group] = {}  # delivered entries of later steps
        self.dead: dict[str, set[str]] = {}  # run id -> its dead-lettered group ids

    def _note_dead(self, letters: Sequence[Any]) -> None:
        for d in letters:
            self.dead.setdefault(d.run_id, set()).add(d.group_id)

    def nack(self, groups: Sequence[c.Group], reason: str, redeliver: bool
             ) -> tuple[list[c.Group], list[Any]]:
        """Reports a failed delivery; returns (redelivered groups, new dead letters)."""
        resp = self.store.nack_groups(
            [g.entry_id for g in groups], reason, self.max_deliveries, redeliver=redeliver,
            stream=self.stream, consumer_group=self.consumer_group, consumer=self.consumer)
        self._note_dead(resp.dead_letters)
        return list(resp.redelivered), list(resp.dead_letters)

    def fail(self, groups: Sequence[c.Group], reason: str) -> None:
        """A step's training failed: with a bound on deliveries, each of its groups counts a
        failed delivery (the restart redelivers them); without one, nothing is reported."""
        if self.max_deliveries:
            self.nack(groups, reason, redeliver=False)

    def screen(self, groups: Sequence[c.Group], build: Callable[[c.Group], Any]
               ) -> tuple[list[c.Group], dict[str, Any]]:
        """The groups whose samples `build` makes, and entry id -> what it made. A group whose
        samples cannot be built is reported (NackGroups) and delivered again, until it builds
        or has been delivered `max_deliveries` times (then it is dead-lettered and left out).
        With no bound (0) the error propagates."""
        ok, built = [], {}
        for g in groups:
            while True:
                try:
                    built[g.entry_id] = build(g)
                    ok.append(g)
                    break
                except Exception as exc:  # noqa: BLE001 - the group is reported, not lost
                    if self.max_deliveries == 0:
                        raise
                    reason = f"samples of group {g.group_id}: {type(exc).__name__}: {exc}"
                    log.warning("%s; reporting the failed delivery", reason)
                    again, dead = self.nack([g], reason, redeliver=True)
                    if dead or not again:
                        log.error("group %s dead-lettered after %s deliveries: %s", g.group_id,
                                  dead[0].deliveries if dead else "?", reason)
                        break
                    g = again[0]
                    canonical_order(g)
        return ok, built

    def trim(self, below: str) -> None:
        """Trims the stream below entry `below` (the store keeps whatever a consumer group has
        pending or not yet read); a failure is logged (housekeeping: the next one retries)."""
        try:
            resp = self.store.trim_groups(below, stream=self.stream)
        except grpc.RpcError as err:
            log.warning("trimming stream %s failed: %s", self.stream, err)
            return
        if resp.trimmed:
            log.info("stream %s: trimmed %d entries below %s", self.stream, resp.trimmed,
                     resp.min_entry_id)

    def dead_groups(self, run_id: str) -> set[str]:
        return self.dead.get(run_id, set())

    def ack_resumed(self, consumed: list[str]) -> None:
        """Acknowledges the entries a resumed checkpoint consumed (trained: in the
        checkpoint)."""
        if consumed:
            n = self.ack(consumed)
            log.info("acknowledged %d of the %d entries the checkpoint consumed", n,
                     len(consumed))

    def ack(self, entry_ids: Sequence[str]) -> int:
        if not entry_ids:
            return 0
        return self.store.ack_groups(list(entry_ids), stream=self.stream,
                                     consumer_group=self.consumer_group).acknowledged

    def _read(self, max_groups: int, block_ms: int) -> spb.ReadGroupsResponse:
        """One ReadGroups: this consumer's pending entries (left by a trainer that died) on the
        first read of the trainer's life, new entries only after that. Every read of a pending
        entry counts as a delivery toward `max_deliveries`, so pending entries must not be
        re-read while this trainer holds them. A store that is unavailable (restarting) reads
        as nothing: `read` tries again until its deadline, the async pool at its next poll."""
        first = not self.started
        try:
            resp = self.store.read_groups(
                stream=self.stream, consumer_group=self.consumer_group, consumer=self.consumer,
                max_groups=max_groups, block_ms=block_ms, include_calls=True,
                max_deliveries=self.max_deliveries, new_only=not first)
        except grpc.RpcError as e:  # the store restarting: nothing read; the caller reads again
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            log.warning("stream %s: store unavailable (%s); reading again", self.stream,
                        e.details())
            return spb.ReadGroupsResponse()
        self.started = True
        if first and self.max_deliveries > 0:  # what the store dead-lettered on this read
            self._note_dead(self.store.list_dead_letters(self.stream, 1000).dead_letters)
        return resp

    def read(self, run_id: str, step: int, task_order: Sequence[str], unacked: set[str]
             ) -> list[c.Group]:
        """The groups of `run_id` (one per task), in `task_order`, rollouts by index."""
        expected = len(task_order)
        got: dict[str, c.Group] = {}
        deadline = time.monotonic() + self.timeout_s

        def missing() -> int:
            return expected - len(got) - len(self.dead_groups(run_id) -
                                             {g.group_id for g in got.values()})

        while missing() > 0:
            resp = self._read(len(unacked) + expected + 16, block_ms=500)
            pool = [*self.held.values(), *resp.groups]
            self.held.clear()
            stray: list[str] = []
            for g in pool:
                if g.run_id == run_id:
                    got[g.entry_id] = g
                    continue
                if g.entry_id in unacked:
                    continue  # trained since the last checkpoint; acknowledged with it
                other = step_of_run(self.run_prefix, g.run_id)
                if other is not None and other > step:
                    self.held[g.entry_id] = g  # a later step's, from before a restart
                    continue
                log.warning("stream %s: acknowledging entry %s of run %s without training it "
                            "(%s)", self.stream, g.entry_id, g.run_id,
                            "not this trainer's run" if other is None
                            else f"step {other}, already in a checkpoint")
                stray.append(g.entry_id)
            self.ack(stray)
            if missing() > 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run {run_id}: {len(got)} of {expected} groups in "
                                       f"stream {self.stream!r} after {self.timeout_s:.0f}s")
                time.sleep(0.2)
        dead = self.dead_groups(run_id)
        if dead:
            log.warning("run %s: %d of %d groups are dead-lettered; the step trains without "
                        "them", run_id, len(dead), expected, extra={"run": run_id})
        if len(got) > expected:
            raise RuntimeError(f"run {run_id}: {len(got)} groups for {expected} tasks")
        order = {t: i for i, t in enumerate(task_order)}
        groups = sorted(got.values(), key=lambda g: (order.get(g.task_id, expected), g.task_id))
        for g in groups:  # canonical order: the same batch, whatever order groups completed in
            canonical_order(g)
        return groups

    def poll(self, run_id: str, known: set[str]) -> list[c.Group]:
        """Completed groups of `run_id` in stream order, but those in `known` (taken since the
        last checkpoint, or read already); other runs' entries are acknowledged and skipped."""
        # the first read takes every pending entry (later reads never return to them)
        resp = self._read(len(known) + 64 + (0 if self.started else PENDING_MAX), block_ms=200)
        new, stray = [], []
        for g in resp.groups:
            if g.entry_id in known:
                continue
            if g.run_id == run_id:
                new.append(g)
            else:
                log.warning("stream %s: acknowledging entry %s of run %s without training it "
                            "(not this trainer's async run)", self.stream, g.entry_id,
                            g.run_id)
                stray.append(g.entry_id)
        self.ack(stray)
        return new

    def poll_step(self, run_id: str, step: int, known: set[str], block_ms: int = 200
                  ) -> tuple[list[c.Group], list[c.Group]]:
        """Sync-first's read (sync_first.py): the completed groups of step `step`'s run
        `run_id`, and those of this trainer's earlier steps' runs (completed after their step
        took its groups: the caller acknowledges them untrained), both in stream order, but
        those in `known`; groups of its later steps (pending since before a restart) are held
        for their step, other runs' acknowledged and skipped. `block_ms`: how long to wait
        for a first new entry (0: not at all)."""
        resp = self._read(len(known) + 64 + (0 if self.started else PENDING_MAX), block_ms)
        pool = [*self.held.values(), *resp.groups]
        self.held.clear()
        new: list[c.Group] = []
        late: list[c.Group] = []
        stray: list[str] = []
        for g in pool:
            other = step_of_run(self.run_prefix, g.run_id)
            if g.entry_id in known:
                continue
            if g.run_id == run_id:
                new.append(g)
            elif other is not None and other > step:
                self.held[g.entry_id] = g
            elif other is not None:
                late.append(g)
            else:
                log.warning("stream %s: acknowledging entry %s of run %s without training it "
                            "(not this trainer's run)", self.stream, g.entry_id, g.run_id)
                stray.append(g.entry_id)
        self.ack(stray)
        return new, late


def canonical_order(g: c.Group) -> None:
    """Rollouts by index in group."""
    rollouts = sorted(g.rollouts, key=lambda r: r.index_in_group)
    del g.rollouts[:]
    g.rollouts.extend(rollouts)


def pool_tasks(cfg: Any, tasks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Async mode's tasks: every step's tasks in step order (as sync mode would draw them),
    then spares for dropped groups, `mode.pool_factor` x steps x tasks_per_step in all plus
    the admission window; task ids made unique as `s<step>-<id>`."""
    window = (cfg.mode.max_staleness + 1) * cfg.tasks_per_step
    total = int(cfg.mode.pool_factor * cfg.steps * cfg.tasks_per_step) + window
    out: list[dict[str, Any]] = []
    step = 0
    while len(out) < total:
        step += 1
        out += [{**t, "id": f"s{step:06d}-{t['id']}"}
                for t in step_tasks(tasks, cfg.seed, step, cfg.tasks_per_step)]
    return out[:total]


def pool_spec(cfg: Any, tasks: Sequence[dict[str, Any]]) -> c.RunSpec:
    """Async mode's one controller run (cfg: `TrainerConfig`), admission-controlled."""
    spec = step_spec(cfg, pool_tasks(cfg, tasks))
    spec.admission_max_staleness = cfg.mode.max_staleness
    spec.admission_batch_groups = cfg.tasks_per_step
    return spec


def step_spec(cfg: Any, tasks: Sequence[dict[str, Any]]) -> c.RunSpec:
    """The controller run of one step (cfg: `TrainerConfig`)."""
    return c.RunSpec(
        name=cfg.run_name,
        tasks=[c.Task(task_id=str(t["id"]), data_json=json.dumps(t, sort_keys=True))
               for t in tasks],
        group_size=cfg.group_size, harness_command=cfg.harness_command,
        grader_command=cfg.grader_command, group_grader_command=cfg.group_grader_command,
        reward_source=c.REWARD_SOURCE_GRADER_JSON if cfg.grader_command
        else c.REWARD_SOURCE_GROUP_GRADER,
        concurrency=cfg.concurrency, timeout_s=cfg.rollout_timeout_s,
        grader_timeout_s=cfg.grader_timeout_s, max_attempts=cfg.max_attempts,
        env=cfg.harness_env, stream=cfg.stream, model=cfg.served_model_name,
        backend=cfg.rollout_backend, sandbox=run_sandbox(cfg),
        setup_command=cfg.setup_command,
        setup_timeout_s=cfg.setup_timeout_s if cfg.setup_command else 0.0,
        tampered_rewards=TAMPERED_REWARDS[cfg.tampered_rewards],
        tampered_penalty=cfg.tampered_penalty if cfg.tampered_rewards == "penalty" else 0.0)


# TrainerConfig.tampered_rewards -> RunSpec.tampered_rewards
TAMPERED_REWARDS = {"zero": c.TAMPERED_REWARDS_ZERO, "penalty": c.TAMPERED_REWARDS_PENALTY,
                    "drop": c.TAMPERED_REWARDS_DROP}


def run_sandbox(cfg: Any) -> c.SandboxSpec:
    """The runs' sandbox (cfg: `TrainerConfig`): its `sandbox` fields, with the training and
    evaluation task files hidden."""
    return sandbox_spec(cfg.sandbox, hide=[cfg.tasks_file, cfg.eval.tasks_file])
