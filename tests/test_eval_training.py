"""Evaluation during training: the real sync loop (`train_sync`, in process) against a real
store, gateway and controller (processes, `Stack`) in front of the session's vLLM, the calc
harness and grader as real subprocesses, with an eval before training and after every step.
Only the weight push is a test double (`RecordingSink`: the session's engine has no
weight-transfer backend and is shared, so it keeps the base weights; the steps' calls then
carry version 0, hence `version_check: warn`). What is checked: the eval lines of
metrics.jsonl at steps 0, 1, 2 with their result files, TensorBoard's `eval/*` scalars, the
report's eval curve, and that no eval rollout or group reached training."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from harnessrl.clients import ControllerClient, StoreClient
from harnessrl.local.report import render
from harnessrl.local.stack import Stack, StackConfig
from services.trainer.config import TrainerConfig
from services.trainer.loop import Trainer, train_sync
from services.trainer.rollouts import ControllerRuns
from test_checkpoint import RecordingSink

CALC = Path(__file__).resolve().parents[1] / "examples" / "calc"
STEPS, K = 2, 2


@pytest.mark.vllm
def test_eval_before_training_and_every_step_never_reaches_training(
        tmp_path: Path, redis_url: str, vllm_engine: Any, tiny_model_dir: Path) -> None:
    lines = (CALC / "tasks.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:4]) + "\n")
    (tmp_path / "heldout.jsonl").write_text("\n".join(lines[100:102]) + "\n")
    scfg = StackConfig(state_dir=tmp_path / "stack", redis_url=redis_url,
                       key_prefix=f"ev{uuid.uuid4().hex[:8]}:", model_dir=None,
                       served_model_name=vllm_engine.model_name,
                       external_engines=(vllm_engine.base_url,), weight_transfer_backend=None)
    with Stack(scfg) as stack:
        cfg = TrainerConfig(
            model_path=str(tiny_model_dir), output_dir=str(tmp_path / "out"), steps=STEPS,
            tasks_per_step=2, group_size=2, concurrency=4, run_name="evt", stream="evt",
            tasks_file=str(tmp_path / "train.jsonl"), served_model_name=vllm_engine.model_name,
            harness_command=[sys.executable, str(CALC / "harness.py")],
            grader_command=[sys.executable, str(CALC / "grader.py")], sample_rollouts=0,
            tensorboard=True, advantage={"filter_zero_variance": False},
            mode={"version_check": "warn"},
            eval={"tasks_file": str(tmp_path / "heldout.jsonl"), "every": 1, "k": K,
                  "temperature": 0.7})
        store = StoreClient.connect(stack.store_address)
        controller = ControllerClient.connect(stack.controller_address)
        t = Trainer(cfg, ControllerRuns(controller, 300), store, RecordingSink())
        try:
            train_sync(t)
            lines_ = [json.loads(x) for x in cfg.metrics_file.read_text().splitlines()]
            evals = [r for r in lines_ if r.get("kind") == "eval"]
            steps = [r for r in lines_ if r.get("kind") != "eval"]
            eval_rollouts = {r["run_id"]: store.list_rollouts(r["run_id"]).rollouts
                             for r in evals}
            eval_runs = {r["run_id"]: store.get_run(r["run_id"]) for r in evals}
        finally:
            t.close()
            controller.close()
            store.close()
    # an eval before training (step 0), then one after each step, each after its step's line
    assert [(r.get("kind", "step"), r["step"]) for r in lines_] == [
        ("eval", 0), ("step", 1), ("eval", 1), ("step", 2), ("eval", 2)]
    for r in evals:
        assert r["k"] == K and r["tasks"] == 2 and r["samples"] == 4
        assert 0.0 <= r["pass@1"] <= r["pass@2"] <= 1.0 and 0.0 <= r["avg@2"] <= 1.0
        assert r["policy_version"] == (0 if r["step"] == 0 else
                                       steps[r["step"] - 1]["policy_version"])
        result = json.loads(Path(r["result"]).read_text())
        assert Path(r["result"]).name == f"step-{r['step']:06d}.json"
        assert result["metrics"] == {k: r[k] for k in ("pass@1", "pass@2", "avg@2")}
        assert result["model"]["kind"] == "policy" and result["model"]["step"] == r["step"]
        assert result["sampling"]["temperature"] == 0.7
        run = eval_runs[r["run_id"]]
        assert run.spec.stream == "-" and run.spec.sampling.temperature == 0.7
        assert run.run_id.endswith(f"-eval-step{r['step']:06d}")
    # no eval rollout or group was ever consumed by a step
    eval_ids = {ro.rollout_id for ros in eval_rollouts.values() for ro in ros}
    eval_groups = {ro.group_id for ros in eval_rollouts.values() for ro in ros}
    assert len(eval_ids) == 3 * 2 * K
    for s in steps:
        assert s["groups"] == 2 and s["run_id"] not in eval_rollouts
        assert not eval_groups & set(s["group_ids"])
        assert not eval_ids & (set(s["trained_rollouts"]) | set(s["dropped_rollouts"]))
    # TensorBoard: eval/<metric> at steps 0, 1, 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/pass@1")] == [0, 1, 2]
    assert [e.value for e in acc.Scalars("eval/avg@2")] == pytest.approx(
        [r["avg@2"] for r in evals])
    # the report: the eval curve and table; the step charts are unchanged by the eval lines
    page = render(tmp_path / "out")
    assert 'id="chart-evaluation"' in page and 'id="eval-table"' in page
    assert "step-000002.json" in page
