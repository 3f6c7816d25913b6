"""The training loop. `train_sync` is the whole sync mode, top to bottom; `Trainer` holds the
state and does each part.

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
exactly the trainer's weights before the first rollout.

Several processes (world size N > 1, `sharding.py`): every rank runs `train_sync`. Rank 0 alone
talks to the rest of the system — it launches the runs, reads and acknowledges the stream,
pushes to the engines, writes metrics, serves the Trainer gRPC service — and hands the others
what they need through collectives: the step's groups (each rank builds the same samples and
trains on its share), its decisions (continue, checkpoint now), and the full weights for a push
(gathered bucket by bucket). Checkpoints are written by all ranks together (`checkpoint`).

Version check (`version_check`): in sync mode every call of step s must carry version v. A
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
    generate_s, train_s, push_s, step_time_s
                       float  wall time of each phase and of the step (without its checkpoint)
    checkpoint         str    checkpoint written after this step, or null

A line is appended before the step's checkpoint is written: if the trainer dies in between, the
resumed trainer drops the line and redoes the step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import trainer_pb2 as tpb

from . import checkpoint as ckpt
from .config import TrainerConfig
from .control import TrainerControl
from .rollouts import RunLauncher, StreamReader, load_tasks, run_id_for, step_spec, step_tasks
from .samples import group_samples
from .sharding import Dist, ShardingConfig, device_for, shard_model, split_by_tokens
from .step import StepMetrics, make_optimizer, train_step
from .weights import WeightSink

log = logging.getLogger("harnessrl.trainer")

RUN_FILE = "run.json"


def train_sync(t: "Trainer") -> None:
    """The sync loop: generate a batch, train on it, push, checkpoint, repeat."""
    t.start()  # resume or initialise; the engines get the trainer's weights
    while t.more_steps():  # steps left, no stop requested (rank 0 decides for every rank)
        step, version = t.state.step + 1, t.state.policy_version
        s = StepRecord(step=step, behaviour_version=version)
        run_id, tasks = t.generate(step, s)  # controller run of the step's tasks, until done
        groups = t.read_groups(run_id, step, tasks)  # its groups (rank 0 reads, all get them)
        t.check_versions(groups, version, s)  # every call served by version v
        metrics = t.train(groups, s)  # samples -> one optimizer step (None: no sample)
        if metrics is not None:
            t.push(version + 1, s)  # every engine serves version v+1, or we stop
        t.finish_step(step, groups)  # step done; its entries await the next checkpoint
        due = t.checkpoint_due()
        t.record(s, metrics, due)  # metrics.jsonl (a line the checkpoint misses is redone)
        if due:
            t.commit()  # checkpoint, then acknowledge the entries it holds
        t.answer_checkpoint_requests()
    if t.final_checkpoint_wanted():
        t.commit()  # no-op when the last step is checkpointed already


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

    def timed(self, phase: str, since: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - since


class Trainer:
    """The trainer's state and the parts of the loop (`train_sync` strings them together).

    `launcher` runs a step's controller run, `store` reads and acknowledges the stream,
    `weights` receives the weights after each step: `ControllerRuns`, `StoreClient` and
    `EngineWeights` in the service (`build_trainer`); tests may give their own. With `dist`
    sharded, ranks other than 0 get None for all three (rank 0 alone uses them) and `weights`
    on rank 0 receives the gathered weights (`sharded.GatheredWeights`) rather than the model.
    """

    def __init__(self, cfg: TrainerConfig, launcher: RunLauncher | None,
                 store: StoreClient | None, weights: WeightSink | None,
                 control: TrainerControl | None = None, dist: Dist | None = None) -> None:
        self.cfg = cfg
        self.dist = dist or Dist.single()
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
        source = found if found is not None else Path(d.agree(
            self._initial_model() if d.is_main else ""))
        self.model = AutoModelForCausalLM.from_pretrained(
            source, dtype=getattr(torch, self.cfg.dtype)).to(device_for(self.cfg.device, d))
        self.model = shard_model(self.model, d, ShardingConfig(
            mixed_precision=self.cfg.mixed_precision,
            activation_checkpointing=self.cfg.activation_checkpointing))
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        self.optimizer = make_optimizer(self.model, lr=self.cfg.lr,
                                        betas=(self.cfg.beta1, self.cfg.beta2),
                                        weight_decay=self.cfg.weight_decay, eps=self.cfg.adam_eps)
        run_prefix = d.agree(self._run_prefix() if d.is_main else "")
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
                            last_checkpoint=str(self.last_checkpoint or ""))
        if d.is_main:
            self._attach_stream(run_prefix)
        self.control.set_state("pushing")
        self._push_weights(self.state.policy_version)

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
        _trim_metrics(self.cfg.metrics_file, self.state.step)

    def _push_weights(self, version: int) -> None:
        """Every engine gets the weights as `version` (sharded: rank 0 pushes, bucket by bucket
        gathered with the other ranks' help)."""
        d = self.dist
        if not d.sharded:
            assert self.weights is not None
            self.weights.push(self.model, version)
            return
        from harnessrl.weight_transfer.sharded import GatheredWeights, follow_gathers

        from .sharding import object_group

        bucket = self.cfg.push_config().bucket_bytes
        if d.is_main:
            assert self.weights is not None
            with GatheredWeights(self.model, bucket, object_group()) as gathered:
                self.weights.push(gathered, version)  # type: ignore[arg-type]
        else:
            follow_gathers(self.model, bucket, object_group())

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

    def _run_prefix(self) -> str:
        """`<run_name>-<nonce>`, drawn once per output dir and kept in run.json."""
        path = self.output / RUN_FILE
        if path.exists():
            return str(json.loads(path.read_text())["run_prefix"])
        prefix = f"{self.cfg.run_name}-{uuid.uuid4().hex[:8]}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run_prefix": prefix}) + "\n")
        tmp.replace(path)
        return prefix

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
                        g, self.cfg.advantage_config(), self.cfg.max_sample_len)
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
        if bad:
            msg = (f"step {s.step}: {len(bad)} calls were served by another policy version "
                   f"than {version} (rollout, seq, version): {bad[:5]}")
            if self.cfg.version_check == "fail":
                raise RuntimeError(msg)
            log.warning("%s", msg, extra={"step": s.step})

    def train(self, groups: list[c.Group], s: StepRecord) -> StepMetrics | None:
        self.control.set_state("training")
        t0 = time.perf_counter()
        results = [self._built.pop(g.entry_id, None) or
                   group_samples(g, self.cfg.advantage_config(), self.cfg.max_sample_len)
                   for g in groups]
        self._built.clear()
        samples = [x for r in results for x in r.samples]
        s.rewards = [rw for r in results for rw in r.rewards]
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

    def finish_step(self, step: int, groups: list[c.Group]) -> None:
        self.state.step = step
        self.state.consumed_entries += [g.entry_id for g in groups]
        self.control.update(step=step)

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
            "checkpoint": str(self.cfg.checkpoints_dir / ckpt.step_dir_name(s.step))
            if checkpoint else None,
        }
        _append_jsonl(self.cfg.metrics_file, row)
        self.control.add_step(tpb.StepMetrics(
            step=s.step, policy_version=row["policy_version"],
            reward_mean=_num(row["reward_mean"]), reward_std=_num(row["reward_std"]),
            loss=_num(row["loss"]), kl=_num(row["kl"]),
            clip_fraction=_num(row["clip_fraction"]), entropy=_num(row["entropy"]),
            tokens=row["tokens"], step_time_s=row["step_time_s"], groups=row["groups"],
            grad_norm=_num(row["grad_norm"])))
        log.info("step %d: reward %.3f, loss %s, kl %s, %d tokens, %.1fs", s.step,
                 _num(row["reward_mean"]), row["loss"], row["kl"], row["tokens"],
                 row["step_time_s"], extra={"step": s.step, "version": row["policy_version"]})
        return row

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()


