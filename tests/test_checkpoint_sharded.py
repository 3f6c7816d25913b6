"""Distributed checkpoints and one voice, through the real loop (`train_sync`) at world size 2
(FSDP2 over gloo, ranks started by the service's own launcher, `launch.RankGroup`) against the
real store, with the test doubles of tests/test_checkpoint.py (`tests/sharded_rank.py` is one
rank): a stop-and-resume at world size 2 reproduces the uninterrupted run bit for bit, a
world-size-2 checkpoint resumes at world size 1, and a rank killed with kill -9 mid-step ends the
job within a bound, after which the job resumes with nothing trained twice and nothing lost."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from harnessrl.clients import StoreClient
from services.trainer import checkpoint as ckpt
from services.trainer.launch import RankGroup
from services.trainer.loop import train_sync

from test_checkpoint import (  # noqa: F401 - fixtures
    RecordingSink, make_config, pending, small_model, store, trainer, vocab,
)

RANK = Path(__file__).with_name("sharded_rank.py")
KILL_BOUND_S = 45.0


def group(args: dict[str, Any], store_address: str, tmp: Path, small_model: Path,
          vocab: int, nproc: int = 2) -> RankGroup:
    full = {"store": store_address, "tmp": str(tmp), "model": str(small_model),
            "vocab": vocab, **args}
    return RankGroup([sys.executable, str(RANK), json.dumps(full)], nproc, grace_s=10).start()


def run(args: dict[str, Any], *rest: Any) -> dict[str, Any]:
    rc = group(args, *rest).wait(timeout_s=300)
    assert rc == 0, f"ranks failed ({rc}) with {args}"
    return torch.load(args["out"], weights_only=False)


def assert_equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"parameters differ: {different[:5]}"


def test_sharded_resume_is_bit_for_bit_and_resumes_at_world_size_1(
        tmp_path: Path, small_model: Path, store: StoreClient, store_service: Any,
        vocab: int, redis_url: str, key_prefix: str) -> None:
    """Three two-rank runs and two one-process ones: 74 s on 2 quiet cores, ~3 min busy."""
    env = (store_service.address, tmp_path, small_model, vocab)
    ref = run({"name": "ref", "steps": 3, "out": str(tmp_path / "ref.pt")}, *env)
    assert [v for v, _ in ref["pushes"]] == [0, 1, 2, 3]

    first = run({"name": "res", "steps": 3, "stop_at_step": 2,
                 "out": str(tmp_path / "first.pt")}, *env)
    cfg = make_config(tmp_path, "res", small_model, steps=3)
    saved = ckpt.latest_checkpoint(cfg.checkpoints_dir)
    assert first["step"] == 2 and saved is not None and saved.name == "step-000002"
    assert (saved / ckpt.DCP_DIR).is_dir() and (saved / "rng-rank1.pt").exists()
    assert pending(redis_url, key_prefix, cfg.stream) == set()

    second = run({"name": "res", "steps": 3, "out": str(tmp_path / "second.pt")}, *env)
    assert_equal_states(second["state"], ref["state"])  # bit for bit
    prefix = json.loads((tmp_path / "res" / "run.json").read_text())["run_prefix"]
    assert second["launched"] == [f"{prefix}-step000003"]
    assert second["pushes"] == [first["pushes"][-1], ref["pushes"][-1]]
    rows = [json.loads(x) for x in cfg.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]

    latest = ckpt.latest_checkpoint(cfg.checkpoints_dir)
    exported = AutoModelForCausalLM.from_pretrained(latest, dtype=torch.float32)
    assert exported.config.tie_word_embeddings
    assert_equal_states({k: v for k, v in exported.state_dict().items() if k in ref["state"]},
                        {k: ref["state"][k] for k in exported.state_dict() if k in ref["state"]})

    # the world-size-2 checkpoint at world size 1: weights and optimizer state as saved
    t, _ = trainer(cfg, store, RecordingSink(), vocab)
    train_sync(t)  # nothing left to train: loads, pushes, stops
    assert t.state.step == 3
    assert_equal_states({k: v for k, v in t.model.state_dict().items() if k in ref["state"]},
                        {k: ref["state"][k] for k in t.model.state_dict() if k in ref["state"]})
    steps = {float(s["step"]) for s in t.optimizer.state.values()}
    assert steps == {3.0} and len(t.optimizer.state) == len(list(t.model.parameters()))
    more = make_config(tmp_path, "res", small_model, steps=4)
    t4, _ = trainer(more, store, RecordingSink(), vocab)
    train_sync(t4)
    assert t4.state.step == 4 and t4.state.policy_version == 4
    rows = [json.loads(x) for x in more.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["trained"]


@pytest.mark.slow
def test_rank_killed_mid_step_ends_the_job_and_it_resumes_exactly(
        tmp_path: Path, small_model: Path, store: StoreClient, store_service: Any,
        vocab: int, redis_url: str, key_prefix: str) -> None:
    """Three two-rank runs, one killed: ~2 min on 2 idle cores, ~6 min on a busy machine."""
    env = (store_service.address, tmp_path, small_model, vocab)
    ref = run({"name": "ref", "steps": 3, "out": str(tmp_path / "ref.pt")}, *env)

    cfg = make_config(tmp_path, "kill", small_model, steps=3)
    doomed = group({"name": "kill", "steps": 3, "delay_step": 3, "delay_s": 30.0,
                    "out": str(tmp_path / "doomed.pt")}, *env)
    deadline = time.monotonic() + 240
    latest = cfg.checkpoints_dir / ckpt.LATEST
    while not (latest.exists() and latest.read_text().strip() == ckpt.step_dir_name(2)):
        assert time.monotonic() < deadline, "step 2 was never checkpointed"
        assert all(p.poll() is None for p in doomed.procs), "a rank ended early"
        time.sleep(0.2)
    # into step 3: rank 0 is running it (the test double's run waits 30 s before it writes
    # anything: it is not idempotent half-way, the real controller's CreateRun is), rank 1
    # waits for its groups
    time.sleep(2.0)
    os.kill(doomed.procs[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    rc = doomed.wait(timeout_s=KILL_BOUND_S)
    took = time.monotonic() - t0
    assert rc == 128 + signal.SIGKILL and all(p.poll() is not None for p in doomed.procs)
    assert took < KILL_BOUND_S
    assert not (tmp_path / "doomed.pt").exists()
    done = ckpt.read_state(ckpt.latest_checkpoint(cfg.checkpoints_dir)).step
    assert done == 2, f"latest checkpoint after the kill: step {done}"

    again = run({"name": "kill", "steps": 3, "out": str(tmp_path / "again.pt")}, *env)
    assert_equal_states(again["state"], ref["state"])  # trained once: twice would differ
    assert pending(redis_url, key_prefix, cfg.stream) == set()  # nothing left behind
    rows = [json.loads(x) for x in cfg.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.slow
def test_world_size_1_checkpoint_resumes_at_world_size_2(
        tmp_path: Path, small_model: Path, store: StoreClient, store_service: Any,
        vocab: int) -> None:
    """Two steps in one process, the third at world size 2: the result matches three steps in
    one process within the sharded step's tolerance (a lost optimizer state would not). ~1-2
    min on 2 cores."""
    ref, _ = trainer(make_config(tmp_path, "ref1", small_model, steps=3), store,
                     RecordingSink(), vocab)
    train_sync(ref)
    first, _ = trainer(make_config(tmp_path, "grow", small_model, steps=2), store,
                       RecordingSink(), vocab)
    train_sync(first)
    assert not (ckpt.latest_checkpoint(tmp_path / "grow" / "checkpoints") / ckpt.DCP_DIR).exists()
    out = run({"name": "grow", "steps": 3, "out": str(tmp_path / "grow.pt")},
              store_service.address, tmp_path, small_model, vocab)
    assert out["step"] == 3 and len(out["launched"]) == 1
    mine = ref.model.state_dict()
    for k, v in out["state"].items():
        torch.testing.assert_close(v, mine[k], rtol=0, atol=1e-4, msg=k)
