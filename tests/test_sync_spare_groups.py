"""Sync-first (`mode.sync_spare_groups`, services/trainer/sync_first.py) through the real
training loop (`train_sync`) against a real store process on a real Redis, without vLLM: the
controller is `SpareRuns`, a test double that records every call the trainer makes and writes
each run's groups into the store as the controller and gateway would, ending them in an order
it sets. Everything is checked from outside the trainer: the double's recorded calls,
metrics.jsonl, the stream in Redis and the trainer's log.

Each step's run holds 5 tasks (3 of its own, 2 spares); by position in the run: the groups at
4, 3, 2 end first, in that order (so the step takes two spares and one of its own tasks), the
one at 0 ends 0.3 s after them (too late: surplus, rewarded — training it would be a fault),
the one at 1 only when the run is cancelled (its rollouts CANCELLED). With `at_once` for a step,
the groups at 4, 3, 2 and 0 have ended, in that order, before `start` returns: the trainer's
first read finds all four. The controller's cancel waits until the run's groups have ended;
with `linger_s` for a step it returns at once and they end once the next step's run has
started, so that the next step's reads find them."""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from pydantic import ValidationError
from test_checkpoint import (RecordingSink, StoreRuns, make_config, pending,  # noqa: F401
                             small_model, store, vocab)

from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.trainer.config import ModeConfig, TrainerConfig
from services.trainer.loop import Trainer, train_sync
from services.trainer.rollouts import load_tasks, step_spec, step_tasks
from services.trainer.sync_first import spare_tasks

TPS, SPARES = 3, 2  # test_checkpoint's make_config: 3 tasks a step, of 6 in the task file
FAST = [(4, 0.8), (3, 0.1), (2, 0.1), (0, 0.3)]  # (position in the run, delay): ending order
SLOW = 1  # ends only when the run is cancelled
FIRST = [2, 3, 4]  # the step's groups: the first three to end, in the run's task order


