"""The training loop. `train_sync` is the whole sync mode, top to bottom, `train_async` the async
and collocated modes (docs/modes.md); `Trainer` holds the state and does each part.

One async step s (trainer at version v): the first `tasks_per_step` completed groups of the one
admission-controlled controller run whose calls are at most `mode.max_staleness` versions old
(older ones before them dropped, counted, with a reason) -> (collocated: the gateway holds new
calls; with `mode.sleep_level` the engines sleep, collocation.py) -> samples -> one optimizer
step -> push as v+1 -> (collocated: held calls go on) -> the controller is told how many groups
the trainer consumed -> checkpoint -> metrics. Rollouts keep running throughout.

One sync step s (the weights at policy version v = the version pushed after step s-1):

    tasks of step s (seeded by seed and s) -> controller run `<prefix>-step<s>` (idempotent)
    -> wait until it is done -> its groups from the store's stream -> check every call was
    served by version v -> samples -> one optimizer step -> push the weights into every engine
    as version v+1 -> checkpoint (every `checkpoint_every` steps and after the last) ->
    acknowledge the groups the checkpoint holds -> metrics.

A step whose groups give no sample (every group zero-variance or failed) takes no optimizer
step and pushes nothing: its policy version stays v.

On start the trainer resumes from `<output_dir>/checkpoints/latest` if there is one
(weights, optimizer, RNG states, step, policy version), acknowledges the entries that checkpoint
consumed (see `checkpoint` for why this loses nothing and trains nothing twice), and pushes its
weights into the engines as its policy version — fresh or resumed, the engines then serve
exactly the trainer's weights before the first rollout. With `lora` set (lora.py) the base
model is frozen and a LoRA adapter trains; checkpoints hold the adapter, resumed onto the base.

Several processes (world size N > 1, `sharding.py`): every rank runs `train_sync`. Rank 0 alone
talks to the rest of the system — it launches the runs, reads and acknowledges the stream,
pushes to the engines, writes metrics, serves the Trainer gRPC service — and hands the others
what they need through collectives: the step's groups (each rank builds the same samples and
trains on its share), its decisions (continue, checkpoint now), and the full weights for a push
(gathered bucket by bucket). Checkpoints are written by all ranks together (`checkpoint`).

Version check (`mode.version_check`): in sync mode every call of step s must carry version v. A
mismatch means the engines served other weights than the trainer's; "fail" (the default) stops
the trainer with an error naming the calls, "warn" logs it and trains on them (the loss
corrects for the behaviour policy with the recorded logprobs).

`<output_dir>/metrics.jsonl`: one JSON object per step, appended when the step is done (on
resume, lines of steps after the checkpoint are dropped, so each step appears once):

    step               int    the step (1-based)
    policy_version     int    version of the weights after the step (pushed to the engines)
    behaviour_version  int    version that served the step's calls
    run_id             str    the controller run of the step
    time               float  unix time the step ended
    reward_mean        float  mean reward of the step's succeeded rollouts (null if none)
    reward_std         float  their standard deviation (population; null if none)
    rollouts           int    rollouts in the step's run
    rollouts_failed    int    of them not SUCCEEDED (no reward, not trained on)
    groups             int    groups read
    groups_trained     int    groups that gave samples
    groups_zero_variance int  groups skipped because all rewards were equal
    groups_too_few     int    groups skipped for too few succeeded rollouts
    groups_dead_lettered int  groups of the step's run moved to the dead-letter stream
                              (delivered `max_group_deliveries` times); trained without
    trained            bool   whether an optimizer step was taken
    samples            int    training sequences
    tokens             int    loss tokens (completion tokens trained on)
    input_tokens       int    all tokens run through the model
    loss, kl, clip_fraction, capped_fraction, entropy, grad_norm
                       float  from `step.StepMetrics` (null when not trained): kl is the k3
                              estimate of KL(behaviour || policy) over loss tokens
    version_mismatches int    calls served by another version than behaviour_version
    trained_rollouts   list   ids of the rollouts the step's samples came from
    dropped_rollouts   dict   rollout id -> why it gave no sample ("failed", "group
                              zero_variance", "group too_few_rollouts", "no tokens")
    staleness_max      int    policy versions between the trainer's weights at the step's start
                              and the oldest call of the step (0 in sync mode)
    generate_s, train_s, push_s, step_time_s (collocated: hold_s; with sleep: sleep_s, wake_s)
                       float  wall time of each phase and of the step (without its checkpoint)
    tokens_per_s       float  input_tokens / train_s (null when not trained)
    checkpoint         str    checkpoint written after this step, or null

A line is appended before the step's checkpoint is written: if the trainer dies in between, the
resumed trainer drops the line and redoes the step. Lines with "kind": "eval" are evaluations
(step 0: before training), their schema in evaluation.py.

`<output_dir>/rollouts.jsonl`: `sample_rollouts` rendered rollouts of each step (step,
rollout_id, task_id, reward, status, calls, text), trimmed on resume like metrics.jsonl. Rows and
rollouts also go to the Prometheus series (`metrics.py`) and, when switched on, to TensorBoard
and W&B (`tracking.py`); `harnessrl report` turns the two files into an HTML page.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c, trainer_pb2 as tpb

from . import checkpoint as ckpt
from . import evaluation, lora
from . import metrics as prom
from .config import TrainerConfig
from .control import TrainerControl
from .collocation import Collocation, EngineSleep
from .gauges import GatewayHold, Gauges, GaugeWindow
from .outputs import RUN_FILE, append_jsonl, run_prefix_of, trim_metrics
from .rollouts import (
    AdmissionReporter,
    RunLauncher,
    StreamReader,
    canonical_order,
    load_tasks,
    pool_spec,
    run_id_for,
    step_spec,
    step_tasks,
)
from .staleness import call_versions, select_groups
from .samples import group_samples
from .sharding import Dist, ShardingConfig, device_for, shard_model, split_by_tokens
from .step import StepMetrics, make_optimizer, train_step
from .tracking import Trackers, render_rollouts
from .weights import WeightSink, push_model

log = logging.getLogger("harnessrl.trainer")



def train_sync(t: "Trainer") -> None:
    """The sync loop: generate a batch, train on it, push, checkpoint, repeat."""
    t.start()  # resume or initialise; the engines get the trainer's weights
    t.evaluate()  # an eval run of the weights before training (step 0), when asked
    while t.more_steps():  # steps left, no stop requested (rank 0 decides for every rank)
        step, version = t.state.step + 1, t.state.policy_version
        s = StepRecord(step=step, behaviour_version=version)
        run_id, tasks = t.generate(step, s)  # controller run of the step's tasks, until done
        groups = t.read_groups(run_id, step, tasks)  # its groups (rank 0 reads, all get them)
        t.check_versions(groups, version, s)  # every call served by version v
        metrics = t.train(groups, s)  # samples -> one optimizer step (None: no sample)
        if metrics is not None:
            t.push(version + 1, s)  # every engine serves version v+1, or we stop
        t.finish_step(step, groups, s)  # step done; its entries await the next checkpoint
        due = t.checkpoint_due()
        t.record(s, metrics, due)  # metrics.jsonl (a line the checkpoint misses is redone)
        if due:
            t.commit()  # checkpoint, then acknowledge the entries it holds
        t.answer_checkpoint_requests()
        t.evaluate()  # an eval run of the new weights when one is due (evaluation.py)
    if t.final_checkpoint_wanted():
        t.commit()  # no-op when the last step is checkpointed already


def train_async(t: "Trainer") -> None:
    """Async and collocated modes (docs/modes.md): rollouts keep running while the trainer
    trains and pushes; collocated also holds new model calls while it does."""
    t.start()  # resume or initialise; the engines get the trainer's weights
    t.evaluate()  # before training (step 0), when asked; before the pool's rollouts start
    t.open_pool()  # one controller run of every step's tasks, admission-controlled
    while t.more_steps():
        step, version = t.state.step + 1, t.state.policy_version
        s = StepRecord(step=step, behaviour_version=version)
        groups = t.take_groups(s)  # first complete groups fresh enough; older ones dropped
        t.hold_calls(s)  # collocated: the gateway holds new calls (sleep: engines sleep)
        metrics = t.train(groups, s)  # samples -> one optimizer step (None: no sample)
        if metrics is not None:
            t.push(version + 1, s)  # every engine serves version v+1, or we stop
        t.release_calls(s)  # collocated: (engines awake, READY) held calls go on, new weights
        t.finish_step(step, groups + s.dropped, s)  # its entries (dropped too) await a checkpoint
        due = t.checkpoint_due()
        t.record(s, metrics, due)  # metrics.jsonl (a line the checkpoint misses is redone)
        if due:
            t.commit()  # checkpoint, then acknowledge the entries it holds
        t.answer_checkpoint_requests()
        t.evaluate()  # when due: between steps, while the pool's rollouts go on
    t.close_pool()  # the run's groups never admitted are cancelled
    if t.final_checkpoint_wanted():
        t.commit()


def train(t: "Trainer") -> None:
    """The loop of the configured mode."""
    (train_sync if t.cfg.mode.kind == "sync" else train_async)(t)


@dataclass
class StepRecord:
    """What one step did, for metrics.jsonl and the gRPC status."""

    step: int
    behaviour_version: int
    run_id: str = ""
    started: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    trained_rollouts: list[str] = field(default_factory=list)
    dropped_rollouts: dict[str, str] = field(default_factory=dict)
    rollouts: list[dict[str, Any]] = field(default_factory=list)  # rendered, rollouts.jsonl
    dropped: list[c.Group] = field(default_factory=list)
    drop_reasons: dict[str, int] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)  # per trained sample
    held_calls: int = 0
    group_ids: list[str] = field(default_factory=list)  # taken: trained, skipped or dropped

    def timed(self, phase: str, since: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - since


class Trainer:
    """The trainer's state and the parts of the loop (`train_sync` / `train_async` string them
    together).

    `launcher` runs a step's controller run, `store` reads and acknowledges the stream,
    `weights` receives the weights after each step: `ControllerRuns`, `StoreClient` and
    `EngineWeights` in the service (`build_trainer`); tests may give their own. With `dist`
    sharded, ranks other than 0 get None for all three (rank 0 alone uses them) and `weights`
    on rank 0 receives the gathered weights (`sharded.GatheredWeights`) rather than the model.
    """

    def __init__(self, cfg: TrainerConfig, launcher: RunLauncher | None,
                 store: StoreClient | None, weights: WeightSink | None,
                 control: TrainerControl | None = None, dist: Dist | None = None,
                 gauges: Gauges | None = None, hold: GatewayHold | None = None,
                 admission: AdmissionReporter | None = None,
                 sleep: EngineSleep | None = None) -> None:
        self.cfg = cfg
        self.gauges = gauges  # engine busy, groups in flight over time (None: not measured)
        self.hold = hold  # collocated: the gateway's call hold (None: nothing to hold)
        self.dist = dist or Dist.single()
        self.colo = Collocation.build(  # collocated: the hold, the engines' sleep, the offload
            cfg, device_for(cfg.device, self.dist), hold, sleep, weights)
        self.pushed: set[str] | None = None  # engines the last push reached (None: all)
        self.admission = admission  # tells the controller what the trainer consumed
        self.pool_run_id = ""
        self.pool: dict[str, c.Group] = {}  # completed groups read, not taken yet (entry order)
        self.launcher = launcher
        self.store = store
        self.weights = weights
        self.control = control or TrainerControl()
        self.state = ckpt.TrainState()
        self.tasks = load_tasks(cfg.tasks_file)
        self.model: Any = None
        self.tokenizer: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.reader: StreamReader | None = None
        self._built: dict[str, Any] = {}  # entry id -> its samples, built while screening
        self._dead_in_step = 0
        self.last_checkpoint: Path | None = None
        self.checkpointed_step = -1
        self.output = Path(cfg.output_dir)
        self.trackers: Trackers | None = None

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Loads the latest checkpoint (or the initial model), acknowledges what the checkpoint
        consumed, and pushes the weights into the engines."""
        self.output.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(self.cfg.seed)
        random.seed(self.cfg.seed)
        np.random.seed(self.cfg.seed % 2**32)
        d = self.dist
        found = d.agree(ckpt.latest_checkpoint(self.cfg.checkpoints_dir)
                        if self.cfg.resume and d.is_main else None)
        lora.check_resumable(found, self.cfg.lora)  # an adapter checkpoint needs lora set
        source = found if found is not None and self.cfg.lora is None else Path(d.agree(
            self._initial_model() if d.is_main else ""))  # LoRA: the base, always
        on_host = self.colo is not None and self.colo.offload.hold_on_host()  # until a step
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(
            torch, self.cfg.dtype)).to("cpu" if on_host else device_for(self.cfg.device, d))
        if self.cfg.lora is not None:  # base frozen; adapter weights from the checkpoint
            self.model = lora.apply_lora(self.model, self.cfg.lora, found)
        self.model = shard_model(self.model, d, ShardingConfig(
            mixed_precision=self.cfg.mixed_precision,
            activation_checkpointing=self.cfg.activation_checkpointing))
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        o = self.cfg.optimizer
        self.optimizer = make_optimizer(self.model, lr=o.lr, betas=(o.beta1, o.beta2),
                                        weight_decay=o.weight_decay, eps=o.eps)
        run_prefix = d.agree(run_prefix_of(self.output, self.cfg.run_name) if d.is_main else "")
        if found is not None:
            self.state = ckpt.load_trainer_state(found, self.optimizer, self.model, d)
            if self.state.run_prefix != run_prefix:
                raise RuntimeError(f"{found} belongs to run {self.state.run_prefix!r}, but "
                                   f"{self.output / RUN_FILE} says {run_prefix!r}")
            self.last_checkpoint, self.checkpointed_step = found, self.state.step
            log.info("resumed from %s: step %d, policy version %d", found, self.state.step,
                     self.state.policy_version, extra={"step": self.state.step})
        else:
            self.state = ckpt.TrainState(run_prefix=run_prefix)
            log.info("starting from %s", source)
        self.control.update(step=self.state.step, policy_version=self.state.policy_version,
                            last_checkpoint=str(self.last_checkpoint or ""),
                            mode=self.cfg.mode.kind, groups_trained=self.state.groups_trained,
                            groups_dropped=self.state.groups_dropped,
                            staleness_max=self.state.staleness_max)
        self.control.set_drop_reasons(self.state.drop_reasons)
        if d.is_main:
            self._attach_stream(run_prefix)
            self.trackers = Trackers(self.cfg, self.output, run_prefix, self.state.step)
        self.control.set_state("pushing")
        v = self.state.policy_version
        if self.colo is None:
            self._push_weights(v)
        else:  # collocation.py: the push in a step's order (engines found asleep wake first)
            self.colo.start(self.model, self.optimizer, lambda: self._push_weights(v), v,
                            StepRecord(step=0, behaviour_version=v))

    def _attach_stream(self, run_prefix: str) -> None:
        """Rank 0: the stream reader; acknowledges what the resumed checkpoint consumed."""
        assert self.store is not None
        self.reader = StreamReader(self.store, self.cfg.stream, self.cfg.consumer_group,
                                   self.cfg.consumer, run_prefix, self.cfg.read_timeout_s,
                                   self.cfg.max_group_deliveries)
        if self.state.consumed_entries:  # in the checkpoint, so trained: acknowledge now
            n = self.reader.ack(self.state.consumed_entries)
            log.info("acknowledged %d of the %d entries the checkpoint consumed", n,
                     len(self.state.consumed_entries))
            self.state.consumed_entries = []
        trim_metrics(self.cfg.metrics_file, self.state.step)
        trim_metrics(self.rollouts_file, self.state.step)

    @property
    def rollouts_file(self) -> Path:
        return self.output / "rollouts.jsonl"

    def _push_weights(self, version: int) -> set[str] | None:
        """Every engine gets the weights as `version`; the engines reached (None: all)."""
        if self.colo is not None:
            self.colo.before_push(self.model, self.optimizer)  # sleep: engines' weights awake
        r = push_model(self.model, self.weights, version, self.dist, self.cfg,
                       self.state.run_prefix)
        self.pushed = set(r.engines) if r is not None else None
        return self.pushed

    # -- rank 0's decisions, shared ------------------------------------------------------------
    def more_steps(self) -> bool:
        return self.dist.agree(self.state.step < self.cfg.steps
                               and not self.control.stop_requested)

    def final_checkpoint_wanted(self) -> bool:
        return self.dist.agree(not self.control.skip_checkpoint)

    def _initial_model(self) -> str:
        if self.cfg.model_path:
            return self.cfg.model_path
        from harnessrl.model import build_tiny_model, default_model_dir

        return str(build_tiny_model(default_model_dir()))

    # -- one step ----------------------------------------------------------------------------
    def generate(self, step: int, s: StepRecord) -> tuple[str, list[str]]:
        self.control.set_state("generating")
        if not self.dist.is_main:  # rank 0 runs the step; the others get its groups
            return "", []
        assert self.launcher is not None
        t0 = time.perf_counter()
        tasks = step_tasks(self.tasks, self.cfg.seed, step, self.cfg.tasks_per_step)
        s.run_id = run_id_for(self.state.run_prefix, step)
        run = self.launcher.run(s.run_id, step_spec(self.cfg, tasks))
        if run.status != c.RUN_STATUS_SUCCEEDED:
            raise RuntimeError(f"run {s.run_id} ended {c.RunStatus.Name(run.status)}: "
                               f"{run.error}")
        s.counts.update(rollouts=run.num_rollouts, rollouts_failed=run.num_failed +
                        run.num_cancelled)
        if run.num_failed:
            log.warning("run %s: %d of %d rollouts failed", s.run_id, run.num_failed,
                        run.num_rollouts, extra={"run": s.run_id, "step": step})
        s.timed("generate_s", t0)
        return s.run_id, [str(t["id"]) for t in tasks]

    # -- async / collocated ------------------------------------------------------------------
    def open_pool(self) -> None:
        """Rank 0: creates (or re-attaches to) the one controller run of async mode, without
        waiting for it; the controller admits its groups as the trainer consumes them."""
        if not self.dist.is_main:
            return
        assert self.launcher is not None
        self.pool_run_id = f"{self.state.run_prefix}-{self.cfg.mode.kind}"
        spec = pool_spec(self.cfg, self.tasks)
        if self.hold is not None:  # collocated: refused before the run is created
            self.hold.refuse_judges(spec.group_grader_command)
        self.launcher.start(self.pool_run_id, spec)
        self._report_consumed()

    def _report_consumed(self) -> None:
        if self.admission is not None and self.pool_run_id:
            self.admission.report(self.pool_run_id, self.state.groups_trained +
                                  self.state.groups_dropped, self.state.policy_version)

    def take_groups(self, s: StepRecord) -> list[c.Group]:
        """The first `tasks_per_step` completed groups (stream order) whose calls are at most
        `max_staleness` versions old; older ones before them are dropped (s.dropped, with a
        reason). Rank 0 reads; every rank gets the same groups."""
        self.control.set_state("generating")
        if not self.dist.is_main:
            return self.dist.agree([])
        assert self.reader is not None
        t0 = time.perf_counter()
        version, batch = self.state.policy_version, self.cfg.tasks_per_step
        deadline = time.monotonic() + self.cfg.run_timeout_s
        kept: list[c.Group] = []
        while True:
            known = set(self.state.consumed_entries) | set(self.pool) | \
                {g.entry_id for g in kept + s.dropped}
            for g in self.reader.poll(self.pool_run_id, known):
                self.pool[g.entry_id] = g
            sel = select_groups(list(self.pool.values()), version,
                                self.cfg.mode.max_staleness, batch - len(kept))
            for g, reason in sel.dropped:
                del self.pool[g.entry_id]
                s.dropped.append(g)
                key = reason.split(":")[0]
                s.drop_reasons[key] = s.drop_reasons.get(key, 0) + 1
                s.dropped_rollouts.update((ro.rollout_id, reason) for ro in g.rollouts)
                log.warning("step %d: dropping group %s: %s", s.step, g.group_id, reason,
                            extra={"step": s.step})
            for g in sel.kept:
                del self.pool[g.entry_id]
                kept.append(g)
            self._report_consumed_pending(len(kept) + len(s.dropped))
            if len(kept) == batch:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {s.step}: {len(kept)} of {batch} groups of run "
                                   f"{self.pool_run_id} after {self.cfg.run_timeout_s:.0f}s")
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
        s.run_id = self.pool_run_id
        s.timed("generate_s", t0)
        return self.dist.agree(kept)

    def _report_consumed_pending(self, taken: int) -> None:
        """While a step waits: the controller counts what this step took already, so the
        window keeps moving (and a restarted controller hears from the trainer)."""
        if self.admission is not None and self.pool_run_id:
            self.admission.report(self.pool_run_id, self.state.groups_trained +
                                  self.state.groups_dropped + taken,
                                  self.state.policy_version)

    def hold_calls(self, s: StepRecord) -> None:
        if self.colo is not None:  # collocation.py has the sequence
            self.control.set_state("holding")
            self.colo.enter(self.model, self.optimizer, s)  # rank 0 holds, engines sleep

    def release_calls(self, s: StepRecord) -> None:
        if self.colo is not None:
            if self.dist.agree(self.colo.needs_push):  # level 2, no step: weights again
                self.push(self.state.policy_version, s)
            pushed, self.pushed = self.pushed, None
            self.colo.leave(self.model, self.optimizer, self.state.policy_version, s, pushed)

    def close_pool(self) -> None:
        """Rank 0: the async run's groups never admitted are not needed any more."""
        if self.dist.is_main and self.pool_run_id and self.launcher is not None \
                and not self.control.stop_requested:
            self.launcher.cancel(self.pool_run_id)

    def read_groups(self, run_id: str, step: int, tasks: list[str]) -> list[c.Group]:
        if not self.dist.is_main:
            return self.dist.agree([])
        assert self.reader is not None
        groups = self._screen(self.reader.read(run_id, step, tasks,
                                               set(self.state.consumed_entries)))
        self._dead_in_step = len(self.reader.dead_groups(run_id))
        return self.dist.agree(groups)

    def _screen(self, groups: list[c.Group]) -> list[c.Group]:
        """Rank 0 builds each group's samples before training: a group whose samples cannot
        be built is reported to the store (NackGroups) and delivered again, until it builds
        or has been delivered `max_group_deliveries` times (then it is dead-lettered and the
        step trains without it). With no bound (0) the error stops the trainer."""
        assert self.reader is not None
        ok = []
        for g in groups:
            while True:
                try:
                    self._built[g.entry_id] = group_samples(
                        g, self.cfg.advantage, self.cfg.loss.max_sample_len)
                    ok.append(g)
                    break
                except Exception as exc:  # noqa: BLE001 - the group is reported, not lost
                    if self.cfg.max_group_deliveries == 0:
                        raise
                    reason = f"samples of group {g.group_id}: {type(exc).__name__}: {exc}"
                    log.warning("%s; reporting the failed delivery", reason)
                    again, dead = self.reader.nack([g], reason, redeliver=True)
                    if dead or not again:
                        log.error("group %s dead-lettered after %s deliveries: %s", g.group_id,
                                  dead[0].deliveries if dead else "?", reason)
                        break
                    g = again[0]
                    rollouts = sorted(g.rollouts, key=lambda r: r.index_in_group)
                    del g.rollouts[:]
                    g.rollouts.extend(rollouts)
        return ok

    def check_versions(self, groups: list[c.Group], version: int, s: StepRecord) -> None:
        bad = [(r.rollout_id, call.seq, call.policy_version) for g in groups
               for r in g.rollouts for call in r.calls if call.policy_version != version]
        s.counts["version_mismatches"] = len(bad)
        s.counts["staleness_max"] = max((version - call.policy_version for g in groups
                                         for r in g.rollouts for call in r.calls), default=0)
        if bad:
            msg = (f"step {s.step}: {len(bad)} calls were served by another policy version "
                   f"than {version} (rollout, seq, version): {bad[:5]}")
            if self.cfg.mode.version_check == "fail":
                raise RuntimeError(msg)
            log.warning("%s", msg, extra={"step": s.step})

    def train(self, groups: list[c.Group], s: StepRecord) -> StepMetrics | None:
        self.control.set_state("training")
        t0 = time.perf_counter()
        results = [self._built.pop(g.entry_id, None) or
                   group_samples(g, self.cfg.advantage, self.cfg.loss.max_sample_len)
                   for g in groups]
        self._built.clear()
        samples = [x for r in results for x in r.samples]
        s.staleness = [self.state.policy_version - min(x.policy_versions or
                                                       [self.state.policy_version])
                       for x in samples]
        s.rewards = [rw for r in results for rw in r.rewards]
        s.trained_rollouts = sorted({x.rollout_id for x in samples})
        for g, r in zip(groups, results, strict=True):
            for ro in g.rollouts:
                if ro.rollout_id not in s.trained_rollouts:
                    s.dropped_rollouts[ro.rollout_id] = (
                        "failed" if ro.rollout_id in r.dropped_rollouts
                        else f"group {r.skipped}" if r.skipped else "no tokens")
        if self.dist.is_main and self.cfg.sample_rollouts:
            s.rollouts = render_rollouts(groups, self.tokenizer, self.cfg.sample_rollouts, s.step)
        s.counts.update(
            groups=len(groups), groups_trained=sum(1 for r in results if r.samples),
            groups_zero_variance=sum(1 for r in results if r.skipped == "zero_variance"),
            groups_too_few=sum(1 for r in results if r.skipped == "too_few_rollouts"),
            groups_dead_lettered=self._dead_in_step)
        metrics = None
        if samples:
            assert self.optimizer is not None
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            if self.dist.sharded:  # this rank's share, balanced by tokens
                mine = split_by_tokens([len(x) for x in samples],
                                       self.dist.world_size)[self.dist.rank]
                samples = [samples[i] for i in mine]
            try:
                metrics = train_step(self.model, self.optimizer, samples,
                                     self.cfg.step_config(pad), self.dist)
            except Exception as exc:
                if self.reader is not None and self.cfg.max_group_deliveries:
                    # counts against each group of the step; the restart redelivers them
                    self.reader.nack(groups, f"training step {s.step} failed: "
                                     f"{type(exc).__name__}: {exc}", redeliver=False)
                raise
        else:
            log.warning("step %d: no group gave a sample (all zero-variance or failed); no "
                        "optimizer step", s.step, extra={"step": s.step})
        s.timed("train_s", t0)
        return metrics

    def push(self, version: int, s: StepRecord) -> None:
        self.control.set_state("pushing")
        t0 = time.perf_counter()
        self._push_weights(version)
        self.state.policy_version = version
        self.control.update(policy_version=version)
        s.timed("push_s", t0)

    def finish_step(self, step: int, groups: list[c.Group],
                    s: StepRecord | None = None) -> None:
        """Step done: its entries (trained, skipped or dropped) await the next checkpoint; the
        counts that prove nothing was lost are in the state (and so in the checkpoint)."""
        st = self.state
        st.step = step
        if s is not None:
            s.group_ids = [g.group_id for g in groups]
        st.consumed_entries += [g.entry_id for g in groups]
        if s is not None:
            st.groups_dropped += len(s.dropped)
            st.groups_trained += len(groups) - len(s.dropped)
            for k, n in s.drop_reasons.items():
                st.drop_reasons[k] = st.drop_reasons.get(k, 0) + n
            st.staleness_max = max([st.staleness_max, *s.staleness])
        else:
            st.groups_trained += len(groups)
        self.control.update(step=step, groups_trained=st.groups_trained,
                            groups_dropped=st.groups_dropped, staleness_max=st.staleness_max)
        self.control.set_drop_reasons(st.drop_reasons)
        self._report_consumed()

    def evaluate(self) -> None:
        """Rank 0: the eval run due at this step, recorded (evaluation.py); none after a stop."""
        if self.dist.is_main and not self.control.stop_requested:
            evaluation.evaluate_if_due(self)

    def checkpoint_due(self) -> bool:
        return self.dist.agree(
            self.state.step % self.cfg.checkpoint_every == 0
            or self.state.step >= self.cfg.steps
            or (self.control.stop_requested and not self.control.skip_checkpoint))

    def commit(self) -> Path:
        """Checkpoints the current state (unless this step is checkpointed already), then
        acknowledges the entries it holds."""
        if self.checkpointed_step == self.state.step and self.last_checkpoint is not None:
            return self.last_checkpoint
        self.control.set_state("checkpointing")
        t0 = time.perf_counter()
        assert self.optimizer is not None
        if self.dist.sharded:
            path = ckpt.save_sharded_checkpoint(
                self.cfg.checkpoints_dir, self.model, self.tokenizer, self.optimizer,
                self.state, self.dist, keep=self.cfg.keep_checkpoints)
        else:
            path = ckpt.save_checkpoint(self.cfg.checkpoints_dir, self.model, self.tokenizer,
                                        self.optimizer, self.state,
                                        keep=self.cfg.keep_checkpoints)
        self.last_checkpoint, self.checkpointed_step = path, self.state.step
        self.control.update(last_checkpoint=str(path))
        if self.dist.is_main:
            assert self.reader is not None
            self.reader.ack(self.state.consumed_entries)
            if self.cfg.trim_stream:
                self._trim_stream()
        self.state.consumed_entries = []
        log.info("checkpoint %s (%.2fs)", path, time.perf_counter() - t0,
                 extra={"step": self.state.step})
        return path

    def _trim_stream(self) -> None:
        """Trims the stream below what every retained checkpoint has consumed (the store
        keeps whatever a consumer group has pending or not yet read)."""
        assert self.store is not None
        below = ckpt.retained_consumed_floor(self.cfg.checkpoints_dir)
        try:
            resp = self.store.trim_groups(below, stream=self.cfg.stream)
        except grpc.RpcError as err:  # trimming is housekeeping: the next checkpoint retries
            log.warning("trimming stream %s failed: %s", self.cfg.stream, err)
            return
        if resp.trimmed:
            log.info("stream %s: trimmed %d entries below %s", self.cfg.stream, resp.trimmed,
                     resp.min_entry_id)

    def answer_checkpoint_requests(self) -> None:
        waiters = self.control.take_checkpoint_requests()
        if self.dist.agree(bool(waiters)):
            path = self.commit()
            for w in waiters:
                w.set_result((str(path), self.state.step))

    def record(self, s: StepRecord, m: StepMetrics | None, checkpoint: bool
               ) -> dict[str, Any] | None:
        if not self.dist.is_main:
            return None
        rewards = s.rewards
        row: dict[str, Any] = {
            "step": s.step, "policy_version": self.state.policy_version,
            "behaviour_version": s.behaviour_version, "run_id": s.run_id, "time": time.time(),
            "reward_mean": statistics.fmean(rewards) if rewards else None,
            "reward_std": statistics.pstdev(rewards) if rewards else None,
            "rollouts": 0, "rollouts_failed": 0, "groups": 0, "groups_trained": 0,
            "groups_zero_variance": 0, "groups_too_few": 0, "groups_dead_lettered": 0,
            "version_mismatches": 0,
            **s.counts, "trained": m is not None,
            "samples": m.samples if m else 0, "tokens": m.tokens if m else 0,
            "input_tokens": m.input_tokens if m else 0,
            "loss": m.loss if m else None, "kl": m.kl if m else None,
            "clip_fraction": m.clip_frac if m else None,
            "capped_fraction": m.capped_frac if m else None,
            "entropy": m.entropy if m else None, "grad_norm": m.grad_norm if m else None,
            "generate_s": 0.0, "train_s": 0.0, "push_s": 0.0, **s.phases,
            "step_time_s": time.perf_counter() - s.started,
            "tokens_per_s": m.input_tokens / s.phases["train_s"]
            if m and s.phases.get("train_s") else None,
            "mode": self.cfg.mode.kind, "groups_dropped": len(s.dropped),
            "group_ids": s.group_ids, "drop_reasons": s.drop_reasons,
            "staleness_hist": {str(k): s.staleness.count(k) for k in sorted(set(s.staleness))},
            "staleness_max": max(s.staleness, default=None),
            "held_calls": s.held_calls if self.hold is not None else None,
            "total_groups_trained": self.state.groups_trained,
            "total_groups_dropped": self.state.groups_dropped,
            "checkpoint": str(self.cfg.checkpoints_dir / ckpt.step_dir_name(s.step))
            if checkpoint else None,
            "trained_rollouts": s.trained_rollouts, "dropped_rollouts": s.dropped_rollouts,
        }
        row["trainer_busy_fraction"] = (row["train_s"] + row["push_s"]) / row["step_time_s"]
        w = self.gauges.take() if self.gauges is not None else GaugeWindow()
        row.update(engine_busy_fraction=w.engine_busy_fraction,
                   groups_in_flight=w.groups_in_flight, groups_admitted=w.groups_admitted)
        if w.groups_in_flight is not None:
            self.control.update(groups_in_flight=w.groups_in_flight,
                                groups_admitted=w.groups_admitted or 0)
        append_jsonl(self.cfg.metrics_file, row)
        for rendered in s.rollouts:
            append_jsonl(self.rollouts_file, rendered)
        prom.observe_step(row)
        if self.trackers is not None:
            self.trackers.log_step(row, s.rollouts)
        self.control.add_step(tpb.StepMetrics(
            step=s.step, policy_version=row["policy_version"],
            reward_mean=_num(row["reward_mean"]), reward_std=_num(row["reward_std"]),
            loss=_num(row["loss"]), kl=_num(row["kl"]),
            clip_fraction=_num(row["clip_fraction"]), entropy=_num(row["entropy"]),
            tokens=row["tokens"], step_time_s=row["step_time_s"], groups=row["groups"],
            grad_norm=_num(row["grad_norm"]), groups_dropped=row["groups_dropped"],
            staleness_mean=statistics.fmean(s.staleness) if s.staleness else math.nan,
            staleness_max=row["staleness_max"] or 0,
            groups_in_flight=row["groups_in_flight"] or 0,
            engine_busy_fraction=_num(row["engine_busy_fraction"]),
            trainer_busy_fraction=row["trainer_busy_fraction"],
            held_calls=row["held_calls"] or 0))
        log.info("step %d: reward %.3f, loss %s, kl %s, %d tokens, %.1fs", s.step,
                 _num(row["reward_mean"]), row["loss"], row["kl"], row["tokens"],
                 row["step_time_s"], extra={"step": s.step, "version": row["policy_version"]})
        return row

    def close(self) -> None:
        if self.gauges is not None:
            self.gauges.close()
        for part in (self.weights, self.trackers, self.colo):
            if part is not None:
                part.close()


