"""Learning: on the bundled calculator example, with the tiny model on this machine's CPU cores,
the sync trainer makes a better policy — on held-out tasks (`examples/calc/heldout.jsonl`, none
of them in the training file), the final model's mean reward exceeds the base model's, on the
same 32 tasks x 2 samples, by at least MARGIN (0.25, fixed before the runs that report its
pass rate over seeds: bench/learning.py) — within 30 minutes of wall clock, everything real
(Redis, store, gateway, controller, vLLM with gloo weight transfer, the example harness and
grader as processes, `python -m services.trainer`). The two evaluations are the trainer's own
(`--eval.*`, docs/evaluation.md): before the first step (step 0, the base weights) and after
the last, each a controller run on the weights the engine serves. The gain is checked twice:
as the trainer reports it, and recomputed from the eval runs' rollouts in Redis (the grader's
rewards as the controller recorded them, and the policy version the gateway recorded on each
call: the final evaluation ran on the last pushed version, not the base). The training curve
is printed, not checked.

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
from typing import Any

import pytest

from harnessrl import procs
from harnessrl.local.stack import Stack, StackConfig
from harnessrl.model.build import weights_digest

HELDOUT = Path(__file__).resolve().parents[1] / "examples" / "calc" / "heldout.jsonl"

# The suite's per-test timeout (pyproject.toml) is for hangs; this test has its own wall bound.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(30 * 60 + 600)]

# A bound, not a speed target: 20-50 s a step measured on 2 cores (the 32 harness runs of a
# step, each a Python process importing the openai SDK, share the cores with vLLM).
WALL_LIMIT_S = 30 * 60
# The check, and why this bar. Until 2026-12-07 the test compared the training curve's first
# steps with its last (first-5/last-5, loosened to first-2/last-4 after a fast-rising CI run):
# a check on the very rollouts the trainer learns from, with a bar moved after a failure. Now:
# the trainer's held-out evaluation of the base weights (step 0) and of the final ones, the
# same 32 tasks x 2 samples at the harness's own sampling (temperature 1, 64 tokens), against
# a bar fixed before the seeds of bench/learning.py were run:
# - noise: a policy that learned nothing, evaluated twice; each avg@2 is a mean of 64 rewards
#   of a Bernoulli(p), p ~0.30 for the base model (its own evaluation on 2026-12-07: 0.297),
#   so the difference has a standard deviation of sqrt(2 * 0.3 * 0.7 / 64) = 0.081 and 0.25 is
#   3.1 of them above 0 (a run that learned nothing passes by chance about 1 time in 1,000);
# - signal: a run that learned ends at 0.85-0.9 held out (the first run of this form, seed 0,
#   12 steps: 0.297 -> 0.891, gain 0.594), so 0.25 is well under what learning gives;
# - the planted fault (a trainer that learns nothing, `bench/learning.py --lr 1e-12`) and the
#   pass rate over seeds: docs/benchmarks.md, "Learning".
MARGIN = 0.25
# The collapse of issue 44 (CI: curve 0.031 0.469 0.406 0.406 0.75 0.719 ..., last 4 mean
# 0.227). Not the pool modes' lost end of the answer (docs/modes.md): in the runs of
# 2026-12-07 no reply ran to max_tokens (finish_reason "length" at no step; ~28.5 completion
# tokens per sample at every step). It is the dip recorded below ("bare guessed numbers"),
# whole: seed 0, curve 0.281 0.594 0.625 0.5 0.562 | 0.0 0.125 | 0.844 0.875 0.75 0.812 0.812:
# after update 5 every final reply of step 6 was a bare number ("847.", "170."; copies 0 of
# 32, "I estimate" 0 of 32), all 4 groups zero-variance, so step 6 trained nothing (the
# policy version stayed); step 7 drew 3 copies in 32 by chance, and that update pushed copying
# back up (0.84 at step 8). A run whose last steps fall in such a dip, or stay in it because
# no group holds a copy, ends low: the CI run's last 4 look like that, but its rollouts were
# not kept, so that is a reading, not a proof. Its first step, 0.031 (1 of 32, the base
# policy's rollouts), is far under this machine's base (0.281 at step 1, 0.297 held out; 1 of
# 32 is ~4 standard errors under 0.3): that machine's tiny model, built there, likely differs
# (the build is seeded, but 800 warm-up steps on another CPU need not give the same weights,
# and recipe.json's digest is of the recipe, not of the weights). The held-out check fails a
# run whose final model sits in such a dip too: bench/learning.py reports how often.
# History of the flags (curve figures: the training rollouts' mean reward per step).
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
# 10 steps (12 until the held-out check, whose two evaluations cost about 2 steps each; the
# rise happens within the first 8-10), not 24: the run above: steps 10-14 average 0.85 against
# 0.43 for steps 1-5, gain 0.42; a 14-step run on 2026-11-30: 0.45 -> 0.75, gain 0.30, 38 s a
# step, 35 of them generating; 24 steps took CI 10 more minutes for no more proof.
# The curve check this replaced compared the first 2 steps with the last 4 (first 5 / last 5
# before): a run can rise within 3 steps (CI, 2026-12-03: 0.19 0.34 0.94 1.0 1.0 0.97 ...), so
# a first-5 mean that takes in risen steps failed a run that learned fastest (first 5 0.69,
# last 5 0.92, gain 0.23 < 0.25).
TRAINER_FLAGS = {
    "--steps": "10", "--tasks-per-step": "4", "--group-size": "8", "--concurrency": "8",
    "--optimizer.lr": "6e-4", "--seed": "0", "--checkpoint-every": "4",
    "--eval.tasks-file": str(HELDOUT), "--eval.limit": "32", "--eval.k": "2",
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
    check_learned(stack, trainer, started, tmp_path / name, record_property, {"nproc": nproc},
                  versions=True)


# LoRA (docs/lora.md): rank 8, alpha 16, the adapter alone trained, pushed as a PEFT folder per
# version and loaded at runtime; base traffic through the zero adapter. The same flags as full
# fine-tuning but the learning rate: an adapter's update is a low-rank product scaled by
# alpha / rank, so it needs a larger one (Thinking Machines' "LoRA Without Regret": about 10x).
# 5x: 10x (6e-3) broke the tool-call format in two runs at once (docs/lora.md, "Learning").
# `harnessrl up --lora-rank 8` trains with the same (harnessrl.local.train_job.UP_LR).
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
            check_learned(lora_stack, t, started, tmp_path / n, record_property,
                          {"runs": runs, "run": n}, versions=False)
    finally:
        for t, _ in trainers:
            if t.alive:
                t.stop()


def store_evidence(stack: Stack, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out figures recomputed from what the trainer cannot write alone: each eval
    run's rollouts as the store keeps them in Redis (read with redis-py, not through the store
    service or the trainer), their rewards the grader's, recorded by the controller (a failed
    sample counts 0, as avg@k does), and the policy version the gateway recorded on each of
    their calls (the version the engine served them at)."""
    from harnessrl.testing import chaos_accounting as ca

    evals = [r for r in lines if r.get("kind") == "eval"]
    out: dict[str, Any] = {"store_heldout": {}, "store_samples": {}, "store_versions": {}}
    for row in evals:
        run_id = row["run_id"]
        view = ca.read_redis(stack.redis_url, stack.cfg.key_prefix,
                             run_id.rsplit("-step", 1)[0], set())
        ros = [ro for ro in view.rollouts.values() if ro.run_id == run_id]
        rewards = [ro.reward if ro.status == ca.SUCCEEDED else 0.0 for ro in ros]
        step = row["step"]
        out["store_samples"][step] = len(ros)
        out["store_heldout"][step] = round(sum(rewards) / len(ros), 4) if ros else None
        out["store_versions"][step] = sorted({v for ro in ros if ro.status == ca.SUCCEEDED
                                              for v in view.versions[ro.rollout_id]})
    return out