class SpareRuns:
    """Test double of `ControllerRuns` (see the module docstring). `calls`: every call the
    trainer made, as (what, run id, task ids). `run` is plain sync's (`StoreRuns`)."""

    def __init__(self, store: StoreClient, sink: RecordingSink, vocab: int,
                 linger_s: dict[int, float] | None = None, at_once: set[int] | None = None
                 ) -> None:
        self.store, self.sink, self.vocab = store, sink, vocab
        self.linger_s, self.at_once = linger_s or {}, at_once or set()
        self.calls: list[tuple[str, str, list[str]]] = []
        self.specs: dict[str, c.RunSpec] = {}  # run id -> the spec it was first given
        self.plain = StoreRuns(store, sink, vocab)
        self.live: dict[str, tuple[threading.Event, threading.Thread, float]] = {}
        self.last_started = ""  # the run `start` was last called for

    def run(self, run_id: str, spec: c.RunSpec) -> c.Run:
        self.calls.append(("run", run_id, [t.task_id for t in spec.tasks]))
        self.specs.setdefault(run_id, c.RunSpec.FromString(spec.SerializeToString()))
        return self.plain.run(run_id, spec)

    def start(self, run_id: str, spec: c.RunSpec, cancelled_ok: bool = False) -> c.Run:
        self.calls.append(("start", run_id, [t.task_id for t in spec.tasks]))
        self.last_started = run_id
        self.specs.setdefault(run_id, c.RunSpec.FromString(spec.SerializeToString()))
        try:  # idempotent on the run id, as CreateRun is; refuses as ControllerRuns.start does
            run = self.store.get_run(run_id)
            if run.status == c.RUN_STATUS_CANCELLED and not cancelled_ok:
                raise RuntimeError(f"run {run_id} is CANCELLED")
            return run
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        run = self.store.put_run(c.Run(run_id=run_id, spec=spec, status=c.RUN_STATUS_RUNNING))
        stop, started = threading.Event(), threading.Event()
        step = int(run_id.rsplit("step", 1)[1])
        th = threading.Thread(target=self._execute, args=(run_id, spec, stop, started,
                                                          step in self.at_once), daemon=True)
        self.live[run_id] = (stop, th, self.linger_s.get(step, 0.0))
        th.start()
        started.wait(30)
        return run

    def cancel(self, run_id: str) -> c.Run:
        self.calls.append(("cancel", run_id, []))
        if run_id in self.live:
            stop, th, linger = self.live[run_id]
            stop.set()
            if not linger:  # the controller's cancel returns once the run ended
                th.join(30)
        return self.store.get_run(run_id)

    def _execute(self, run_id: str, spec: c.RunSpec, stop: threading.Event,
                 started: threading.Event, at_once: bool) -> None:
        groups = []
        for task in spec.tasks:  # every rollout started, its two calls made (version now)
            gid = f"{run_id}.{task.task_id}"
            rollouts = [c.Rollout(rollout_id=f"{gid}.{i}", run_id=run_id, task_id=task.task_id,
                                  group_id=gid, index_in_group=i, group_size=spec.group_size,
                                  max_attempts=1, task_json=task.data_json, stream=spec.stream)
                        for i in range(spec.group_size)]
            self.store.create_rollouts(rollouts)
            for ro in rollouts:
                self.store.start_attempt(ro.rollout_id, 1)
                self.store.append_calls(self._calls(ro))
            groups.append(rollouts)
        ended: set[int] = set()
        if not at_once:
            started.set()
        for pos, delay in FAST:
            if not at_once and stop.wait(delay):
                break
            self._end(groups[pos], c.ROLLOUT_STATUS_SUCCEEDED)
            ended.add(pos)
        started.set()
        stop.wait()
        if self.live[run_id][2]:  # lingering: its late groups end once the next step's run
            deadline = time.monotonic() + 30  # has started (found by that step's reads)
            while self.last_started == run_id and time.monotonic() < deadline:
                time.sleep(0.01)
        for pos in range(len(groups)):  # as the kill lands: the one at 0 just made it
            if pos not in ended:
                self._end(groups[pos], c.ROLLOUT_STATUS_SUCCEEDED if pos == 0
                          else c.ROLLOUT_STATUS_CANCELLED)
        rollouts = self.store.list_rollouts(run_id).rollouts
        self.store.put_run(c.Run(
            run_id=run_id, spec=spec, status=c.RUN_STATUS_CANCELLED,
            num_rollouts=len(rollouts),
            num_succeeded=sum(r.status == c.ROLLOUT_STATUS_SUCCEEDED for r in rollouts),
            num_cancelled=sum(r.status == c.ROLLOUT_STATUS_CANCELLED for r in rollouts)))

    def _calls(self, ro: c.Rollout) -> list[c.Call]:
        rng = random.Random(f"{ro.task_id}:{ro.index_in_group}")
        prompt = [rng.randrange(3, self.vocab) for _ in range(10)]
        out1 = [rng.randrange(3, self.vocab) for _ in range(6)]
        tool = [rng.randrange(3, self.vocab) for _ in range(3)]
        out2 = [rng.randrange(3, self.vocab) for _ in range(5)]
        return [c.Call(rollout_id=ro.rollout_id, attempt=1, seq=k, prompt_token_ids=p,
                       completion_token_ids=o, logprobs=[-rng.uniform(5.0, 8.0) for _ in o],
                       policy_version=self.sink.version, engine="e0", api="chat.completions")
                for k, (p, o) in enumerate([(prompt, out1), (prompt + out1 + tool, out2)])]

    def _end(self, rollouts: list[c.Rollout], status: int) -> None:
        for ro in rollouts:
            rng = random.Random(f"{ro.task_id}:{ro.index_in_group}:reward")
            self.store.finish_attempt(spb.FinishAttemptRequest(
                rollout_id=ro.rollout_id, attempt=1, status=status,
                reward=float(ro.index_in_group % 2 == 0 or rng.random() < 0.3),
                error="" if status == c.ROLLOUT_STATUS_SUCCEEDED else "run cancelled"))


