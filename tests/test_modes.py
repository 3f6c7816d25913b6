"""Async and collocated modes (docs/modes.md).

- The staleness rule and the controller's admission rule, pure, under hypothesis: over random
  completion orders, latencies and training times, no trained group is staler than
  max_staleness, in flight + done-but-untrained never exceeds the window, and every group that
  completed is trained once, dropped with a reason, or still waiting (groups in = trained +
  dropped + waiting).
- `GatewayHold` (collocated mode's turn-taking) against the real gateway and the stub engine.
- `train_async` through the real loop against a real store process (no vLLM): `PoolRuns`, a
  test double of the controller, runs the one admission-controlled run in a thread with the
  real `Admission`, each rollout's two calls recorded under the policy version the engines
  (`RecordingSink`) serve when each call is made — so rollouts span pushes. A trainer killed
  (-9) mid-run with the whole admission window in flight, then a new one on the same output:
  nothing trained twice, nothing lost, the bound holds, the groups the kill cut short finish.
  The kill -9 form: tests/async_trainer_proc.py is the killed trainer.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_checkpoint import RecordingSink, make_config, small_model, store, vocab  # noqa: F401
from test_gateway import SIGNER, world  # noqa: F401

from harnessrl.clients import StoreClient
from harnessrl.statuses import TERMINAL
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.controller.admission import Admission
from services.controller.admission import started_and_done_groups
from services.trainer import checkpoint as ckpt
from services.trainer.loop import Trainer, train_async
from services.trainer.staleness import group_staleness, select_groups


def _group(gid: str, versions: list[int]) -> c.Group:
    return c.Group(entry_id=gid, group_id=gid, rollouts=[c.Rollout(
        status=c.ROLLOUT_STATUS_SUCCEEDED, calls=[c.Call(policy_version=v) for v in versions])])


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_staleness=st.integers(0, 3),
       batch=st.integers(1, 4), steps=st.integers(1, 8), slow_tail=st.floats(0.0, 0.5))
def test_staleness_bound_and_accounting_over_random_orders(
        seed: int, max_staleness: int, batch: int, steps: int, slow_tail: float) -> None:
    """A discrete-event run of the controller (Admission) and the trainer (select_groups)."""
    rng = random.Random(seed)
    adm = Admission("run", max_staleness, batch)
    version, consumed, trained, dropped = 0, 0, [], []
    now, train_until = 0.0, None
    waiting: list[c.Group] = []  # completed, not taken (completion order)
    running: list[tuple[float, float, str, list[int]]] = []  # (next call at, end, gid, vers)
    next_gid = 0
    while version < steps and now < 5_000:
        # admission: start as many groups as the rule allows
        while adm.try_admit(f"g{next_gid}"):
            lat = rng.lognormvariate(0, 1.2) * (20 if rng.random() < slow_tail else 1)
            running.append((now + rng.uniform(0, lat), now + lat, f"g{next_gid}", []))
            next_gid += 1
        assert len(adm.admitted) - consumed <= (max_staleness + 1) * batch
        now += 0.1
        still = []
        for call_at, end, gid, vers in running:  # a call made under the current version
            if call_at <= now and len(vers) < 3:
                vers.append(version)
                call_at = now + rng.uniform(0, max(end - now, 0))
            if now >= end:
                waiting.append(_group(gid, vers or [version]))
                adm.group_done(gid)
            else:
                still.append((call_at, end, gid, vers))
        running = still
        if train_until is not None and now >= train_until:
            version, train_until = version + 1, None
        if train_until is None:  # the trainer takes what it can (loop.Trainer.take_groups)
            sel = select_groups(waiting, version, max_staleness, batch)
            assert all(why.startswith("stale") for _, why in sel.dropped)
            dropped += sel.dropped  # dropped at once: they leave the window
            consumed += len(sel.dropped)
            waiting = sel.kept + sel.rest
            if len(sel.kept) == batch:
                for g in sel.kept:
                    assert group_staleness(g, version) <= max_staleness
                trained += sel.kept
                waiting = sel.rest
                consumed += len(sel.kept)
                train_until = now + rng.uniform(0.1, 3.0)
            adm.update(consumed, version)
    done = {g.group_id for g in trained} | {g.group_id for g, _ in dropped} | \
        {g.group_id for g in waiting}
    assert len(done) == len(trained) + len(dropped) + len(waiting), "a group counted twice"
    assert done == adm.done, "a completed group neither trained, dropped nor waiting"
    assert version == steps, "the run did not finish its steps (admission deadlock?)"


class PoolRuns:
    """Test double of the controller for async mode: `start` runs the admission-controlled run
    in a thread, with the real `Admission` rule, writing each group into the real store as the
    controller and gateway would. Each rollout makes two calls, the second after a pause, each
    recorded with the version the engines (`sink`) serve at that moment. Groups finish in a
    random order.

    Re-attaching (a restarted trainer) resumes the run as the controller's `RunExecution` does
    after a restart: groups whose rollouts all ended are skipped, groups started and not ended
    count as admitted and are finished (their rollouts go on where the store has them), groups
    never started wait for admission like new ones. Here the double dies with the killed
    trainer's process (a real controller would not), so its successor must finish what it cut
    short: groups left admitted but never finished would hold the admission window forever.

    `stall_from_version`: a group whose first call (rollout 0's) that version or a later one
    served makes its first calls and then waits for the run's cancellation (jobs still
    running), so the trainer, once it consumed every group that ended, waits with the whole
    window in flight (`stalled` tells such a group from the store's record)."""

    def __init__(self, store: StoreClient, sink: RecordingSink, vocab: int, seed: int,
                 stall_from_version: int | None = None) -> None:
        self.store, self.sink, self.vocab, self.seed = store, sink, vocab, seed
        self.stall_from_version = stall_from_version
        self.admission: Admission | None = None
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.versions_at_admit: dict[str, int] = {}

    # RunLauncher
    def run(self, run_id: str, spec: c.RunSpec) -> c.Run:
        raise AssertionError("sync mode's run() used in async mode")

    def start(self, run_id: str, spec: c.RunSpec) -> c.Run:
        assert spec.admission_batch_groups > 0
        self.admission = Admission(run_id, spec.admission_max_staleness,
                                   spec.admission_batch_groups)
        self.thread = threading.Thread(target=self._execute, args=(run_id, spec), daemon=True)
        self.thread.start()
        return c.Run(run_id=run_id, status=c.RUN_STATUS_RUNNING)

    def cancel(self, run_id: str) -> c.Run:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        return c.Run(run_id=run_id, status=c.RUN_STATUS_CANCELLED)

    # AdmissionReporter
    def report(self, run_id: str, consumed: int, version: int) -> None:
        assert self.admission is not None
        self.admission.update(consumed, version)

    def _execute(self, run_id: str, spec: c.RunSpec) -> None:
        assert self.admission is not None
        rng = random.Random(self.seed)
        started, done = started_and_done_groups(self.store.list_rollouts(run_id).rollouts)
        self.admission.restore(started, done)
        live: list[threading.Thread] = []
        for task in spec.tasks:
            gid = f"{run_id}.{task.task_id}"
            if gid in done:
                continue
            while not self.admission.try_admit(gid) and not self.stop.is_set():
                self.stop.wait(0.02)
            if self.stop.is_set():
                break  # cancelled: the groups started finish (as their jobs would be killed)
            self.versions_at_admit[gid] = self.sink.version
            th = threading.Thread(target=self._group, daemon=True,
                                  args=(run_id, spec, task, gid, rng.uniform(0.0, 0.4)))
            th.start()
            live.append(th)
        for th in live:
            th.join()

    def _group(self, run_id: str, spec: c.RunSpec, task: c.Task, gid: str,
               pause: float) -> None:
        """Runs (or, resumed, finishes) one group: what the store holds already is kept (a
        create, a start of the running attempt or a call stored again changes nothing)."""
        rollouts = [c.Rollout(rollout_id=f"{gid}.{i}", run_id=run_id, task_id=task.task_id,
                              group_id=gid, index_in_group=i, group_size=spec.group_size,
                              max_attempts=1, task_json=task.data_json, stream=spec.stream)
                    for i in range(spec.group_size)]
        self.store.create_rollouts(rollouts)
        ended = {ro.rollout_id for ro in self.store.list_rollouts(run_id, gid).rollouts
                 if ro.status in TERMINAL}
        rollouts = [ro for ro in rollouts if ro.rollout_id not in ended]
        for ro in rollouts:
            self.store.start_attempt(ro.rollout_id, 1)
        calls: dict[str, list[c.Call]] = {}
        for k in range(2):  # the second call after a pause: it may be served by a newer version
            if k and self.stalled(calls.get(f"{gid}.0", []), self.stall_from_version):
                self.stop.wait()
                return
            if k:
                time.sleep(pause)
            for ro in rollouts:
                r = random.Random(f"{ro.task_id}:{ro.index_in_group}:{k}")
                prev = calls.get(ro.rollout_id, [])
                prompt = list(prev[-1].prompt_token_ids) + list(prev[-1].completion_token_ids) \
                    + [r.randrange(3, self.vocab)] if prev else \
                    [r.randrange(3, self.vocab) for _ in range(8)]
                out = [r.randrange(3, self.vocab) for _ in range(5)]
                call = c.Call(rollout_id=ro.rollout_id, attempt=1, seq=k,
                              prompt_token_ids=prompt, completion_token_ids=out,
                              logprobs=[-r.uniform(5.0, 8.0) for _ in out],
                              policy_version=self.sink.version, engine="e0",
                              api="chat.completions", started_at=time.time())
                calls.setdefault(ro.rollout_id, []).append(call)
                self.store.append_calls([call])
        for ro in rollouts:
            r = random.Random(f"{ro.task_id}:{ro.index_in_group}")
            self.store.finish_attempt(spb.FinishAttemptRequest(
                rollout_id=ro.rollout_id, attempt=1, status=c.ROLLOUT_STATUS_SUCCEEDED,
                reward=float(r.random() < 0.5)))

    @staticmethod
    def stalled(first_calls: Sequence[c.Call], from_version: int | None) -> bool:
        """A group stalls when its rollout 0's first call (of `first_calls`, that rollout's)
        was served by `from_version` or later."""
        return from_version is not None and bool(first_calls) and \
            first_calls[0].policy_version >= from_version


def async_trainer(cfg: Any, store: StoreClient, sink: RecordingSink, vocab: int,
                  seed: int, stall_from_version: int | None = None
                  ) -> tuple[Trainer, PoolRuns]:
    runs = PoolRuns(store, sink, vocab, seed, stall_from_version)
    return Trainer(cfg, runs, store, sink, admission=runs), runs


def test_async_trainer_killed_and_restarted_trains_each_group_once_within_the_bound(
        tmp_path: Path, small_model: Path, store: StoreClient, vocab: int,  # noqa: F811
        store_service: Any) -> None:
    """kill -9 of an async trainer process mid-run (checkpoint every 2 steps, so groups it took
    since its last checkpoint come back) while it waits for groups with the whole admission
    window in flight (its controller double stalls the groups whose first call policy version 3
    or a later one served), then a new trainer on the same output dir: the groups the kill cut short finish
    (a successor that left them admitted and unfinished would never be admitted another group:
    the second trainer would wait out run_timeout_s); every group that reached the stream is in
    exactly one step (trained or dropped) or still unacknowledged there; the staleness bound
    holds throughout; and rollouts that spanned pushes trained."""
    steps, max_staleness = 6, 1
    cfg = make_config(tmp_path, "async", small_model, steps, checkpoint_every=2,
                      run_timeout_s=300,  # a step's wait for groups fails instead of hanging
                      mode={"kind": "async", "max_staleness": max_staleness, "pool_factor": 3})
    window, stall_from = (max_staleness + 1) * cfg.tasks_per_step, 3
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(cfg.model_dump_json())

    def in_flight() -> tuple[set[str], set[str]]:  # groups started, not ended; those stalled
        prefix = json.loads((Path(cfg.output_dir) / "run.json").read_text())["run_prefix"]
        rollouts = store.list_rollouts(f"{prefix}-async", include_calls=True).rollouts
        started, done = started_and_done_groups(rollouts)
        stalled = {ro.group_id for ro in rollouts if ro.index_in_group == 0 and
                   PoolRuns.stalled(ro.calls, stall_from)}
        return started - done, stalled

    def window_stalled() -> bool:  # every group in flight stalled, and the window full of them
        flying, stalled = in_flight()
        return len(flying) == window and flying <= stalled

    with open(tmp_path / "first.log", "w") as err:
        proc = subprocess.Popen([sys.executable,
                                 str(Path(__file__).parent / "async_trainer_proc.py"),
                                 store_service.address, str(cfg_file), "1", str(stall_from)],
                                stdout=subprocess.DEVNULL, stderr=err)
    # groups whose first call version 3 (pushed after step 3) or later served stall: at most
    # 6 + 9 + (groups dropped by then) end, so at most 5 steps train; once the window is all
    # stalled groups, nothing ends or starts any more in that process
    try:
        deadline = time.monotonic() + 600  # a loaded machine: the process imports torch first
        while not (cfg.metrics_file.exists()
                   and len(cfg.metrics_file.read_text().splitlines()) >= 3
                   and window_stalled()):
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first trainer made no progress"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    cut_short, _ = in_flight()
    assert len(cut_short) == window
    killed_at = len(cfg.metrics_file.read_text().splitlines())
    assert killed_at < steps, "the first trainer finished before the kill"
    checkpointed = ckpt.read_state(ckpt.latest_checkpoint(cfg.checkpoints_dir)).step
    assert checkpointed in (2, 4)
    # the engines still serve the first trainer's last push; the new trainer pushes its
    # checkpoint's weights (and version) before anything else
    second, _ = async_trainer(cfg, store, RecordingSink(), vocab, seed=2)
    train_async(second)
    assert second.state.step == steps
    rows = [json.loads(x) for x in cfg.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["mode"] == "async" and r["groups"] == cfg.tasks_per_step for r in rows)
    for r in rows:
        assert r["staleness_max"] is None or r["staleness_max"] <= max_staleness
        assert set(r["staleness_hist"]) <= {str(k) for k in range(max_staleness + 1)}
    st_ = second.state
    assert st_.groups_trained == steps * cfg.tasks_per_step
    assert st_.groups_dropped == sum(r["groups_dropped"] for r in rows)
    assert st_.staleness_max <= max_staleness
    status = second.control.snapshot()  # what the gRPC GetStatus answers
    assert (status.mode, status.groups_trained, status.groups_dropped) == \
        ("async", st_.groups_trained, st_.groups_dropped)
    assert dict(status.drop_reasons) == ({"stale": st_.groups_dropped} if st_.groups_dropped
                                         else {})
    assert status.recent[-1].staleness_max <= max_staleness
    taken = [g for r in rows for g in r["group_ids"]]
    assert len(taken) == len(set(taken)), "a group was taken twice"
    assert len(taken) == st_.groups_trained + st_.groups_dropped
    # nothing lost: every group that completed (reached the stream) was taken, or is still
    # unacknowledged in the stream
    by_group: dict[str, list[int]] = {}
    for ro in store.list_rollouts(second.pool_run_id).rollouts:
        by_group.setdefault(ro.group_id, []).append(ro.status)
    completed = {g for g, sts in by_group.items()
                 if all(x == c.ROLLOUT_STATUS_SUCCEEDED for x in sts)}
    assert cut_short <= completed, "a group the kill cut short never finished"
    left = {g.group_id for g in store.read_groups(stream=cfg.stream, max_groups=1000,
                                                  include_calls=False).groups}
    assert not left & set(taken)
    assert completed == left | set(taken)
    # rollouts spanned pushes: trained samples with calls one version behind
    assert any(r["staleness_hist"].get("1") for r in rows)


def test_a_rollout_spanning_a_push_trains_with_each_calls_own_behaviour_logprobs() -> None:
    """Partial rollout: call 0 served by version 3, call 1 (extending it) by version 4 after a
    push. The sample merges both; each loss token keeps the logprob of the call (and so the
    version) that produced it, and the staleness at version 4 is 1."""
    from services.trainer.samples import group_samples

    def rollout(i: int, reward: float) -> c.Rollout:
        p0, o0, o1 = [5, 6, 7], [8, 9], [11, 12, 13]
        return c.Rollout(rollout_id=f"r{i}", group_id="g", index_in_group=i, has_reward=True,
                         reward=reward, status=c.ROLLOUT_STATUS_SUCCEEDED, calls=[
                             c.Call(seq=0, prompt_token_ids=p0, completion_token_ids=o0,
                                    logprobs=[-0.1, -0.2], policy_version=3),
                             c.Call(seq=1, prompt_token_ids=p0 + o0 + [10],
                                    completion_token_ids=o1, logprobs=[-1.1, -1.2, -1.3],
                                    policy_version=4)])
    g = c.Group(group_id="g", rollouts=[rollout(0, 1.0), rollout(1, 0.0)])
    out = group_samples(g)
    assert len(out.samples) == 2
    s = out.samples[0]
    assert s.policy_versions == [3, 4]
    trained = [(t, lp) for t, m, lp in zip(s.input_ids, s.loss_mask, s.behaviour_logprobs,
                                           strict=True) if m]
    assert trained == [(8, pytest.approx(-0.1)), (9, pytest.approx(-0.2)),
                       (11, pytest.approx(-1.1)), (12, pytest.approx(-1.2)),
                       (13, pytest.approx(-1.3))]
    assert group_staleness(g, 4) == 1
    assert select_groups([g], 4, 0, 1).dropped and select_groups([g], 4, 1, 1).kept == [g]


def test_collocated_hold_calls_finish_after_release_on_the_new_version(
        world: Any) -> None:  # noqa: F811
    """`GatewayHold` against the real gateway (stub engine): calls made while the trainer holds
    wait (no error), and once released complete, recorded with the version the trainer set
    while they waited (as its push does) and counted as held."""
    from services.trainer.gauges import GatewayHold

    hold = GatewayHold(world.admin, drain_timeout_s=10)
    rids = [world.rollout() for _ in range(3)]
    hold.hold()
    results: dict[str, Any] = {}

    def call(rid: str) -> None:
        key = SIGNER.mint(rid, 1, 120)
        results[rid] = world.client(key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}])

    threads = [threading.Thread(target=call, args=(rid,)) for rid in rids]
    for th in threads:
        th.start()
    time.sleep(1.5)
    assert not results, "a call went through during the hold"
    assert all(not world.calls(rid) for rid in rids)
    world.admin.update_engine("e0", policy_version=7)  # what the push records
    hold.release()
    for th in threads:
        th.join(30)
    assert set(results) == set(rids), "held calls did not complete after the release"
    for rid in rids:
        (recorded,) = world.calls(rid)
        assert recorded.policy_version == 7
        assert hold.held(recorded.started_at)


