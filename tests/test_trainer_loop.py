"""The trainer service end to end: `python -m services.trainer` as a process against the real
store, gateway and controller and a real vLLM (gloo weight transfer), on the calculator
example with the tiny model. Also: the trainer's gRPC service (status, checkpoint now, stop)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import GatewayService
from harnessrl import procs
from harnessrl.clients import GatewayAdminClient, StoreClient, TrainerClient
from harnessrl.rpc import health_check
from harnessrl.local.stack import Stack, StackConfig
from harnessrl.v1 import common_pb2 as c, gateway_pb2 as gpb
from harnessrl.weight_transfer import PushConfig, PushError
from services.trainer.weights import EngineWeights


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
          tiny_model_dir: Path) -> Iterator[Stack]:
    """Store, one vLLM engine on the tiny model with the gloo weight-transfer backend, gateway
    and controller, as processes; a key prefix of its own."""
    cfg = StackConfig(state_dir=tmp_path_factory.mktemp("stack"), redis_url=redis_url,
                      key_prefix="tloop:", model_dir=tiny_model_dir, served_model_name="tiny",
                      weight_transfer_backend="gloo", max_model_len=1024)
    with Stack(cfg) as s:
        yield s


def start_trainer(stack: Stack, workdir: Path, model_dir: Path, *flags: str
                  ) -> procs.ServiceProcess:
    ready = workdir / "trainer.ready"
    argv = procs.python_module(
        "services.trainer", "--bind", "127.0.0.1:0", "--ready-file", str(ready),
        "--store-address", stack.store_address,
        "--controller-address", stack.controller_address,
        "--gateway-admin-address", stack.gateway_admin_address,
        "--model-path", str(model_dir), "--output-dir", str(workdir / "out"),
        "--served-model-name", "tiny", *flags)
    return procs.ServiceProcess("trainer", argv, workdir, ready_file=ready).start()


@pytest.mark.vllm
def test_two_steps_push_versions_that_later_calls_carry_and_grpc_stop(
        stack: Stack, tmp_path: Path, tiny_model_dir: Path) -> None:
    trainer = start_trainer(stack, tmp_path, tiny_model_dir, "--steps", "6",
                            "--tasks-per-step", "3", "--group-size", "4", "--concurrency", "4",
                            "--optimizer.lr", "1e-4", "--run-name", "loop", "--stream", "loop",
                            # every step trains (and pushes) even when all of a group's
                            # rewards are equal: what this test checks does not depend on
                            # how often the tiny model gets a task right
                            "--no-advantage.filter-zero-variance")
    port = trainer.wait_ready(60)["grpc_port"]
    address = f"127.0.0.1:{port}"
    assert health_check(address, "harnessrl.v1.Trainer", peer="trainer")
    client = TrainerClient.connect(address, timeout=600)
    metrics_file = tmp_path / "out" / "metrics.jsonl"
    try:
        seen_states = set()
        # CheckpointNow answers after the step in progress (step 1) is checkpointed
        answer: dict[str, object] = {}
        asker = threading.Thread(target=lambda: answer.update(r=client.checkpoint_now()))
        asker.start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            status = client.get_status()
            seen_states.add(status.state)
            if status.step >= 1:
                break
            assert trainer.alive, trainer.log_tail(80)
            time.sleep(0.5)
        assert status.step >= 1, trainer.log_tail(80)
        stopped = client.stop()  # stop after the step in progress
        assert stopped.state != "stopped"
        asker.join(600)
        cp = answer["r"]
        assert cp.step >= 1 and Path(cp.path).name == f"step-{cp.step:06d}"  # type: ignore[attr-defined]
        trainer.proc.wait(600)
    finally:
        client.close()
        if trainer.alive:
            trainer.stop()
    assert trainer.proc.returncode == 0, trainer.log_tail(80)
    assert {"generating"} <= seen_states, seen_states

    rows = [json.loads(x) for x in metrics_file.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert 2 <= len(rows) < 6 and steps == list(range(1, len(rows) + 1)), steps
    assert rows[-1]["checkpoint"] and Path(rows[-1]["checkpoint"]).exists()
    for r in rows:
        assert r["rollouts"] == 12 and 0.0 <= r["reward_mean"] <= 1.0
        assert r["version_mismatches"] == 0
        if r["trained"]:
            assert r["tokens"] > 0 and r["loss"] is not None and r["kl"] >= 0.0
    # the policy version rises with each trained step, and step s's calls carry the version
    # pushed after step s-1 (the trainer checks this too: version_check=fail)
    versions = [0] + [r["policy_version"] for r in rows]
    assert all(r["trained"] for r in rows), rows
    assert versions == list(range(len(rows) + 1)), versions
    store = StoreClient.connect(stack.store_address)
    try:
        for r, before in zip(rows, versions):
            assert r["behaviour_version"] == before
            rollouts = store.list_rollouts(r["run_id"], include_calls=True).rollouts
            calls = [call for ro in rollouts for call in ro.calls]
            assert len(rollouts) == 12 and len(calls) >= 12
            assert {call.policy_version for call in calls} == {before}, r["run_id"]
    finally:
        store.close()
    admin = GatewayAdminClient.connect(stack.gateway_admin_address)
    try:
        (engine,) = admin.list_engines().engines
        assert engine.policy_version == versions[-1]
        assert engine.state == gpb.ENGINE_STATE_READY and not engine.paused
    finally:
        admin.close()


def test_failed_push_marks_the_engine_and_raises_after_the_tries(
        tmp_path: Path, store_service) -> None:  # type: ignore[no-untyped-def]
    """An engine that cannot take the weights (here: nothing listens at its URL) is MARKED in
    the real gateway with the reason, so no traffic reaches it; after `attempts` tries the
    error names it. No vLLM needed: the failure comes before any weight moves."""
    ghost = f"http://127.0.0.1:{procs.free_port()}"
    gateway = GatewayService(tmp_path / "gw", store_service.address,
                             [{"name": "ghost", "base_url": ghost, "model": "tiny"}])
    admin = GatewayAdminClient.connect(gateway.admin_address)
    weights = EngineWeights(admin, PushConfig(http_timeout_s=2, transfer_timeout_s=5),
                            attempts=2, retry_delay_s=0.1)
    try:
        with pytest.raises(PushError) as err:
            weights.push(torch.nn.Linear(2, 2), version=1)
        assert err.value.failed_engines == ["ghost"]
        (engine,) = admin.list_engines().engines
        assert engine.state == gpb.ENGINE_STATE_MARKED and "ghost" in engine.reason
        assert engine.policy_version == 0  # never claims the version it did not get
    finally:
        weights.close()
        admin.close()
        gateway.stop()


def start_k8s_controller(stack: Stack, tmp_path: Path, template: Path, kubeconfig: Path,
                         name: str = "controller-k8s", *extra: str
                         ) -> tuple[procs.ServiceProcess, Any]:
    """A controller whose default job backend is Kubernetes (`template`, the fake API server's
    `kubeconfig`) beside the module's store and gateway, with `extra` flags; returns it and
    the stack a trainer sees through it (`start_trainer`'s first argument)."""
    controller, info = procs.start_service(
        name, "services.controller",
        ["--bind", "127.0.0.1:0", "--store-address", stack.store_address,
         "--gateway-url", stack.gateway_url, "--secret-file", str(stack.secret_file),
         "--workdir-root", str(tmp_path / "rollouts"), "--default-backend", "kubernetes",
         "--k8s.job-template", str(template), "--k8s.kubeconfig", str(kubeconfig), *extra],
        tmp_path)
    stack_like = type("S", (), {"store_address": stack.store_address,
                                "controller_address": f"127.0.0.1:{info['grpc_port']}",
                                "gateway_admin_address": stack.gateway_admin_address})
    return controller, stack_like


@pytest.mark.vllm
def test_short_training_run_with_rollouts_as_kubernetes_jobs(
        stack: Stack, tmp_path: Path, tiny_model_dir: Path, fake_kube) -> None:  # type: ignore[no-untyped-def]
    """A few trainer steps whose rollouts are Jobs on the fake API server: a controller with
    `--default-backend kubernetes` (the example's harness and in-pod grader run as the pods'
    containers), the module's store, gateway and vLLM. Runs last in this module: its pushes
    move the engine's policy version."""
    import yaml

    template = tmp_path / "job-template.yaml"
    template.write_text(yaml.safe_dump({"apiVersion": "batch/v1", "kind": "Job", "spec": {
        "template": {"spec": {"containers": [
            {"name": "harness", "image": "harnessrl/harness:dev"}]}}}}))
    controller, stack_like = start_k8s_controller(stack, tmp_path, template,
                                                  fake_kube.kubeconfig)
    try:
        trainer = start_trainer(stack_like, tmp_path, tiny_model_dir,  # type: ignore[arg-type]
                                "--steps", "2", "--tasks-per-step", "2", "--group-size", "3",
                                "--concurrency", "6", "--run-name", "k8s", "--stream", "k8s",
                                "--no-advantage.filter-zero-variance")
        assert trainer.proc.wait(600) == 0, trainer.log_tail(80)
    finally:
        controller.stop()
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["trained"] for r in rows), rows
    store = StoreClient.connect(stack.store_address)
    try:
        for r in rows:
            assert r["rollouts"] == 6
            rollouts = store.list_rollouts(r["run_id"]).rollouts
            assert all(ro.status == c.ROLLOUT_STATUS_SUCCEEDED for ro in rollouts)
            # each attempt a Job: the fake API server's creations for the run equal them
            creations = [q for q in fake_kube.requests() if q["method"] == "POST" and
                         q["path"].endswith("/jobs") and
                         (q.get("body") or {}).get("metadata", {}).get("labels", {})
                         .get("harnessrl.dev/run") == r["run_id"]]
            assert len(creations) == sum(len(ro.attempts) for ro in rollouts) == 6
            workdir = Path(rollouts[0].attempts[0].workdir)
            assert '"reward"' in (workdir / "grader.stdout.log").read_text()
    finally:
        store.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_two_ranks_train_push_and_answer_as_one_service(
        stack: Stack, tmp_path: Path, tiny_model_dir: Path) -> None:
    """`--nproc 2`: the service starts two ranks (FSDP2 over gloo); rank 0 alone serves gRPC and
    talks to the stack, the engine gets the sharded model's weights each step. ~2-4 min."""
    trainer = start_trainer(stack, tmp_path, tiny_model_dir, "--nproc", "2", "--steps", "2",
                            "--tasks-per-step", "2", "--group-size", "4", "--concurrency", "4",
                            "--optimizer.lr", "1e-4", "--run-name", "loop2", "--stream", "loop2",
                            "--no-advantage.filter-zero-variance")
    ready = trainer.wait_ready(300)
    assert ready["pid"] != trainer.proc.pid  # rank 0 serves; the launcher only watches
    client = TrainerClient.connect(f"127.0.0.1:{ready['grpc_port']}", timeout=60)
    try:
        assert client.get_status().state in {"starting", "pushing", "generating", "training",
                                             "checkpointing", "stopped"}
        trainer.proc.wait(900)
    finally:
        client.close()
        if trainer.alive:
            trainer.stop()
    assert trainer.proc.returncode == 0, trainer.log_tail(80)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["trained"] for r in rows)
    assert [r["behaviour_version"] for r in rows] == [0, 1]
    assert all(r["version_mismatches"] == 0 for r in rows)
    latest = tmp_path / "out" / "checkpoints" / "step-000002"
    assert (latest / "dcp").is_dir() and (latest / "model.safetensors").exists()
    admin = GatewayAdminClient.connect(stack.gateway_admin_address)
    try:
        engines = {e.name: e for e in admin.list_engines().engines}
        assert all(e.policy_version == 2 and e.state == gpb.ENGINE_STATE_READY
                   for e in engines.values())
    finally:
        admin.close()
