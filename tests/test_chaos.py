"""Chaos on the real stack, bounded for CI: three training steps of the example (Redis with AOF,
vLLM, store, gateway, controller, trainer) while the store, gateway, controller, Redis and the
trainer are each killed with kill -9 once, at seeded random points, and restarted by the
supervisor. Every rollout must be trained exactly once or dropped with a recorded reason.
`bench/chaos.py` runs the long form (more steps, the engine killed too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.model import build_tiny_model
from harnessrl.testing.chaos import run_chaos


@pytest.mark.vllm
@pytest.mark.slow
def test_kill_each_service_during_training_nothing_lost_nothing_twice(tmp_path: Path) -> None:
    # the accounting, not learning, is under test: an un-warmed tiny model (built in seconds),
    # and every group trained even when its rewards are equal, so trained rollouts are many
    model = build_tiny_model(tmp_path / "model", warmup_steps=0)
    res = run_chaos(tmp_path, model, seed=11, steps=3, gap_s=(2.0, 6.0), timeout_s=600,
                    trainer_flags=("--no-advantage.filter-zero-variance",))
    print("chaos accounting:", json.dumps(res.line()))
    for e in res.events:
        print("  supervisor:", e)
    assert res.trainer_exit == 0, res.events
    assert res.steps == 3
    assert [k.service for k in res.kills] == ["store", "gateway", "controller", "redis",
                                              "trainer"][:len(res.kills)]
    assert len(res.kills) >= 3, "training ended before most kills"
    assert all(k.recovery_s is not None for k in res.kills), res.line()
    assert res.rollouts_in >= 3 * 2 * 4
    assert res.trained_twice == 0
    assert res.lost == 0, res.lost_ids
    assert res.trained + sum(res.dropped.values()) == res.rollouts_in
    assert res.trained > 0