def rows_of(cfg: TrainerConfig) -> list[dict[str, Any]]:
    return [json.loads(x) for x in cfg.metrics_file.read_text().splitlines()]


def stream_left(redis_url: str, key_prefix: str, stream: str) -> tuple[int, bool]:
    """(entries pending in the trainer's consumer group, whether every entry was delivered)."""
    r = redis.Redis.from_url(redis_url)
    key = f"{key_prefix}stream:{stream}"
    (group,) = [g for g in r.xinfo_groups(key) if g["name"] == b"trainer"]
    last = r.xrevrange(key, count=1)
    return int(group["pending"]), not last or last[0][0] == group["last-delivered-id"]


def surplus_logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    """(step, group id) of each group the trainer logged as surplus."""
    out = []
    for rec in caplog.records:
        msg = rec.getMessage()
        if "surplus groups acknowledged untrained" in msg:
            step = int(msg.split()[1].rstrip(":"))
            out += [(step, gid) for gid in re.findall(r"(\S+) \(run ", msg.split(": ", 2)[2])]
    return out


def spare_config(tmp: Path, name: str, model: Path, steps: int, spares: int = SPARES,
                 **kw: Any) -> TrainerConfig:
    return make_config(tmp, name, model, steps, run_timeout_s=20,
                       mode={"kind": "sync", "sync_spare_groups": spares}, **kw)


def test_sync_first_takes_the_first_complete_groups_and_cancels_the_rest(
        tmp_path: Path, small_model: Path, store: StoreClient, vocab: int,  # noqa: F811
        redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="harnessrl.trainer")
    steps = 3
    cfg = spare_config(tmp_path, "first", small_model, steps)
    sink = RecordingSink()
    # step 1's late groups end at step 2; step 3's first read finds four groups ended
    runs = SpareRuns(store, sink, vocab, linger_s={1: 0.3}, at_once={3})
    t = Trainer(cfg, runs, store, sink)
    train_sync(t)
    prefix, tasks = t.state.run_prefix, load_tasks(cfg.tasks_file)

    # the calls: per step, start (the step's own tasks, then two spares drawn apart), cancel
    expected_calls = []
    for step in range(1, steps + 1):
        own = step_tasks(tasks, cfg.seed, step, TPS)
        spares = spare_tasks(tasks, cfg.seed, step, own, SPARES)
        ids = [str(x["id"]) for x in own + spares]
        assert len(set(ids)) == TPS + SPARES and not set(ids[:TPS]) & set(ids[TPS:])
        run_id = f"{prefix}-step{step:06d}"
        expected_calls += [("start", run_id, ids), ("cancel", run_id, [])]
        assert runs.specs[run_id] == step_spec(cfg, own + spares)  # a sync step's run spec
    assert runs.calls == expected_calls
    run_tasks = {run_id: ids for what, run_id, ids in runs.calls if what == "start"}

    # each step trained the first three groups to end (positions 4, 3, 2), in task order
    rows = rows_of(cfg)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        ids = run_tasks[r["run_id"]]
        assert r["group_ids"] == [f"{r['run_id']}.{ids[p]}" for p in FIRST], r["step"]
        assert r["groups"] == TPS and r["groups_dropped"] == 0 and r["drop_reasons"] == {}
        assert r["rollouts"] == TPS * 4 and r["rollouts_failed"] == 0  # none cancelled counted
        assert r["version_mismatches"] == 0
        assert {ro.rsplit(".", 1)[0] for ro in r["trained_rollouts"]} <= set(r["group_ids"])
    assert [r["behaviour_version"] for r in rows] == [0] + [r["policy_version"] for r in rows[:-1]]
    assert any(r["trained"] for r in rows)
    assert t.state.groups_trained == steps * TPS and t.state.groups_dropped == 0

    # the two others of each run ended (0: rewarded, just too late; 1: cancelled), were
    # acknowledged untrained and counted as surplus, not dropped; nothing is left in the stream
    late = {f"{run_id}.{ids[p]}" for run_id, ids in run_tasks.items() for p in (0, SLOW)}
    for run_id, ids in run_tasks.items():
        by_group = {ro.group_id: ro.status for ro in store.list_rollouts(run_id).rollouts}
        assert by_group[f"{run_id}.{ids[SLOW]}"] == c.ROLLOUT_STATUS_CANCELLED
        assert by_group[f"{run_id}.{ids[0]}"] == c.ROLLOUT_STATUS_SUCCEEDED
    logged = surplus_logged(caplog)
    assert sorted(g for _, g in logged) == sorted(late), logged
    assert (2, f"{prefix}-step000001.{run_tasks[f'{prefix}-step000001'][SLOW]}") in logged, \
        "step 1's late groups were not found by step 2's reads"
    assert t.sync.surplus == len(late) == 2 * steps
    assert stream_left(redis_url, key_prefix, cfg.stream) == (0, True)
    assert not any("dropping" in rec.getMessage() for rec in caplog.records)