def check_store_evidence(summary: dict[str, Any], lines: list[dict[str, Any]],
                         versions: bool) -> None:
    """The trainer's held-out figures are the store's, and (`versions`: full fine-tuning) the
    base evaluation ran on the first step's behaviour version, the final one on the last
    step's pushed version, which differ: the engine served trained weights."""
    rows = [r for r in lines if r.get("kind") != "eval"]
    k = int(TRAINER_FLAGS["--eval.k"])
    for r in (r for r in lines if r.get("kind") == "eval"):
        step = r["step"]
        assert summary["store_samples"][step] == r["samples"] == r["tasks"] * k, summary
        assert abs(summary["store_heldout"][step] - r[f"avg@{k}"]) <= 1e-4, summary
    base, final = summary["store_heldout"].get(0), summary["store_heldout"].get(len(rows))
    assert base is not None and final is not None and final - base >= MARGIN, summary
    if versions:
        assert summary["store_versions"][0] == [rows[0]["behaviour_version"]], summary
        assert summary["store_versions"][len(rows)] == [rows[-1]["policy_version"]], summary
        assert rows[-1]["policy_version"] != rows[0]["behaviour_version"], summary


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


def check_learned(stack: Stack, trainer: tuple[procs.ServiceProcess, dict[str, str]],
                  started: float, tmp: Path, record_property: pytest.RecordProperty,
                  extra: dict[str, object], versions: bool) -> None:
    """Waits for the trainer (within the wall bound, from `started`) and checks the held-out
    gain, as the trainer reports it and as the store holds it (`check_store_evidence`)."""
    trainer, flags = trainer
    try:
        trainer.proc.wait(max(1.0, WALL_LIMIT_S - (time.monotonic() - started)))
    finally:
        if trainer.alive:
            trainer.stop()
    assert trainer.proc.returncode == 0, trainer.log_tail(80)
    wall = time.monotonic() - started

    lines = [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if r.get("kind") != "eval"]
    summary = {**learning_summary(lines), "wall_s": round(wall, 1), "flags": flags, **extra,
               # which weights: the CI run of 12-0x whose base scored 0.031 likely had others
               "model_weights": weights_digest(stack.cfg.model_dir)}
    try:  # the summary is printed and recorded whatever the store's side gives
        summary.update(store_evidence(stack, lines))
    except Exception as err:  # noqa: BLE001 (reported, then failed below)
        summary["store_error"] = repr(err)
    print("LEARNING " + json.dumps(summary))
    record_property("learning", json.dumps(summary))
    assert "store_error" not in summary, summary
    assert len(rows) == int(TRAINER_FLAGS["--steps"])
    assert wall <= WALL_LIMIT_S, summary
    assert learned(summary), summary
    check_store_evidence(summary, lines, versions)


