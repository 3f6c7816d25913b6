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
    name = "learn" if nproc == 1 else f"learn-ws{nproc}"
    started = time.monotonic()
    trainer = start_trainer(stack, tmp_path / name, tiny_model_dir, name,
                            ["--nproc", str(nproc)])
    check_learned(trainer, started, tmp_path / name, record_property, {"nproc": nproc})


# LoRA (docs/lora.md): rank 8, alpha 16, the adapter alone trained, pushed as a PEFT folder per
# version and loaded at runtime; base traffic through the zero adapter. The same flags as full
# fine-tuning but the learning rate: an adapter's update is a low-rank product scaled by
# alpha / rank, so it needs a larger one (Thinking Machines' "LoRA Without Regret": about 10x).
# 5x: 10x (6e-3) broke the tool-call format in two runs at once (docs/lora.md, "Learning").
# `harnessrl up --lora-rank 8` trains with the same (services.trainer.lora.UP_LR).
LORA_FLAGS = ["--lora.rank", "8", "--lora.alpha", "16", "--optimizer.lr", "3e-3"]


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
               tiny_model_dir: Path) -> Iterator[Stack]:
    from harnessrl.local.engine import LoraEngine
    from services.trainer.lora import LoraConfig, write_zero_adapter

    root = tmp_path_factory.mktemp("learn-lora")
    zero = write_zero_adapter(tiny_model_dir, LoraConfig(rank=8), root / "zero")
    # slots: two sync runs, each with its current version and the one its last calls finish
    # on, plus the zero adapter
    cfg = StackConfig(state_dir=root / "stack", redis_url=redis_url, key_prefix="tlearnl:",
                      model_dir=tiny_model_dir, served_model_name="tiny",
                      weight_transfer_backend=None,
                      lora=LoraEngine(max_rank=16, max_loras=6, zero_adapter=zero))
    with Stack(cfg) as s:
        yield s


@pytest.mark.skipif(not LONG, reason="the LoRA learning runs are long: set "
                    "HARNESSRL_LONG_TESTS=1")
@pytest.mark.parametrize("runs", [1, 2], ids=["one-run", "two-runs-one-engine"])
def test_lora_reward_rises_on_the_calculator_example(
        lora_stack: Stack, tmp_path: Path, tiny_model_dir: Path,
        record_property: pytest.RecordProperty, runs: int) -> None:
    """LoRA learns within the same steps as full fine-tuning, by the same margin; with
    `two-runs-one-engine`, two trainers at once on one engine, each with its own adapter
    (different seeds), and both learn."""
    names = [f"lora{i}-r{runs}" for i in range(runs)]
    started = time.monotonic()
    trainers = [start_trainer(lora_stack, tmp_path / n, tiny_model_dir, n,
                              [*LORA_FLAGS, "--seed", str(i)])
                for i, n in enumerate(names)]
    try:
        for t, n in zip(trainers, names):
            check_learned(t, started, tmp_path / n, record_property,
                          {"runs": runs, "run": n})
    finally:
        for t, _ in trainers:
            if t.alive:
                t.stop()


def start_trainer(stack: Stack, tmp: Path, model: Path, name: str,
                  extra: list[str]) -> tuple[procs.ServiceProcess, dict[str, str]]:
    """The trainer service on TRAINER_FLAGS with `extra` flags on top; (it, its flags)."""
    tmp.mkdir(parents=True, exist_ok=True)
    flags = {**TRAINER_FLAGS, **dict(zip(extra[::2], extra[1::2]))}
    argv = procs.python_module(
        "services.trainer", "--bind", "127.0.0.1:0",
        "--store-address", stack.store_address,
        "--controller-address", stack.controller_address,
        "--gateway-admin-address", stack.gateway_admin_address,
        "--model-path", str(model), "--output-dir", str(tmp / "out"),
        "--served-model-name", "tiny", "--run-name", name, "--stream", name,
        *[x for kv in flags.items() for x in kv])
    return procs.ServiceProcess("trainer", argv, tmp).start(), flags


def check_learned(trainer: tuple[procs.ServiceProcess, dict[str, str]], started: float,
                  tmp: Path, record_property: pytest.RecordProperty,
                  extra: dict[str, object]) -> None:
    """Waits for the trainer (within the wall bound, from `started`) and checks its curve."""
    trainer, flags = trainer
    try:
        trainer.proc.wait(max(1.0, WALL_LIMIT_S - (time.monotonic() - started)))
    finally:
        if trainer.alive:
            trainer.stop()
    assert trainer.proc.returncode == 0, trainer.log_tail(80)
    wall = time.monotonic() - started

    rows = [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    curve = [round(r["reward_mean"], 3) for r in rows]
    first, last = statistics.fmean(curve[:FIRST]), statistics.fmean(curve[-LAST:])
    summary = {"curve": curve, f"first{FIRST}": round(first, 3), f"last{LAST}": round(last, 3),
               "gain": round(last - first, 3), "wall_s": round(wall, 1),
               "step_s_mean": round(statistics.fmean(r["step_time_s"] for r in rows), 1),
               "kl": [round(r["kl"], 4) if r["kl"] is not None else None for r in rows],
               "policy_version": rows[-1]["policy_version"], "flags": flags, **extra}
    print("LEARNING " + json.dumps(summary))
    record_property("learning", json.dumps(summary))
    assert len(rows) == int(TRAINER_FLAGS["--steps"])
    assert wall <= WALL_LIMIT_S, summary
    assert last - first >= MARGIN, summary
