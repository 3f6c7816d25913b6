"""The calc example's held-out tasks (examples/calc/heldout.jsonl, evaluated by
tests/test_learning.py and bench/learning.py): regenerated exactly by `make_tasks --heldout`,
none of them in the training file, and the learning check's bar on recorded numbers."""

from __future__ import annotations

import json
import random
from pathlib import Path

from examples.calc.make_tasks import heldout_tasks
from harnessrl.model.calc_task import make_task

CALC = Path(__file__).resolve().parents[1] / "examples" / "calc"


def read(name: str) -> list[dict]:
    return [json.loads(x) for x in (CALC / name).read_text().splitlines() if x.strip()]


def test_heldout_file_is_regenerated_and_disjoint_from_training() -> None:
    train, held = read("tasks.jsonl"), read("heldout.jsonl")
    rng = random.Random(7)
    assert train == [make_task(rng, f"calc-{i:03d}") for i in range(128)]
    assert held == heldout_tasks(64, 8, {t["expression"] for t in train})
    assert not {t["expression"] for t in held} & {t["expression"] for t in train}
    assert len({t["expression"] for t in held}) == len(held) == 64
    assert all(0 <= t["answer"] <= 999 for t in held)


def eval_line(step: int, avg: float) -> dict:
    return {"kind": "eval", "step": step, "avg@2": avg, "samples": 64, "samples_failed": 0,
            "eval_s": 77.0}


def step_line(step: int, reward: float) -> dict:
    return {"step": step, "policy_version": step, "reward_mean": reward, "tokens": 900,
            "samples": 32, "step_time_s": 35.0, "kl": 0.0}


def test_the_learning_check_on_recorded_runs() -> None:
    """tests/test_learning.py's check on the numbers of real runs (2026-12-07): a run that
    learned passes; the planted fault (a trainer at lr 1e-12, `bench/learning.py --lr 1e-12
    --steps 2`: it learns nothing) fails; so does a run without its evaluations."""
    from test_learning import learned, learning_summary

    learned_run = [eval_line(0, 0.296875)] + [step_line(i + 1, r) for i, r in enumerate(
        [0.281, 0.594, 0.625, 0.5, 0.562, 0.0, 0.125, 0.844, 0.875, 0.75, 0.812, 0.812])]
    learned_run.append(eval_line(12, 0.890625))
    s = learning_summary(learned_run)
    assert (s["heldout_base"], s["heldout_final"], s["heldout_gain"]) == (0.2969, 0.8906, 0.5938)
    assert learned(s)
    lr0 = [eval_line(0, 0.328125), step_line(1, 0.344), step_line(2, 0.438),
           eval_line(2, 0.296875)]
    assert learning_summary(lr0)["heldout_gain"] == -0.0312
    assert not learned(learning_summary(lr0))
    assert not learned(learning_summary(learned_run[1:-1]))  # no evaluations: no proof


def test_the_store_check_refuses_figures_the_store_does_not_hold() -> None:
    """test_learning's second check (`check_store_evidence`) on the recorded run above, with
    the store's side as it would read: equal figures pass; a trainer reporting more than the
    store's rewards give, one whose final evaluation ran on the base weights, or whose runs
    hold fewer samples than it claims, fail."""
    import pytest

    from test_learning import check_store_evidence

    run = [eval_line(0, 0.296875), *(dict(step_line(i + 1, 0.5), behaviour_version=i)
                                     for i in range(12)), eval_line(12, 0.890625)]
    for r in run:
        r.setdefault("tasks", 32)

    def store(final: float = 0.8906, versions: list[int] | None = None,
              samples: int = 64) -> dict:
        return {"store_heldout": {0: 0.2969, 12: final}, "store_samples": {0: 64, 12: samples},
                "store_versions": {0: [0], 12: versions if versions is not None else [12]}}
    check_store_evidence(store(), run, versions=True)
    # planted: the store's final figure clears the margin but is not the trainer's; the final
    # evaluation on the base version; fewer samples than the trainer claims
    for planted in (store(final=0.85), store(versions=[0]), store(samples=60)):
        with pytest.raises(AssertionError):
            check_store_evidence(planted, run, versions=True)
