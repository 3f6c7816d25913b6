"""examples/node_sdk: a harness in JavaScript on the official `openai` npm package, run as it is
under the controller, in the controller's bubblewrap sandbox, against a real store and gateway
and the stub engine (`harnessrl.testing.stub_engine`: no model, vLLM's fields, a fixed reply).

It shows a non-Python harness keeps working sandboxed: node from the system, the example's
folder (with its `node_modules`) read-only because its argv names it, the gateway as the only
way out. The gateway records the SDK's call with its token ids and the reward is the
example's grader's (`examples/node_sdk/grade.py`).

Needs node and the example's `node_modules` (scripts/setup.sh: `npm ci --omit=dev` in
examples/node_sdk). Without node the test skips, except with CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, TEST_SECRET, GatewayService, StoreService, StubEngineService
from harnessrl import procs
from harnessrl.clients import ControllerClient
from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb

EXAMPLE = REPO / "examples" / "node_sdk"
HARNESS = EXAMPLE / "harness.mjs"
GRADER = EXAMPLE / "grade.py"
# The stub engine's reply to every chat completion without tools, and its token ids.
STUB_TEXT, STUB_IDS = "Hello, world!", [9906, 11, 1917, 0]
# The sandbox's PATH (services/controller/sandbox/bwrap.py BASE_ENV), besides the venv's bin.
SANDBOX_PATH = {Path("/usr/local/bin"), Path("/usr/bin"), Path("/bin")}


def node_command() -> str:
    """`node` as the README's harness command names it when the sandbox's PATH finds it there,
    else its absolute path (the sandbox then shows its folder). Skips without node, except with
    CI=true; fails when the example's packages are not those of its lock."""
    found = shutil.which("node")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true and node is not installed (scripts/setup.sh installs nodejs "
                        "and npm from apt)")
        pytest.skip("node is not installed (apt-get install nodejs npm, then scripts/setup.sh)")
    locked = json.loads((EXAMPLE / "package-lock.json").read_text())[
        "packages"]["node_modules/openai"]["version"]
    installed = EXAMPLE / "node_modules" / "openai" / "package.json"
    have = json.loads(installed.read_text())["version"] if installed.exists() else None
    if have != locked:
        pytest.fail(f"examples/node_sdk/node_modules has openai {have}, the lock {locked}: run "
                    "scripts/setup.sh (npm ci --omit=dev in examples/node_sdk)")
    return "node" if Path(found).parent in SANDBOX_PATH else found


@dataclass
class World:
    node: str  # the harness's argv[0]
    controller: ControllerClient
    controller_log: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[World]:
    """A store, the stub engine, a gateway and a controller with its default sandbox on (the
    sandboxes' doors in the test's folder, not the temp folder's default)."""
    node = node_command()  # skips (or fails) before anything starts
    tmp = tmp_path_factory.mktemp("node-sdk")
    with contextlib.ExitStack() as stack:
        store_svc = StoreService(tmp / "store", redis_url, f"t{uuid.uuid4().hex[:10]}:").start()
        stack.callback(store_svc.stop)
        stub = StubEngineService(tmp / "stub")
        stack.callback(stub.proc.stop)
        gateway = GatewayService(tmp / "gw", store_svc.address, [
            {"name": "engine0", "base_url": stub.base_url, "model": stub.model}])
        stack.callback(gateway.stop)
        ready = tmp / "controller.ready"
        controller = procs.ServiceProcess("controller", procs.python_module(
            "services.controller", "--bind", "127.0.0.1:0", "--store-address",
            store_svc.address, "--gateway-url", gateway.base_url, "--workdir-root",
            str(tmp / "rollouts"), "--sandbox-doors", str(tmp / "doors"), "--ready-file",
            str(ready)), tmp, env={"HARNESSRL_SECRET": TEST_SECRET}, ready_file=ready).start()
        stack.callback(controller.stop)
        ctl = ControllerClient.connect(f"127.0.0.1:{controller.wait_ready()['grpc_port']}")
        stack.callback(ctl.close)
        yield World(node, ctl, controller.log_path)


def _records(attempt: c.Attempt) -> str:
    """The attempt's records (the harness's and grader's output), for a failure message."""
    out = []
    for path in sorted(Path(attempt.workdir).glob("*.log")):
        out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
    return "\n".join(out)


def _grader_reward(work: Path, task: dict[str, str]) -> float:
    """What examples/node_sdk/grade.py says of this work folder, run here, unsandboxed."""
    out = subprocess.run([sys.executable, str(GRADER)], cwd=work, capture_output=True,
                         text=True, timeout=30, env={**os.environ,
                                                     "HARNESSRL_TASK_JSON": json.dumps(task)})
    assert out.returncode == 0, out.stderr
    return float(json.loads(out.stdout.splitlines()[-1])["reward"])


def test_node_openai_sdk_harness_runs_sandboxed_under_the_controller(world: World) -> None:
    tasks = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()[:1]]
    tasks.append({"id": "hello", "question": "Say hello to the world.", "expected": "world"})
    spec = c.RunSpec(
        name="node-sdk", model="tiny", group_size=2, concurrency=4, timeout_s=60,
        max_attempts=1, stream="-", harness_command=[world.node, str(HARNESS)],
        grader_command=[sys.executable, str(GRADER)],
        tasks=[c.Task(data_json=json.dumps(t)) for t in tasks])
    run = world.controller.create_run(spec)
    events = list(world.controller.watch_run(run.run_id, timeout=60))
    assert events[-1].kind == cpb.RunEvent.KIND_RUN_DONE
    rollouts = world.controller.list_rollouts(run.run_id, include_calls=True).rollouts
    assert len(rollouts) == 4
    by_id = {t["id"]: t for t in tasks}
    for ro in rollouts:
        attempt = ro.attempts[-1]
        assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED, (attempt.error, _records(attempt))
        work = Path(attempt.workdir) / "work"
        answer = (work / "answer.txt").read_text()
        received = json.loads((work / "response.json").read_text())
        assert answer == received["content"] == STUB_TEXT
        # the gateway recorded the SDK's one call, as the harness sent it, with its token ids
        [call] = ro.calls
        assert call.api == "chat.completions" and not call.aborted
        assert list(call.completion_token_ids) == STUB_IDS
        assert call.completion_text == answer and call.finish_reason == received["finish_reason"]
        request = json.loads(call.request_json)
        assert (request["max_tokens"], request["temperature"]) == (32, 1.0)
        assert request["messages"] == [{"role": "user", "content": by_id[ro.task_id]["question"]}]
        # the reward is the grader's
        assert ro.has_reward
        assert ro.reward == _grader_reward(work, by_id[ro.task_id])
        assert ro.reward == (1.0 if ro.task_id == "hello" else 0.0)
    log = world.controller_log.read_text(errors="replace")
    assert "sandbox: bubblewrap" in log and "UNSANDBOXED" not in log, log[-3000:]