def _num(x: float | None) -> float:
    return math.nan if x is None else float(x)


def build_trainer(cfg: TrainerConfig, control: TrainerControl | None = None,
                  dist: Dist | None = None) -> Trainer:
    """The service's trainer: the controller runs the steps, the store's stream feeds it, the
    engines registered with the gateway get its weights. Sharded, only rank 0 connects to
    them (one voice); the other ranks follow it through collectives."""
    from harnessrl.clients import ControllerClient, GatewayAdminClient

    from .rollouts import ControllerRuns
    from .weights import make_sink

    if dist is not None and not dist.is_main:
        return Trainer(cfg, None, None, None, control, dist)

    store = StoreClient.connect(cfg.store_address)
    adapter = run_prefix_of(Path(cfg.output_dir), cfg.run_name) if cfg.lora else ""  # LoRA
    launcher = ControllerRuns(ControllerClient.connect(cfg.controller_address),
                              cfg.run_timeout_s, adapter)
    admin = GatewayAdminClient.connect(cfg.gateway_admin_address)
    weights = make_sink(admin, cfg)
    controller = ControllerClient.connect(cfg.controller_address)
    gauges = Gauges(GatewayAdminClient.connect(cfg.gateway_admin_address), controller,
                    cfg.mode.gauge_interval_s)
    collocated, m = cfg.mode.kind == "collocated", cfg.mode
    hold = GatewayHold(admin, m.hold_drain_timeout_s, adapter) if collocated else None
    sleep = EngineSleep(admin, m.sleep_level, m.sleep_timeout_s) if m.sleep_level else None
    return Trainer(cfg, launcher, store, weights, control, dist, gauges=gauges, hold=hold,
                   admission=gauges, sleep=sleep)