def test_collocated_loop_through_the_real_controller_gateway_and_stub_engine(
        tmp_path: Path, small_model: Path, redis_url: str,  # noqa: F811
        stub_engine: Any) -> None:
    """The whole async path with real services: store, gateway (stub engine behind it) and
    controller as processes, the calc harness as real subprocesses; the trainer's loop in
    collocated mode with its real clients (ControllerRuns, Gauges reporting admission,
    GatewayHold), only the engines' weights a test double (the stub's token ids are outside
    the small model's vocabulary, and every group is zero-variance, so nothing is pushed)."""
    import uuid

    from harnessrl.clients import ControllerClient, GatewayAdminClient
    from harnessrl.local.stack import Stack, StackConfig
    from services.trainer.config import TrainerConfig
    from services.trainer.gauges import GatewayHold, Gauges
    from services.trainer.rollouts import ControllerRuns

    calc = Path(__file__).resolve().parents[1] / "examples" / "calc"
    scfg = StackConfig(state_dir=tmp_path / "stack", redis_url=redis_url,
                       key_prefix=f"m{uuid.uuid4().hex[:8]}:", model_dir=None,
                       external_engines=(stub_engine.base_url,), weight_transfer_backend=None)
    with Stack(scfg) as stack:
        cfg = TrainerConfig(
            model_path=str(small_model), output_dir=str(tmp_path / "out"), steps=3,
            tasks_per_step=2, group_size=2, concurrency=4, run_name="coll", stream="coll",
            tasks_file=str(calc / "tasks.jsonl"), served_model_name="tiny",
            harness_command=[sys.executable, str(calc / "harness.py")],
            grader_command=[sys.executable, str(calc / "grader.py")],
            mode={"kind": "collocated", "max_staleness": 1, "gauge_interval_s": 0.2})
        admin = GatewayAdminClient.connect(stack.gateway_admin_address)
        controller = ControllerClient.connect(stack.controller_address)
        store = StoreClient.connect(stack.store_address)
        gauges = Gauges(GatewayAdminClient.connect(stack.gateway_admin_address), controller,
                        0.2)
        hold = GatewayHold(admin, 30)
        t = Trainer(cfg, ControllerRuns(controller, 300), store, RecordingSink(),
                    gauges=gauges, hold=hold, admission=gauges)
        try:
            train_async(t)
            status = controller.admission_update(t.pool_run_id, t.state.groups_trained,
                                                 t.state.policy_version)
            run = controller.get_run(t.pool_run_id)
        finally:
            t.close()
    rows = [json.loads(x) for x in cfg.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["mode"] == "collocated" and r["groups"] == 2 for r in rows)
    assert t.state.groups_trained + t.state.groups_dropped == sum(len(r["group_ids"])
                                                                  for r in rows)
    assert len(hold.windows) == 3, "one hold per step"
    assert all(isinstance(r["held_calls"], int) for r in rows)
    assert any(r["engine_busy_fraction"] is not None for r in rows)
    # admission: never more than the window beyond what the trainer consumed
    assert status.groups_admitted <= status.limit
    assert status.limit == (1 + 1) * 2 + t.state.groups_trained + t.state.groups_dropped
    assert run.status == c.RUN_STATUS_CANCELLED  # the groups never needed were not run
    assert run.num_rollouts > run.num_succeeded
