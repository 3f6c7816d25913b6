"""Learning: on the bundled calculator example, with the tiny model on this machine's CPU cores,
the sync trainer raises the mean reward — the mean of the last 4 of 12 steps exceeds that of
the first 2 (the base policy's step and the one after the first update) by at least 0.25 —
within 30 minutes of wall clock, everything real (Redis, store,
gateway, controller, vLLM with gloo weight transfer, the example harness and grader as
processes, `python -m services.trainer`).

Why it is learnable (see examples/calc): the warmed-up policy calls the calculator and then
either copies the tool's result ("The answer is N.", right) or states a number of its own
("I estimate N.", almost always wrong), the first about a third of the time. Both are its own
samples, so a group of n rollouts of one task usually holds both outcomes, and the
group-relative advantage pushes probability onto the copying continuation.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl import procs
from harnessrl.local.stack import Stack, StackConfig

# The suite's per-test timeout (pyproject.toml) is for hangs; this test has its own wall bound.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(30 * 60 + 600)]

# A bound, not a speed target: 20-50 s a step measured on 2 cores (the 32 harness runs of a
# step, each a Python process importing the openai SDK, share the cores with vLLM).
WALL_LIMIT_S = 30 * 60
MARGIN = 0.25
# Tuned on the warmed-up tiny model (base mean reward ~0.36), 2 shared cores, ~27 s per step:
# - lr 2e-3: copying took over within 4 updates (0.44, 0.41, 0.44, 0.56, 0.53), then update 5
#   broke the tool-call format ('{"name": {"expression": {"expression...') and every rollout
#   scored 0 from step 6 on — all groups zero-variance, no signal left to recover with;
# - lr 6e-4 (these flags, also TrainerConfig's defaults): 0.22 0.38 0.44 0.59 0.53 | 0.69 0.81
#   0.72 0.91 0.91 0.81 0.69 0.94 0.91 0.88 0.84 0.91 0.75 0.81 | 0.91 0.84 1.00 0.88 0.91:
#   first 5 0.43, last 5 0.91, gain 0.48, trainer wall 654 s; a second run: first 5 0.41,
#   last 5 0.94, gain 0.53, 558 s; `harnessrl up` with these as defaults: 0.44 -> 0.93, 582 s.
#   Single steps still dip (0.25 at step 7 or 9): mass pushed off "I estimate" first lands on
#   bare guessed numbers ("879."), which the next updates push down too; the 5-step means, not
#   single steps, carry the check.
# 12 steps, not 24: the rise happens within the first 10-12 (the run above: steps 10-14 average
# 0.85 against 0.43 for steps 1-5, gain 0.42; a 14-step run on 2026-11-30: 0.45 -> 0.75, gain 0.30,
# 38 s a step, 35 of them generating); 24 steps took CI 10 more minutes for no more proof.
# Compared: the first 2 steps with the last 4. A run can rise within 3 steps (CI, 2026-12-03:
# 0.19 0.34 0.94 1.0 1.0 0.97 ...), so a first-5 mean that takes in risen steps fails a run
# that learned fastest (first 5 0.69, last 5 0.92, gain 0.23 < 0.25). The first 2 of that run:
# 0.27; of the run above: 0.30, its steps 9-12: 0.83.
FIRST, LAST = 2, 4
TRAINER_FLAGS = {
    "--steps": "12", "--tasks-per-step": "4", "--group-size": "8", "--concurrency": "8",
    "--optimizer.lr": "6e-4", "--seed": "0", "--checkpoint-every": "4",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
          tiny_model_dir: Path) -> Iterator[Stack]:
    cfg = StackConfig(state_dir=tmp_path_factory.mktemp("learn"), redis_url=redis_url,
                      key_prefix="tlearn:", model_dir=tiny_model_dir, served_model_name="tiny",
                      weight_transfer_backend="gloo")
    with Stack(cfg) as s:
        yield s


# The two-rank run repeats the whole learning run (about 10 more minutes on 2 cores): CI runs
# the bounded forms of the sharded trainer instead (tests/test_trainer_sharded.py,
# test_checkpoint_sharded.py, test_trainer_loop.py's two-rank steps). Opt in with
# HARNESSRL_LONG_TESTS=1.
LONG = os.environ.get("HARNESSRL_LONG_TESTS") == "1"


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.skipif(
    not LONG, reason="the two-rank learning run is long: set HARNESSRL_LONG_TESTS=1"))],
    ids=["one-process", "two-ranks"])
def test_reward_rises_on_the_calculator_example(
        stack: Stack, tmp_path: Path, tiny_model_dir: Path,
        record_property: pytest.RecordProperty, nproc: int) -> None:
    """`two-ranks`: the trainer as two processes (`--nproc 2`, FSDP2 over gloo): the same
    learning, from the same flags."""
    started = time.monotonic()
    out = tmp_path / "out"
    name = "learn" if nproc == 1 else f"learn-ws{nproc}"
    argv = procs.python_module(
        "services.trainer", "--bind", "127.0.0.1:0",
        "--store-address", stack.store_address,
        "--controller-address", stack.controller_address,
        "--gateway-admin-address", stack.gateway_admin_address,
        "--model-path", str(tiny_model_dir), "--output-dir", str(out),
        "--served-model-name", "tiny", "--run-name", name, "--stream", name,
        "--nproc", str(nproc), *[x for kv in TRAINER_FLAGS.items() for x in kv])
    trainer = procs.ServiceProcess("trainer", argv, tmp_path).start()
    try:
        trainer.proc.wait(WALL_LIMIT_S)
    finally:
        if trainer.alive:
            trainer.stop()
    assert trainer.proc.returncode == 0, trainer.log_tail(80)
    wall = time.monotonic() - started

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [round(r["reward_mean"], 3) for r in rows]
    first, last = statistics.fmean(curve[:FIRST]), statistics.fmean(curve[-LAST:])
    summary = {"curve": curve, f"first{FIRST}": round(first, 3), f"last{LAST}": round(last, 3),
               "gain": round(last - first, 3), "wall_s": round(wall, 1),
               "step_s_mean": round(statistics.fmean(r["step_time_s"] for r in rows), 1),
               "kl": [round(r["kl"], 4) if r["kl"] is not None else None for r in rows],
               "policy_version": rows[-1]["policy_version"], "flags": TRAINER_FLAGS,
               "nproc": nproc}
    print("LEARNING " + json.dumps(summary))
    record_property("learning", json.dumps(summary))
    assert len(rows) == int(TRAINER_FLAGS["--steps"])
    assert wall <= WALL_LIMIT_S, summary
    assert last - first >= MARGIN, summary
