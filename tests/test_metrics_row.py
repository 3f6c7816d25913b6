"""The metrics.jsonl row's schema is written once, as `records.MetricsRow`: the table in
docs/observability.md is generated from it and must match it, and a step's line has exactly the model's fields, in
its order (the phase timings of collocated mode only when measured). Fast: no services."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from harnessrl.v1 import common_pb2 as c
from services.trainer.checkpoint import TrainState
from services.trainer.gauges import GaugeWindow
from services.trainer.records import DOC, OMITTED, MetricsRow, StepRecord, generated_doc
from services.trainer.step import StepMetrics


def test_the_doc_is_generated_from_the_model() -> None:
    text = DOC.read_text()
    assert generated_doc(text) == text, (
        "docs/observability.md's table differs from records.MetricsRow: run "
        "`python -m services.trainer.records --write`")
    for name in MetricsRow.model_fields:
        assert f"| `{name}` |" in text


def record() -> StepRecord:
    s = StepRecord(step=3, behaviour_version=2, run_id="r-step000003")
    s.counts.update(rollouts=8, rollouts_failed=1, groups=2, groups_trained=1)
    s.timed("generate_s", s.started)
    s.timed("train_s", s.started)
    s.rewards, s.staleness = [0.0, 1.0, 1.0], [0, 0, 1]
    s.dropped, s.drop_reasons = [c.Group(group_id="g9")], {"stale": 1}
    return s


def metrics() -> StepMetrics:
    return StepMetrics(loss=0.5, kl=0.01, clip_frac=0.1, capped_frac=0.0, entropy=2.0,
                       tokens=40, input_tokens=100, samples=3, micro_batches=1, grad_norm=1.5,
                       step_time_s=0.2)


def test_a_line_has_the_model_fields_in_order_and_is_json() -> None:
    state = TrainState(step=3, policy_version=3, groups_trained=5, groups_dropped=1)
    line = MetricsRow.of_step(record(), metrics(), state, "async", None, False,
                              GaugeWindow()).line()
    assert list(line) == [k for k in MetricsRow.model_fields if k not in OMITTED]
    assert json.loads(json.dumps(line)) == line
    assert line["reward_mean"] == pytest.approx(2 / 3) and line["staleness_max"] == 1
    assert line["staleness_hist"] == {"0": 2, "1": 1} and line["groups_dropped"] == 1
    assert line["version_mismatches"] == 0 and line["push_s"] == 0.0
    assert line["held_calls"] is None and line["total_groups_trained"] == 5

    s = record()
    s.timed("hold_s", s.started)
    untrained = MetricsRow.of_step(s, None, state, "collocated", "ckpt", True,
                                   GaugeWindow()).line()
    assert list(untrained) == [k for k in MetricsRow.model_fields
                               if k not in OMITTED or k == "hold_s"]
    assert untrained["loss"] is None and untrained["tokens_per_s"] is None
    assert untrained["held_calls"] == 0 and untrained["checkpoint"] == "ckpt"


def test_an_undeclared_field_is_refused() -> None:
    s = record()
    s.timed("nap_s", s.started)
    with pytest.raises(ValidationError):
        MetricsRow.of_step(s, None, TrainState(), "sync", None, False, GaugeWindow())
