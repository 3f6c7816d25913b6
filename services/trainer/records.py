"""What one training step did (`StepRecord`, filled in as the step runs) and the line it
becomes in `<output_dir>/metrics.jsonl` (`MetricsRow`, the schema: every field typed and
documented here, once: the table in docs/observability.md is generated from it, `python -m
services.trainer.records --write`, and tests/test_metrics_row.py checks it).

`<output_dir>/metrics.jsonl` holds one JSON object per step, appended when the step is done,
before the step's checkpoint is written: if the trainer dies in between, the resumed trainer
drops the line and redoes the step (on resume, lines of steps after the checkpoint are
dropped, so each step appears once). Lines with "kind": "eval" are evaluations (step 0: before
training), their schema in evaluation.py.

`<output_dir>/rollouts.jsonl`: `sample_rollouts` rendered rollouts of each step (step,
rollout_id, task_id, reward, status, tampered, tamper_evidence, calls, text), trimmed on resume
like metrics.jsonl. Rows and rollouts also go to Prometheus (`metrics.py`) and, when switched
on, to TensorBoard and W&B (`tracking.py`); `harnessrl report` makes an HTML page of them.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.v1 import common_pb2 as c

from . import metrics as prom
from .checkpoint import TrainState, step_dir_name
from .config import TrainerConfig
from .control import TrainerControl
from .gauges import Gauges, GaugeWindow
from .outputs import append_jsonl, step_metrics
from .samples import GroupSamples, Sample
from .step import StepMetrics
from .tracking import Trackers

log = logging.getLogger("harnessrl.trainer")


@dataclass
class StepRecord:
    """What one step did, for metrics.jsonl and the gRPC status: the loop's parts fill it in as
    the step runs (`MetricsRow.of_step` turns it into the step's line)."""

    step: int
    behaviour_version: int  # the trainer's policy version at the step's start
    run_id: str = ""  # the controller run the step's groups came from
    started: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)  # wall time of each phase (`timed`)
    rewards: list[float] = field(default_factory=list)  # of the usable rollouts
    counts: dict[str, int] = field(default_factory=dict)  # MetricsRow's counts, as found
    trained_rollouts: list[str] = field(default_factory=list)  # ids, sorted
    dropped_rollouts: dict[str, str] = field(default_factory=dict)  # id -> why no sample
    rollouts: list[dict[str, Any]] = field(default_factory=list)  # rendered, rollouts.jsonl
    dropped: list[c.Group] = field(default_factory=list)  # groups taken, not trained (stale)
    drop_reasons: dict[str, int] = field(default_factory=dict)  # reason -> groups dropped
    staleness: list[int] = field(default_factory=list)  # per trained sample
    held_calls: int = 0  # collocated: calls of its groups the gateway held
    group_ids: list[str] = field(default_factory=list)  # taken: trained, skipped or dropped

    def timed(self, phase: str, since: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - since

    def drop(self, group: c.Group, reason: str) -> None:
        """A group taken and not trained on (async: too stale), with its reason."""
        self.dropped.append(group)
        key = reason.split(":")[0]
        self.drop_reasons[key] = self.drop_reasons.get(key, 0) + 1
        self.dropped_rollouts.update((ro.rollout_id, reason) for ro in group.rollouts)

    def count_into(self, state: TrainState, groups: Sequence[c.Group]) -> None:
        """The step's groups (`groups`: every one it took) into the trainer's counts, which
        prove nothing was lost (in the state, and so in the checkpoint)."""
        state.groups_dropped += len(self.dropped)
        state.groups_trained += len(groups) - len(self.dropped)
        for k, n in self.drop_reasons.items():
            state.drop_reasons[k] = state.drop_reasons.get(k, 0) + n
        state.staleness_max = max([state.staleness_max, *self.staleness])

    def add_samples(self, groups: Sequence[c.Group], results: Sequence[GroupSamples],
                    version: int, dead_lettered: int) -> list[Sample]:
        """What the step's groups gave (`results`, one per group; trainer at `version`):
        rewards, staleness, the rollouts trained on and why the others gave no sample, the
        group counts; returns the samples."""
        samples = [x for r in results for x in r.samples]
        self.staleness = [version - min(x.policy_versions or [version]) for x in samples]
        self.rewards = [rw for r in results for rw in r.rewards]
        self.trained_rollouts = sorted({x.rollout_id for x in samples})
        for g, r in zip(groups, results, strict=True):
            for ro in g.rollouts:
                if ro.rollout_id not in self.trained_rollouts:
                    self.dropped_rollouts[ro.rollout_id] = r.drop_reasons.get(ro.rollout_id) or (
                        ("tampered" if ro.tampered else "failed")
                        if ro.rollout_id in r.dropped_rollouts
                        else f"group {r.skipped}" if r.skipped else "no tokens")
        self.counts.update(
            groups=len(groups), groups_trained=sum(1 for r in results if r.samples),
            groups_zero_variance=sum(1 for r in results if r.skipped == "zero_variance"),
            groups_too_few=sum(1 for r in results if r.skipped == "too_few_rollouts"),
            groups_dead_lettered=dead_lettered,
            rollouts_tampered=sum(ro.tampered for g in groups for ro in g.rollouts))
        return samples


def _f(doc: str, omitted: bool = False) -> Any:
    """A field of the row: its documentation; `omitted`: left out of the line when not
    measured (None)."""
    return Field(None if omitted else ..., description=doc,
                 json_schema_extra={"omitted": True} if omitted else None)


class MetricsRow(BaseModel):
    """One step's line in metrics.jsonl, fields in the order they are written. A `float |
    None` field is null when the step took no optimizer step (or had nothing to measure); the
    fields marked "omitted" are left out of the line when not measured."""

    model_config = ConfigDict(extra="forbid")

    step: int = _f("the step (1-based)")
    policy_version: int = _f("version of the weights after the step (pushed to the engines)")
    behaviour_version: int = _f("version of the trainer's weights at the step's start: in "
                                "sync mode the version that served the step's calls")
    run_id: str = _f("the controller run of the step (async, collocated: the one pool run)")
    time: float = _f("unix time the step ended")
    reward_mean: float | None = _f("mean reward of the step's succeeded, rewarded rollouts "
                                   "(null if none)")
    reward_std: float | None = _f("their standard deviation (population; null if none)")
    rollouts: int = _f("rollouts in the step's run (async: in the groups it took)")
    rollouts_failed: int = _f("of them not SUCCEEDED (no reward, not trained on)")
    rollouts_tampered: int = _f("of them found tampered by a grader (reward: the run's "
                                "`tampered_rewards`; DROP: none, dropped_rollouts \"tampered\")")
    groups: int = _f("groups the step trained on or skipped (async: dropped ones not counted)")
    groups_trained: int = _f("groups that gave samples")
    groups_zero_variance: int = _f("groups skipped because all rewards were equal")
    groups_too_few: int = _f("groups skipped for too few succeeded rollouts")
    groups_dead_lettered: int = _f("groups of the step's run moved to the dead-letter stream "
                                   "(delivered `max_group_deliveries` times); trained without")
    version_mismatches: int = _f("sync mode: calls served by another version than "
                                 "behaviour_version (0 in async and collocated modes)")
    trained: bool = _f("whether an optimizer step was taken")
    samples: int = _f("training sequences")
    tokens: int = _f("loss tokens (completion tokens trained on)")
    input_tokens: int = _f("all tokens run through the model")
    loss: float | None = _f("the batch loss, before the update (`step.StepMetrics`)")
    kl: float | None = _f("k3 estimate of KL(behaviour || policy), mean over loss tokens")
    clip_fraction: float | None = _f("share of loss tokens whose ratio was clipped")
    capped_fraction: float | None = _f("share of loss tokens whose importance weight was "
                                       "capped")
    entropy: float | None = _f("mean next-token entropy of the policy over loss tokens (nats)")
    grad_norm: float | None = _f("total gradient L2 norm before clipping")
    generate_s: float = _f("wall time of the generate phase (sync: the step's run; async: "
                           "waiting for the groups)")
    train_s: float = _f("wall time of the train phase (samples and the optimizer step)")
    push_s: float = _f("wall time of the push into the engines")
    hold_s: float | None = _f("collocated: wall time of the gateway's hold", omitted=True)
    sleep_s: float | None = _f("collocated with sleep: the engines' sleep", omitted=True)
    wake_s: float | None = _f("collocated with sleep: the engines' wake", omitted=True)
    onload_s: float | None = _f("collocated, offload on a GPU: the last onload of the "
                                "trainer's state", omitted=True)
    offload_optimizer_s: float | None = _f("collocated, offload on a GPU: the last offload of "
                                           "the optimizer state", omitted=True)
    offload_params_s: float | None = _f("collocated, offload on a GPU: the last offload of the "
                                        "parameters", omitted=True)
    step_time_s: float = _f("wall time of the step (without its checkpoint)")
    tokens_per_s: float | None = _f("input_tokens / train_s (null when not trained)")
    mode: Literal["sync", "async", "collocated"] = _f("the training mode (docs/modes.md)")
    groups_dropped: int = _f("groups taken and not trained on (async: too stale)")
    group_ids: list[str] = _f("every group the step took: trained, skipped or dropped")
    drop_reasons: dict[str, int] = _f("reason -> groups dropped for it")
    staleness_hist: dict[str, int] = _f("policy versions between the trainer's weights at the "
                                        "step's start and a trained sample's oldest call -> "
                                        "samples")
    staleness_max: int | None = _f("the largest of them (null when no sample)")
    held_calls: int | None = _f("collocated: calls of the step's groups the gateway held "
                                "(null without a hold: sync and async modes)")
    total_groups_trained: int = _f("groups trained or skipped by the run so far")
    total_groups_dropped: int = _f("groups dropped by the run so far")
    checkpoint: str | None = _f("checkpoint written after this step, or null")
    trained_rollouts: list[str] = _f("ids of the rollouts the step's samples came from")
    dropped_rollouts: dict[str, str] = _f("rollout id -> why it gave no sample (\"failed\", "
                                          "\"tampered\", \"group zero_variance\", \"group "
                                          "too_few_rollouts\", \"no tokens\", \"stale: ...\", "
                                          "\"missing image: ...\")")
    trainer_busy_fraction: float = _f("(train_s + push_s) / step_time_s")
    engine_busy_fraction: float | None = _f("share of the gateway's polls during the step "
                                            "with a call in flight (null: no poll)")
    groups_in_flight: int | None = _f("the controller's groups admitted and not done at the "
                                      "step's end (async, collocated; else null)")
    groups_admitted: int | None = _f("the controller's groups admitted so far (async, "
                                     "collocated; else null)")

    @classmethod
    def of_step(cls, s: StepRecord, m: StepMetrics | None, state: TrainState, mode: str,
                checkpoint: str | None, collocated_hold: bool, gauges: GaugeWindow
                ) -> MetricsRow:
        """The row of step `s` (`m`: its optimizer step's metrics, None when it took none;
        `state`: the trainer's after the step; `gauges`: the step's window)."""
        rewards, phases = s.rewards, {"generate_s": 0.0, "train_s": 0.0, "push_s": 0.0,
                                      **s.phases}
        counts = {"rollouts": 0, "rollouts_failed": 0, "rollouts_tampered": 0, "groups": 0,
                  "groups_trained": 0, "groups_zero_variance": 0, "groups_too_few": 0,
                  "groups_dead_lettered": 0, "version_mismatches": 0, **s.counts}
        step_time_s = time.perf_counter() - s.started
        return cls(
            step=s.step, policy_version=state.policy_version,
            behaviour_version=s.behaviour_version,
            run_id=s.run_id, time=time.time(),
            reward_mean=statistics.fmean(rewards) if rewards else None,
            reward_std=statistics.pstdev(rewards) if rewards else None,
            **counts, trained=m is not None,
            samples=m.samples if m else 0, tokens=m.tokens if m else 0,
            input_tokens=m.input_tokens if m else 0,
            loss=m.loss if m else None, kl=m.kl if m else None,
            clip_fraction=m.clip_frac if m else None,
            capped_fraction=m.capped_frac if m else None,
            entropy=m.entropy if m else None, grad_norm=m.grad_norm if m else None,
            **phases, step_time_s=step_time_s,
            tokens_per_s=m.input_tokens / s.phases["train_s"]
            if m and s.phases.get("train_s") else None,
            mode=mode, groups_dropped=len(s.dropped), group_ids=s.group_ids,
            drop_reasons=s.drop_reasons,
            staleness_hist={str(k): s.staleness.count(k) for k in sorted(set(s.staleness))},
            staleness_max=max(s.staleness, default=None),
            held_calls=s.held_calls if collocated_hold else None,
            total_groups_trained=state.groups_trained,
            total_groups_dropped=state.groups_dropped, checkpoint=checkpoint,
            trained_rollouts=s.trained_rollouts, dropped_rollouts=s.dropped_rollouts,
            trainer_busy_fraction=(phases["train_s"] + phases["push_s"]) / step_time_s,
            engine_busy_fraction=gauges.engine_busy_fraction,
            groups_in_flight=gauges.groups_in_flight, groups_admitted=gauges.groups_admitted)

    def line(self) -> dict[str, Any]:
        """The JSON object written to metrics.jsonl (omitted fields left out when None)."""
        return self.model_dump(exclude={k for k in OMITTED if getattr(self, k) is None})


OMITTED = frozenset(k for k, f in MetricsRow.model_fields.items()
                    if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("omitted"))


class Recorder:
    """Rank 0's records of each step: its line (`MetricsRow`) to metrics.jsonl, its rendered
    rollouts to rollouts.jsonl, both to Prometheus (`metrics.py`), the trackers
    (`tracking.py`) and the Trainer status (`control`), and a log line."""

    def __init__(self, cfg: TrainerConfig, rollouts_file: Path, trackers: Trackers | None,
                 control: TrainerControl, gauges: Gauges | None, collocated_hold: bool
                 ) -> None:
        self.cfg, self.rollouts_file, self.trackers = cfg, rollouts_file, trackers
        self.control, self.gauges, self.collocated_hold = control, gauges, collocated_hold

    def record(self, s: StepRecord, m: StepMetrics | None, state: TrainState,
               checkpoint: bool) -> dict[str, Any]:
        """Step `s` done (`checkpoint`: its checkpoint follows); returns its line."""
        w = self.gauges.take() if self.gauges is not None else GaugeWindow()
        row = MetricsRow.of_step(
            s, m, state, self.cfg.mode.kind,
            str(self.cfg.checkpoints_dir / step_dir_name(s.step)) if checkpoint else None,
            self.collocated_hold, w).line()
        if w.groups_in_flight is not None:
            self.control.update(groups_in_flight=w.groups_in_flight,
                                groups_admitted=w.groups_admitted or 0)
        append_jsonl(self.cfg.metrics_file, row)
        for rendered in s.rollouts:
            append_jsonl(self.rollouts_file, rendered)
        prom.observe_step(row)
        if self.trackers is not None:
            self.trackers.log_step(row, s.rollouts)
        self.control.add_step(step_metrics(row, s.staleness))
        log.info("step %d: reward %.3f, loss %s, kl %s, %d tokens, %.1fs%s", s.step,
                 math.nan if row["reward_mean"] is None else row["reward_mean"], row["loss"],
                 row["kl"], row["tokens"], row["step_time_s"],
                 f", {row['rollouts_tampered']} TAMPERED" * bool(row["rollouts_tampered"]),
                 extra={"step": s.step, "version": row["policy_version"]})
        return row


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("NoneType", "None") \
        if not isinstance(annotation, type) else annotation.__name__


def schema_markdown() -> str:
    """The table of the row's fields, as docs/observability.md holds it."""
    lines = ["| field | type | meaning |", "|---|---|---|"]
    for name, f in MetricsRow.model_fields.items():
        doc = (f.description or "") + (" (omitted when not measured)" if name in OMITTED else "")
        cells = [f"`{name}`", f"`{_type_name(f.annotation)}`", doc]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
BEGIN, END = "<!-- BEGIN generated: python -m services.trainer.records --write -->", \
    "<!-- END generated -->"


def generated_doc(text: str) -> str:
    """`text` (docs/observability.md) with its generated part replaced by `schema_markdown`."""
    head, _, rest = text.partition(BEGIN + "\n")
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{schema_markdown()}{END}{tail}"


if __name__ == "__main__":  # prints the table; --write updates docs/observability.md
    if sys.argv[1:] == ["--write"]:
        DOC.write_text(generated_doc(DOC.read_text()))
    else:
        print(schema_markdown(), end="")
