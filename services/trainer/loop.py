"""The training loop. `train_sync` is the whole sync mode, top to bottom, `train_async` the async
and collocated modes (docs/modes.md). `Trainer` holds the state and strings into the loops'
phases the parts, each where what it owns lives: resume.py (model and state), the stream
reader (rollouts.py), sync steps' runs (sync_first.py), the async pool (pool.py), records.py.

One async step s (trainer at version v): the first `tasks_per_step` completed groups of the one
admission-controlled controller run whose calls are at most `mode.max_staleness` versions old
(older ones before them dropped, counted, with a reason) -> (collocated: the gateway holds new
calls; with `mode.sleep_level` the engines sleep, collocation.py) -> samples -> one optimizer
step -> push as v+1 -> (collocated: held calls go on) -> the controller is told how many groups
the trainer consumed -> checkpoint -> metrics. Rollouts keep running throughout.

One sync step s (the weights at policy version v = the version pushed after step s-1):

    tasks of step s (seeded by seed and s) -> controller run `<prefix>-step<s>` (idempotent)
    -> wait until it is done (sync-first, `mode.sync_spare_groups`: with spares, until
    tasks_per_step groups are done, then cancel it) -> its groups from the store's stream ->
    check every call was served by version v -> samples -> one optimizer step -> push the
    weights into every engine as version v+1 -> checkpoint (every `checkpoint_every` steps and
    after the last) -> acknowledge the groups the checkpoint holds -> metrics.

A step whose groups give no sample (every group zero-variance or failed) takes no optimizer
step and pushes nothing: its policy version stays v.

Several processes (world size N > 1, `sharding.py`): every rank runs the loop. Rank 0 alone
talks to the rest of the system — it launches the runs, reads and acknowledges the stream,
pushes to the engines, writes metrics, serves the Trainer gRPC service — and hands the others
what they need through collectives: the step's groups (each rank builds the same samples and
trains on its share), its decisions (continue, checkpoint now), and the full weights for a push
(gathered bucket by bucket). Checkpoints are written by all ranks together (`checkpoint`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c

from . import checkpoint as ckpt
from .collocation import Collocation, EngineSleep
from .config import TrainerConfig
from .control import TrainerControl
from .evaluation import Evaluator
from .gauges import GatewayHold, Gauges
from .outputs import trim_metrics
from .pool import AsyncPool
from .records import Recorder, StepRecord
from .resume import load
from .rollouts import AdmissionReporter, RunLauncher, StreamReader, load_tasks, run_id_for
from .samples import group_samples
from .sharding import Dist, device_for
from .step import StepMetrics, train_step
from .sync_first import SyncSteps
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


class Trainer:
    """The trainer's state and the parts of the loop. `launcher` runs a step's controller run,
    `store` feeds the stream, `weights` receives the weights after each step: `ControllerRuns`,
    `StoreClient` and `EngineWeights` in the service (`server.build_trainer`); tests may give
    their own. Sharded, ranks other than 0 get None for all three, and `weights` on rank 0
    receives the gathered weights (`sharded.GatheredWeights`) rather than the model."""

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
        self.pool = AsyncPool(cfg, launcher, admission, hold)  # async and collocated modes
        self.sync = SyncSteps(cfg, launcher)  # sync mode's step runs (sync-first: spares)
        self.launcher, self.store, self.weights = launcher, store, weights
        self.control = control or TrainerControl()
        self.state = ckpt.TrainState()
        self.tasks = load_tasks(cfg.tasks_file)
        self.model: Any = None
        self.tokenizer: Any = None
        self.pixels: Any = None  # a vision model: its images' pixels (pixels.py)
        self.optimizer: torch.optim.Optimizer | None = None
        self.reader: StreamReader | None = None  # rank 0
        self.evaluator: Evaluator | None = None  # rank 0
        self.recorder: Recorder | None = None  # rank 0
        self._built: dict[str, Any] = {}  # entry id -> its samples, built while screening
        self._dead_in_step = 0
        self.last_checkpoint: Path | None = None
        self.checkpointed_step = -1
        self.output = Path(cfg.output_dir)
        self.rollouts_file = self.output / "rollouts.jsonl"
        self.trackers: Trackers | None = None

    @property
    def pool_run_id(self) -> str:
        return self.pool.run_id

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Resumes or starts afresh (resume.py), acknowledges the entries the checkpoint consumed
        (`checkpoint` says why this loses nothing and trains nothing twice) and pushes the weights
        as its policy version: the engines serve exactly the trainer's weights from the start."""
        self.output.mkdir(parents=True, exist_ok=True)
        on_host = self.colo is not None and self.colo.offload.hold_on_host()  # until a step
        got = load(self.cfg, self.output, self.dist, on_host, self.store)
        self.model, self.tokenizer, self.optimizer = got.model, got.tokenizer, got.optimizer
        self.state, self.pixels = got.state, got.pixels
        if got.checkpoint is not None:
            self.last_checkpoint, self.checkpointed_step = got.checkpoint, self.state.step
        self.control.show_counts(self.state, policy_version=self.state.policy_version,
                                 last_checkpoint=str(self.last_checkpoint or ""),
                                 mode=self.cfg.mode.kind)
        if self.dist.is_main:  # rank 0's parts: the stream, the trackers, the records, evals
            self._attach_stream(self.state.run_prefix)
            self.trackers = Trackers(self.cfg, self.output, self.state.run_prefix, self.state.step)
            self.recorder = Recorder(self.cfg, self.rollouts_file, self.trackers, self.control,
                                     self.gauges, self.hold is not None)
            self.evaluator = Evaluator(self.cfg, self.launcher, self.store, self.control,
                                       self.output, self.trackers)
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
        self.reader.ack_resumed(self.state.consumed_entries)  # in the checkpoint: trained
        self.state.consumed_entries = []
        trim_metrics(self.cfg.metrics_file, self.state.step)
        trim_metrics(self.rollouts_file, self.state.step)

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

    def checkpoint_due(self) -> bool:
        st = self.state
        return self.dist.agree(st.step % self.cfg.checkpoint_every == 0 or st.step >= self.cfg.steps
                               or (self.control.stop_requested and not self.control.skip_checkpoint))

    # -- one sync step -------------------------------------------------------------------------
    def generate(self, step: int, s: StepRecord) -> tuple[str, list[str]]:
        self.control.set_state("generating")
        if not self.dist.is_main:  # rank 0 runs the step; the others get its groups
            return "", []
        assert self.launcher is not None
        t0 = time.perf_counter()
        s.run_id = run_id_for(self.state.run_prefix, step)
        tasks = self.sync.generate(self.reader, self.tasks, self.state, s)  # sync_first.py
        s.timed("generate_s", t0)
        return s.run_id, tasks

    def read_groups(self, run_id: str, step: int, tasks: list[str]) -> list[c.Group]:
        """Rank 0 reads the run's groups and screens them (`StreamReader.screen`: a group whose
        samples cannot be built is redelivered or dead-lettered); every rank gets them."""
        if not self.dist.is_main:
            return self.dist.agree([])
        assert self.reader is not None
        groups, self._built = self.reader.screen(  # sync-first: the groups generate took
            self.sync.read(self.reader, run_id, step, tasks, set(self.state.consumed_entries)),
            self.samples_of)
        self._dead_in_step = len(self.reader.dead_groups(run_id))
        return self.dist.agree(groups)

    def check_versions(self, groups: list[c.Group], version: int, s: StepRecord) -> None:
        """Sync mode: a call served by another version than `version` (the engines served other
        weights than the trainer's) stops the trainer or is logged (`mode.version_check`)."""
        bad = [(r.rollout_id, call.seq, call.policy_version) for g in groups
               for r in g.rollouts for call in r.calls if call.policy_version != version]
        s.counts["version_mismatches"] = len(bad)
        if bad:
            msg = (f"step {s.step}: {len(bad)} calls were served by another policy version "
                   f"than {version} (rollout, seq, version): {bad[:5]}")
            if self.cfg.mode.version_check == "fail":
                raise RuntimeError(msg)
            log.warning("%s", msg, extra={"step": s.step})

    # -- async / collocated (pool.py, collocation.py) ------------------------------------------
    def open_pool(self) -> None:
        """Rank 0: creates (or re-attaches to) the pool's controller run."""
        if self.dist.is_main:
            self.pool.open(self.state, self.tasks)

    def take_groups(self, s: StepRecord) -> list[c.Group]:
        """The step's groups from the pool (dropped ones in `s`), the same on every rank."""
        self.control.set_state("generating")
        if not self.dist.is_main:
            return self.dist.agree([])
        assert self.reader is not None
        groups = self.pool.take(self.reader, s, self.state)
        self._built = {g.entry_id: self.samples_of(g) for g in groups}  # before hold_calls
        return self.dist.agree(groups)

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
        """Rank 0: the pool run's groups never admitted are cancelled (not after a stop)."""
        if self.dist.is_main and not self.control.stop_requested:
            self.pool.close()

    # -- every step ----------------------------------------------------------------------------
    def samples_of(self, g: c.Group) -> Any:  # with its images' pixels (a vision model)
        return group_samples(g, self.cfg.advantage, self.cfg.loss.max_sample_len, self.pixels)

    def train(self, groups: list[c.Group], s: StepRecord) -> StepMetrics | None:
        self.control.set_state("training")
        t0 = time.perf_counter()
        built, self._built = self._built, {}
        results = [built.get(g.entry_id) or self.samples_of(g) for g in groups]
        samples = s.add_samples(groups, results, self.state.policy_version, self._dead_in_step)
        if self.dist.is_main and self.cfg.sample_rollouts:
            s.rollouts = render_rollouts(groups, self.tokenizer, self.cfg.sample_rollouts, s.step)
        metrics = None
        if samples:
            assert self.optimizer is not None
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            samples = self.dist.share(samples, [len(x) for x in samples])  # balanced
            try:
                metrics = train_step(self.model, self.optimizer, samples,
                                     self.cfg.step_config(pad), self.dist)
            except Exception as exc:
                if self.reader is not None:  # counts against each group; redelivered later
                    self.reader.fail(groups, f"training step {s.step} failed: "
                                     f"{type(exc).__name__}: {exc}")
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

    def finish_step(self, step: int, groups: list[c.Group], s: StepRecord | None = None) -> None:
        """Step done: its entries (trained, skipped or dropped) await the next checkpoint; the
        counts that prove nothing was lost are in the state (and so in the checkpoint)."""
        st = self.state
        st.step = step
        st.consumed_entries += [g.entry_id for g in groups]
        if s is not None:
            s.group_ids = [g.group_id for g in groups]
            s.count_into(st, groups)
        else:
            st.groups_trained += len(groups)
        self.control.show_counts(st)
        self.pool.report(st)

    def evaluate(self) -> None:
        """Rank 0: the eval run due at this step, recorded (evaluation.py); none after a stop."""
        if self.evaluator is not None and not self.control.stop_requested:
            here = self.checkpointed_step == self.state.step
            self.evaluator.evaluate_if_due(self.state, self.last_checkpoint if here else None)

    def commit(self) -> Path:
        """Checkpoints the current state (unless this step is checkpointed already), then
        acknowledges the entries it holds and trims the stream below what the retained
        checkpoints need."""
        if self.checkpointed_step == self.state.step and self.last_checkpoint is not None:
            return self.last_checkpoint
        self.control.set_state("checkpointing")
        t0 = time.perf_counter()
        assert self.optimizer is not None
        parts, keep = (self.cfg.checkpoints_dir, self.model, self.tokenizer, self.optimizer,
                       self.state), self.cfg.keep_checkpoints
        path = ckpt.save_sharded_checkpoint(*parts, self.dist, keep=keep) if self.dist.sharded \
            else ckpt.save_checkpoint(*parts, keep=keep)
        self.last_checkpoint, self.checkpointed_step = path, self.state.step
        self.control.update(last_checkpoint=str(path))
        if self.dist.is_main:
            assert self.reader is not None
            self.reader.ack(self.state.consumed_entries)
            if self.cfg.trim_stream:
                self.reader.trim(ckpt.retained_consumed_floor(self.cfg.checkpoints_dir))
        self.state.consumed_entries = []
        log.info("checkpoint %s (%.2fs)", path, time.perf_counter() - t0,
                 extra={"step": self.state.step})
        return path

    def answer_checkpoint_requests(self) -> None:
        waiters = self.control.take_checkpoint_requests()
        if self.dist.agree(bool(waiters)):
            path = self.commit()
            for w in waiters:
                w.set_result((str(path), self.state.step))

    def record(self, s: StepRecord, m: StepMetrics | None, checkpoint: bool
               ) -> dict[str, Any] | None:
        """Rank 0: the step's line in metrics.jsonl and its other records (records.py)."""
        return None if self.recorder is None else \
            self.recorder.record(s, m, self.state, checkpoint)

    def close(self) -> None:
        for part in (self.gauges, self.weights, self.trackers, self.colo):
            if part is not None:
                part.close()