def _num(x: float | None) -> float:
    return math.nan if x is None else float(x)


def _append_jsonl(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _trim_metrics(path: Path, step: int) -> None:
    """Drops lines of steps after `step` (written before a crash, redone after the resume)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = [x for x in lines if x.strip() and json.loads(x)["step"] <= step]
    if len(keep) != len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        tmp.replace(path)


def build_trainer(cfg: TrainerConfig, control: TrainerControl | None = None,
                  dist: Dist | None = None) -> Trainer:
    """The service's trainer: the controller runs the steps, the store's stream feeds it, the
    engines registered with the gateway get its weights. Sharded, only rank 0 connects to
    them (one voice); the other ranks follow it through collectives."""
    from harnessrl.clients import ControllerClient, GatewayAdminClient

    from .rollouts import ControllerRuns
    from .weights import EngineWeights

    if dist is not None and not dist.is_main:
        return Trainer(cfg, None, None, None, control, dist)

    store = StoreClient.connect(cfg.store_address)
    launcher = ControllerRuns(ControllerClient.connect(cfg.controller_address),
                              cfg.run_timeout_s)
    weights = EngineWeights(GatewayAdminClient.connect(cfg.gateway_admin_address),
                            cfg.push_config(), cfg.push_attempts, cfg.push_retry_delay_s)
    return Trainer(cfg, launcher, store, weights, control, dist)