def test_no_spares_is_plain_sync(
        tmp_path: Path, small_model: Path, store: StoreClient, vocab: int,  # noqa: F811
        redis_url: str, key_prefix: str) -> None:
    """sync_spare_groups 0: one `run` per step with the step's tasks, waited for to its end,
    every group trained; no start, no cancel (today's calls exactly)."""
    cfg = spare_config(tmp_path, "plain", small_model, steps=2, spares=0)
    assert cfg.mode == ModeConfig()
    sink = RecordingSink()
    runs = SpareRuns(store, sink, vocab)
    t = Trainer(cfg, runs, store, sink)
    train_sync(t)
    prefix, tasks = t.state.run_prefix, load_tasks(cfg.tasks_file)
    assert runs.calls == [("run", f"{prefix}-step{s:06d}",
                           [str(x["id"]) for x in step_tasks(tasks, cfg.seed, s, TPS)])
                          for s in (1, 2)]
    for s in (1, 2):  # the very spec plain sync gives its step's run
        assert runs.specs[f"{prefix}-step{s:06d}"] == \
            step_spec(cfg, step_tasks(tasks, cfg.seed, s, TPS))
    rows = rows_of(cfg)
    assert [len(r["group_ids"]) for r in rows] == [TPS, TPS]
    assert stream_left(redis_url, key_prefix, cfg.stream) == (0, True)


def test_a_step_redone_after_a_crash_reattaches_to_its_cancelled_run(
        tmp_path: Path, small_model: Path, store: StoreClient, vocab: int,  # noqa: F811
        redis_url: str, key_prefix: str) -> None:
    """The push after step 2 crashes, no checkpoint yet (every 2 steps): a new trainer redoes
    steps 1 and 2, re-attaching to their cancelled runs (no new rollouts), and takes the very
    groups the first life took: they were pending, the surplus acknowledged already."""
    cfg = spare_config(tmp_path, "redo", small_model, steps=2, checkpoint_every=2)
    crashing = RecordingSink(fail_version=2)
    first_runs = SpareRuns(store, crashing, vocab)
    with pytest.raises(RuntimeError, match="simulated crash while pushing version 2"):
        train_sync(Trainer(cfg, first_runs, store, crashing))
    first_rows = rows_of(cfg)
    assert [r["step"] for r in first_rows] == [1]
    left = pending(redis_url, key_prefix, cfg.stream)
    assert len(left) == 2 * TPS  # both steps' groups taken, unacknowledged; not the surplus
    assert stream_left(redis_url, key_prefix, cfg.stream) == (2 * TPS, True)

    sink = RecordingSink()
    runs = SpareRuns(store, sink, vocab)
    second = Trainer(cfg, runs, store, sink)
    train_sync(second)
    assert [w for w, _, _ in runs.calls] == ["start", "cancel", "start", "cancel"]
    assert not runs.live, "a run was started again instead of re-attached"
    rows = rows_of(cfg)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["group_ids"] == first_rows[0]["group_ids"]
    run_tasks = {run_id: ids for what, run_id, ids in first_runs.calls if what == "start"}
    for r in rows:
        ids = run_tasks[r["run_id"]]
        assert r["group_ids"] == [f"{r['run_id']}.{ids[p]}" for p in FIRST]
    assert second.sync.surplus == 0
    assert stream_left(redis_url, key_prefix, cfg.stream) == (0, True)