def learning_summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """What a run's metrics.jsonl shows: the training curve (reported, not checked) and the
    held-out evaluations of the base model (step 0) and the final one."""
    rows = [r for r in lines if r.get("kind") != "eval"]
    evals = {r["step"]: r for r in lines if r.get("kind") == "eval"}
    k = int(TRAINER_FLAGS["--eval.k"])
    base, final = evals.get(0), evals.get(len(rows)) if rows else None
    held = {s: round(r[f"avg@{k}"], 4) for s, r in sorted(evals.items())}
    return {
        "curve": [round(r["reward_mean"], 3) for r in rows],
        "heldout": held,
        "heldout_base": held.get(0), "heldout_final": held.get(len(rows)) if final else None,
        "heldout_gain": (round(final[f"avg@{k}"] - base[f"avg@{k}"], 4)
                         if base and final else None),
        "heldout_samples": [r["samples"] for r in (base, final) if r],
        "heldout_failed": [r["samples_failed"] for r in (base, final) if r],
        "eval_s": [round(r["eval_s"], 1) for r in (base, final) if r],
        "step_s_mean": (round(statistics.fmean(r["step_time_s"] for r in rows), 1)
                        if rows else None),
        "kl": [round(r["kl"], 4) if r.get("kl") is not None else None for r in rows],
        # completion tokens per trained sample: a policy that stops ending its answers
        # (docs/modes.md, "the end of the answer is lost") runs them to max_tokens
        "tokens_per_sample": [round(r["tokens"] / r["samples"], 1) if r.get("samples") else None
                              for r in rows],
        "policy_version": rows[-1]["policy_version"] if rows else None}


def learned(summary: dict[str, Any]) -> bool:
    """The check: the final model's mean reward on the held-out tasks exceeds the base
    model's, on the same tasks and number of samples, by at least MARGIN."""
    gain = summary.get("heldout_gain")
    return gain is not None and gain >= MARGIN
