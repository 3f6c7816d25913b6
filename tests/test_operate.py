"""`harnessrl up --harness ... --detach` with a harness written here (not the example), then the
verbs a user runs against it: status, runs, rollouts, show, logs, down. The supervisor is
checked on the detached stack too: a controller killed with kill -9 comes back on its port and
the event shows in `status`. Uses the session vLLM (rollouts only: nothing is pushed into it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harnessrl import identity, procs
from harnessrl.clients import StoreClient
from harnessrl.local.operate import pid_alive
from harnessrl.rpc import health_check
from harnessrl.v1 import common_pb2 as c

REPO = Path(__file__).resolve().parent.parent

HARNESS = textwrap.dedent('''
    import json, os, sys
    from openai import OpenAI
    task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
    client = OpenAI()
    r = client.chat.completions.create(
        model=os.environ["HARNESSRL_MODEL"], max_tokens=8, temperature=1.0,
        messages=[{"role": "user", "content": task["say"]}])
    print("MYHARNESS-OUT task", task["id"], "answered", len(r.choices[0].message.content or ""))
    print("MYHARNESS-ERR a line on stderr", file=sys.stderr)
    open("answer.txt", "w").write(r.choices[0].message.content or "")
''')
GRADER = 'import json; print(json.dumps({"reward": 0.25}))\n'


# As a user runs it: no identity in the environment; `up` makes <state>/tls and every verb
# calls as its operator on its own.
USER_ENV = {k: v for k, v in os.environ.items()
            if k not in (identity.TLS_DIR_ENV, procs.TLS_ROOT_ENV)}


def cli(state: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**USER_ENV, "COLUMNS": "250", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "harnessrl.local.cli", *args, "--state-dir",
                           str(state)], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=state.parent, check=False)


@pytest.mark.vllm
def test_detached_stack_with_own_harness_status_rollouts_show_down(
        tmp_path: Path, redis_url: str, key_prefix: str, vllm_engine, tiny_model_dir: Path
) -> None:
    (tmp_path / "myharness.py").write_text(HARNESS)
    (tmp_path / "mygrader.py").write_text(GRADER)
    (tmp_path / "tasks.jsonl").write_text(
        '{"id": "greet", "say": "Hello there, count to three"}\n'
        '{"id": "bye", "say": "Goodbye and good luck"}\n')
    state = tmp_path / "state"

    # no stack yet: every verb says so and how to start one
    r = cli(state, "status")
    assert r.returncode == 1
    assert f"no stack running in {state}; start one with harnessrl up --detach" in \
        " ".join(r.stdout.split())

    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "harnessrl.local.cli", "up", "--detach", "--rollouts-only",
         "--harness", f"{sys.executable} {tmp_path / 'myharness.py'}",
         "--grader", f"{sys.executable} {tmp_path / 'mygrader.py'}",
         "--tasks", str(tmp_path / "tasks.jsonl"), "--group-size", "2", "--concurrency", "4",
         "--engine-url", vllm_engine.base_url, "--model-dir", str(tiny_model_dir),
         "--model-name", vllm_engine.model_name, "--redis-url", redis_url,
         "--key-prefix", key_prefix, "--state-dir", str(state)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
        env={**USER_ENV, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stack running" in r.stdout
    st = json.loads((state / "stack.json").read_text())
    sup = int(st["supervisor_pid"])
    try:
        (run_id,) = st["runs"]
        operator = identity.Identity.from_folder(state / "tls" / "operator")
        store = StoreClient.connect(st["store"], ident=operator)
        deadline = time.monotonic() + 120
        while store.get_run(run_id).status == c.RUN_STATUS_RUNNING:
            assert time.monotonic() < deadline, "run did not finish"
            time.sleep(0.5)
        run = store.get_run(run_id)
        assert run.status == c.RUN_STATUS_SUCCEEDED, run
        rollouts = store.list_rollouts(run_id).rollouts
        assert len(rollouts) == 4
        print(f"up --detach to a finished run: {time.monotonic() - t0:.1f}s")

        r = cli(state, "status")
        assert r.returncode == 0, r.stdout + r.stderr
        for word in ("store", "gateway", "controller", "engine0", "serving", run_id,
                     "SUCCEEDED", vllm_engine.base_url, "policy version"):
            assert word in r.stdout, (word, r.stdout)

        r = cli(state, "runs")
        assert run_id in r.stdout and "SUCCEEDED" in r.stdout

        r = cli(state, "rollouts", run_id)
        assert r.returncode == 0, r.stdout + r.stderr
        for ro in rollouts:
            assert ro.rollout_id in r.stdout
        assert r.stdout.count("0.250") == 4 and "1/1" in r.stdout
        assert "greet" in r.stdout and "bye" in r.stdout

        ro = next(x for x in rollouts if x.task_id == "greet")
        r = cli(state, "show", ro.rollout_id)
        assert r.returncode == 0, r.stdout + r.stderr
        out = r.stdout
        full = store.get_rollout(ro.rollout_id, include_calls=True)
        call = full.calls[0]
        assert (f"call 0: chat.completions, policy version 0, engine engine0, "
                f"{len(call.prompt_token_ids)} prompt + {len(call.completion_token_ids)} "
                "completion tokens") in out
        assert "Hello there, count to three" in out  # the prompt, decoded from its tokens
        assert "MYHARNESS-OUT task greet answered" in out  # harness stdout
        assert "MYHARNESS-ERR a line on stderr" in out  # harness stderr
        assert '{"reward": 0.25}' in out  # grader stdout

        r = cli(state, "logs", "controller", "-n", "5")
        assert r.returncode == 0 and r.stdout.strip()

        # the supervisor: kill -9 the controller; it comes back on the same address
        old = int(st["procs"]["controller"]["pid"])
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            now = json.loads((state / "stack.json").read_text())["procs"]["controller"]["pid"]
            if now != old and health_check(st["controller"], timeout=1, peer="controller",
                                          ident=operator):
                break
            assert time.monotonic() < deadline, "controller not restarted"
            time.sleep(0.3)
        r = cli(state, "status")
        assert "controller died exit -9" in r.stdout and "controller restarted" in r.stdout, \
            r.stdout
        store.close()
    finally:
        r = cli(state, "down")
    assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr
    assert not pid_alive(sup)
    assert not (state / "stack.json").exists()
    r = cli(state, "rollouts", "x")
    assert r.returncode == 1 and "start one with harnessrl up --detach" in r.stdout


def test_up_serves_a_given_model_dir_as_it_is(tmp_path):
    """--model-dir names the user's model: never rebuilt into (a folder that is not a model is
    refused before anything starts, and left as it was)."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"mine")
    r = cli(tmp_path / "state", "up", "--model-dir", str(folder), "--steps", "1", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "not a model folder" in r.stdout + r.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["weights.bin"]
    assert (folder / "weights.bin").read_bytes() == b"mine"