def test_spares_need_the_sync_kind() -> None:
    assert ModeConfig().sync_spare_groups == 0
    assert ModeConfig(kind="sync", sync_spare_groups=4).sync_spare_groups == 4
    for kind in ("async", "collocated"):
        with pytest.raises(ValidationError, match="sync_spare_groups=2 needs mode.kind=sync"):
            ModeConfig(kind=kind, sync_spare_groups=2)
        assert ModeConfig(kind=kind).sync_spare_groups == 0
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        ModeConfig(sync_spare_groups=-1)


def test_sync_first_through_the_real_controller_gateway_and_stub_engine(
        tmp_path: Path, small_model: Path, redis_url: str,  # noqa: F811
        stub_engine: Any) -> None:
    """Sync-first with real services: store, gateway (the stub engine behind it) and controller
    as processes, the calc harness and grader as real subprocesses, the trainer's loop with its
    real `ControllerRuns` (the real CancelRun); only the engines' weights a test double. Each
    step takes `tasks_per_step` groups of its run and cancels it; no group is trained twice,
    none is left pending in the stream (what the last step's cancel leaves may stay
    undelivered), and the controller's record of each run is its step's tasks and spares,
    cancelled or done."""
    import sys
    import uuid

    from harnessrl.clients import ControllerClient
    from harnessrl.local.stack import Stack, StackConfig
    from services.trainer.rollouts import ControllerRuns

    calc = Path(__file__).resolve().parents[1] / "examples" / "calc"
    prefix = f"sf{uuid.uuid4().hex[:8]}:"
    scfg = StackConfig(state_dir=tmp_path / "stack", redis_url=redis_url, key_prefix=prefix,
                       model_dir=None, external_engines=(stub_engine.base_url,),
                       weight_transfer_backend=None)
    with Stack(scfg) as stack:
        cfg = TrainerConfig(
            model_path=str(small_model), output_dir=str(tmp_path / "out"), steps=2,
            tasks_per_step=2, group_size=2, concurrency=4, run_name="sf", stream="sf",
            tasks_file=str(calc / "tasks.jsonl"), served_model_name="tiny",
            harness_command=[sys.executable, str(calc / "harness.py")],
            grader_command=[sys.executable, str(calc / "grader.py")],
            mode={"kind": "sync", "sync_spare_groups": 2})
        controller = ControllerClient.connect(stack.controller_address)
        store = StoreClient.connect(stack.store_address)
        t = Trainer(cfg, ControllerRuns(controller, 300), store, RecordingSink())
        try:
            train_sync(t)
            runs = {r["run_id"]: controller.get_run(r["run_id"]) for r in rows_of(cfg)}
            groups = {run_id: {ro.group_id for ro in store.list_rollouts(run_id).rollouts}
                      for run_id in runs}
        finally:
            t.close()
        rows = rows_of(cfg)
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert r["groups"] + r["groups_dropped"] == 2 and len(r["group_ids"]) == 2, r
            assert set(r["group_ids"]) <= groups[r["run_id"]]
            run = runs[r["run_id"]]
            assert len(run.spec.tasks) == 4  # the step's two and two spares
            assert run.status in (c.RUN_STATUS_CANCELLED, c.RUN_STATUS_SUCCEEDED), run
        trained = [g for r in rows for g in r["group_ids"]]
        assert len(trained) == len(set(trained)) == 4
        assert stream_left(redis_url, prefix, cfg.stream)[0] == 0, "groups left pending"
