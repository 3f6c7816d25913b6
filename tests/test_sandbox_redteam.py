"""The red-team harness (`harnessrl.testing.redteam_harness`) under the stack `harnessrl up`
starts (real Redis with its password, store, gateway, controller; a stub engine answers as
vLLM would), once sandboxed and once with the sandbox switched off (`sandbox.disabled`).

Sandboxed, every probe is refused or contained, its own gateway key still works, the reward is
the grader's, and nothing is written outside its work folder. Unsandboxed, the same probes
succeed: the tests can fail, and they show what the sandbox stops.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harnessrl.clients import ControllerClient, StoreClient
from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb

from conftest import StubEngineService

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "harnessrl" / "testing" / "redteam_harness.py"
PROBES = ("proc", "read_secret", "read_task_file", "read_other_attempts", "write_other_attempt",
          "mint_key", "port_scan", "fork_bomb", "memory_hog", "forge_records",
          "connect_store", "connect_gateway_admin", "connect_controller", "connect_engine",
          "connect_redis")
REFUSED = {"refused", "contained"}


class World:
    def __init__(self, tmp: Path) -> None:
        from harnessrl.local.stack import Stack, StackConfig

        self.tmp = tmp
        self.stub = StubEngineService(tmp / "stub")
        self.stack = Stack(StackConfig(state_dir=tmp / "state", external_engines=(
            self.stub.base_url,), weight_transfer_backend=None)).start()
        self.tasks = tmp / "tasks.jsonl"
        self.tasks.write_text(json.dumps({"id": "t", "answer": "the hidden answer"}) + "\n")
        redis_host = self.stack.redis_url.rsplit("@", 1)[-1].split("/")[0].split("//")[-1]
        self.targets = {
            "secret_file": str(self.stack.secret_file),
            "more_secrets": [str(self.stack.state / "redis" / "password"),
                             str(self.stack.state / "stack.json"),
                             str(self.stack.tls / "controller" / "tls.key")],
            "tls": str(self.stack.tls),
            "workdir_root": str(self.stack.state / "rollouts"),
            "tasks_file": str(self.tasks), "repo": str(REPO),
            "redis": redis_host, "gateway_port": int(self.stack.gateway_url.split(":")[2]
                                                     .split("/")[0]),
            "tcp": {"store": self.stack.store_address,
                    "gateway_admin": self.stack.gateway_admin_address,
                    "controller": self.stack.controller_address,
                    "engine": self.stub.base_url.split("//")[1], "redis": redis_host},
            "bomb": 200, "hog_mb": 600}

    def run(self, name: str, sandbox: c.SandboxSpec) -> tuple[c.Run, list[c.Rollout]]:
        spec = c.RunSpec(
            name=name, tasks_file=str(self.tasks), group_size=2, concurrency=2,
            harness_command=[sys.executable, str(HARNESS)],
            grader_command=["false"], reward_source=c.REWARD_SOURCE_GRADER_EXIT_CODE,
            timeout_s=120, model="tiny", stream="-",
            env={"REDTEAM_TARGETS": json.dumps(self.targets)})
        spec.sandbox.CopyFrom(sandbox)
        ctl = ControllerClient.connect(self.stack.controller_address)
        run = ctl.create_run(spec, run_id=name)
        for ev in ctl.stub.WatchRun(cpb.WatchRunRequest(run_id=run.run_id), timeout=300):
            if ev.kind == cpb.RunEvent.KIND_RUN_DONE:
                run = ev.run
                break
        ctl.close()
        store = StoreClient.connect(self.stack.store_address)
        rollouts = list(store.list_rollouts(run.run_id).rollouts)
        store.close()
        return run, rollouts

    def close(self) -> None:
        self.stack.stop()
        self.stub.proc.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("redteam"))
    yield w
    w.close()


def _results(ro: c.Rollout) -> dict[str, Any]:
    work = Path(ro.attempts[-1].workdir) / "work"
    return json.loads((work / "redteam.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def sandboxed(world: World) -> tuple[c.Run, list[c.Rollout]]:
    # the folder that holds the stack's state, the task file and the stub engine readable as a
    # whole: what the sandbox hides inside it must stay hidden
    return world.run("sandboxed", c.SandboxSpec(memory_mb=256, max_processes=64,
                                                read_only_paths=[str(world.tmp)]))


@pytest.fixture(scope="module")
def unsandboxed(world: World, sandboxed: Any) -> tuple[c.Run, list[c.Rollout]]:
    run = world.run("unsandboxed", c.SandboxSpec(disabled=True))
    time.sleep(11)  # the processes it left behind (forge_records) end
    return run


@pytest.mark.parametrize("probe", PROBES)
def test_each_probe_is_refused_in_the_sandbox(sandboxed: Any, probe: str) -> None:
    _, rollouts = sandboxed
    for ro in rollouts:
        result = _results(ro)[probe]
        assert result["outcome"] in REFUSED, (ro.rollout_id, probe, result)


@pytest.mark.parametrize("probe", PROBES)
def test_each_probe_succeeds_without_the_sandbox(unsandboxed: Any, probe: str) -> None:
    _, rollouts = unsandboxed
    assert any(_results(ro)[probe]["outcome"] == "succeeded" for ro in rollouts), \
        [_results(ro)[probe] for ro in rollouts]


def test_own_gateway_key_works_in_the_sandbox(sandboxed: Any) -> None:
    _, rollouts = sandboxed
    for ro in rollouts:
        assert _results(ro)["own_key"]["outcome"] == "ok", _results(ro)["own_key"]


def test_redis_refuses_a_client_without_its_password_even_unsandboxed(unsandboxed: Any) -> None:
    _, rollouts = unsandboxed
    for ro in rollouts:
        assert _results(ro)["redis"]["outcome"] == "refused", _results(ro)["redis"]


def test_the_reward_is_the_graders_sandboxed_and_forged_without(sandboxed: Any,
                                                                 unsandboxed: Any) -> None:
    for ro in sandboxed[1]:
        assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED and ro.has_reward, ro
        assert ro.reward == 0.0, ro  # the grader (`false`) gave 0
    # without the sandbox the harness finished its own attempt through the store first: not
    # with a connection of its own (mTLS refuses it), but with the controller's key, which the
    # stack's folder holds where an unsandboxed process of the same user reads it
    assert any(ro.has_reward and ro.reward == 1.0 for ro in unsandboxed[1]), unsandboxed[1]
    for ro in unsandboxed[1]:
        detail = _results(ro)["connect_store"]["detail"]
        assert "without an identity: UNAVAILABLE; as the controller" in detail, detail


def test_nothing_is_written_outside_the_attempts_own_work_folder(world: World, sandboxed: Any,
                                                                 unsandboxed: Any) -> None:
    """Read from outside: the sandboxed run's sibling folders hold no planted file, its
    records no forged exit file or reward line; the unsandboxed run's do (the checks can
    fail)."""
    def planted(run: Any) -> tuple[list[Path], list[Path], list[Path]]:
        rollouts = run[1]
        root = Path(rollouts[0].attempts[-1].workdir).parent.parent
        plants = list(root.glob("*/attempt-*/work/planted-by-*"))
        forged = list(root.glob("*/attempt-*/.forged.exit.json"))
        rewards = [p for p in root.glob("*/attempt-*/grader.stdout.log")
                   if '"reward"' in p.read_text()]
        return plants, forged, rewards
    assert planted(sandboxed) == ([], [], [])
    plants, forged, rewards = planted(unsandboxed)
    assert plants and forged and rewards
