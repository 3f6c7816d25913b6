"""The controller against a real store (real Redis, real gRPC servers on port 0), with harnesses
and graders as small Python scripts. No gateway is needed: these harnesses make no model calls
(the harness-reported reward path calls the store's ReportReward directly, as the gateway
would)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

import conftest
from harnessrl import procs
from harnessrl.clients import ControllerClient, StoreClient
from harnessrl.credentials import CredentialSigner
from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
SECRET = "test-secret-0123456789abcdef"
GATEWAY_URL = "http://127.0.0.1:9/v1"  # never called by these harnesses

HARNESS = """
import json, os, subprocess, sys, time
t_start = time.time()
env = {k: v for k, v in os.environ.items() if k.startswith(("HARNESSRL_", "OPENAI_", "EXTRA_"))}
json.dump(env, open("env.json", "w"))
print("harness ran", os.environ["HARNESSRL_ROLLOUT_ID"])
task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
behavior = task.get("behavior", "ok")
attempt = int(os.environ["HARNESSRL_ATTEMPT"])
if behavior == "crash" or (behavior == "crash_once" and attempt == 1):
    print(f"boom on attempt {attempt}", file=sys.stderr)
    sys.exit(3)
if behavior == "hang":
    p = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    open("grandchild.pid.tmp", "w").write(str(p.pid))
    os.replace("grandchild.pid.tmp", "grandchild.pid")
    time.sleep(600)
if behavior == "sleep":
    open("harness.pid.tmp", "w").write(str(os.getpid()))
    os.replace("harness.pid.tmp", "harness.pid")
    time.sleep(float(task["sleep"]))
if behavior == "report":
    sys.path.insert(0, os.environ["EXTRA_REPO"])
    from harnessrl.clients import StoreClient
    from harnessrl.identity import Identity
    # plays the gateway, with its identity (a harness has none of its own)
    StoreClient.connect(os.environ["EXTRA_STORE"],
                        ident=Identity.from_folder(os.environ["EXTRA_GATEWAY_TLS"])).report_reward(
        os.environ["HARNESSRL_ROLLOUT_ID"], attempt, float(task["reward"]))
x = int(task.get("x", 0))
right = int(os.environ["HARNESSRL_INDEX_IN_GROUP"]) % 2 == 0
open("answer.txt", "w").write(str(2 * x if right else 2 * x + 1))
time.sleep(float(task.get("linger", 0)))
open("span.txt", "w").write(f"{t_start} {time.time()}")
"""

EVIDENCE = "must-fail canary tests/test_x.py::test_y passed"
GRADER = f"EVIDENCE = {EVIDENCE!r}\n" + """
import json, os, sys
json.dump({k: v for k, v in os.environ.items() if k.startswith(("HARNESSRL_", "OPENAI_"))},
          open("grader_env.json", "w"))
task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
mode = task.get("grader", "json")
if mode == "garbage":
    print("grading...")
    print("the reward is: high!!")
    sys.exit(0)
if mode == "exit":
    sys.exit(int(task["exit"]))
index = int(os.environ["HARNESSRL_INDEX_IN_GROUP"])
if mode == "tampered" and task.get("tamper_index", 0) == index:  # as a tamper-evident grader
    print(json.dumps({"reward": task.get("claimed", 1.0), "reason": "forged",
                      "tampered": task.get("tampered", True), "evidence": EVIDENCE}))
    sys.exit(0)
answer = int(open("answer.txt").read())
print("checked", answer)
print(json.dumps({"reward": 1.0 if answer == 2 * int(task["x"]) else 0.0, "answer": answer}))
"""


class Services:
    def __init__(self, tmp: Path, redis_url: str, prefix: str, store_retry_s: float = 60,
                 controller_flags: tuple[str, ...] = ()) -> None:
        """`controller_flags`: extra flags (the kubernetes backend's, say)."""
        self.tmp = tmp
        self.controller_flags = controller_flags
        self.store_retry_s = store_retry_s
        self.redis_url = redis_url
        self.prefix = prefix
        self.store_port = procs.free_port()
        self.store_proc: procs.ServiceProcess | None = None
        self.start_store()
        self.start_controller()
        self.store = StoreClient.connect(f"127.0.0.1:{self.store_port}")
        self.harness = tmp / "harness.py"
        self.harness.write_text(textwrap.dedent(HARNESS))
        self.grader = tmp / "grader.py"
        self.grader.write_text(textwrap.dedent(GRADER))

    def start_controller(self) -> None:
        ready = self.tmp / "controller.ready"
        self.controller = procs.ServiceProcess(
            "controller", procs.python_module(
                "services.controller", "--bind", "127.0.0.1:0",
                "--store-address", f"127.0.0.1:{self.store_port}", "--gateway-url", GATEWAY_URL,
                "--workdir-root", str(self.tmp / "rollouts"), "--kill-grace-s", "0.5",
                "--store-retry-s", str(self.store_retry_s), "--ready-file", str(ready),
                # these tests watch the harnesses' pids from outside (a sandbox's are its own);
                # the sandboxed controller: tests/test_sandbox*.py
                "--no-sandbox", "--metrics-bind", "127.0.0.1:0", *self.controller_flags),
            self.tmp, env={"HARNESSRL_SECRET": SECRET}, ready_file=ready).start()
        info = self.controller.wait_ready()
        self.metrics_port = int(info["metrics_port"])
        self.ctl_address = f"127.0.0.1:{info['grpc_port']}"
        self.ctl = ControllerClient.connect(self.ctl_address)

    def start_store(self) -> None:
        ready = self.tmp / "store.ready"
        self.store_proc = procs.ServiceProcess(
            "store", procs.python_module(
                "services.store", "--bind", f"127.0.0.1:{self.store_port}",
                "--redis-url", self.redis_url, "--key-prefix", self.prefix,
                "--ready-file", str(ready)),
            self.tmp, ready_file=ready).start()
        self.store_proc.wait_ready()

    def stop(self) -> None:
        self.ctl.close()
        self.store.close()
        self.controller.stop()
        if self.store_proc is not None:
            self.store_proc.stop()

    def spec(self, tasks: list[dict[str, Any]], **kw: Any) -> c.RunSpec:
        s = c.RunSpec(
            name="test", harness_command=[PY, str(self.harness)],
            grader_command=[PY, str(self.grader)], concurrency=4, timeout_s=30,
            env={"EXTRA_STORE": f"127.0.0.1:{self.store_port}",
                 "EXTRA_GATEWAY_TLS": str(conftest.TEST_PKI / "gateway"),
                 "EXTRA_REPO": str(Path(__file__).resolve().parent.parent)},
            tasks=[c.Task(data_json=json.dumps(t)) for t in tasks])
        for k, v in kw.items():
            if k == "grader_command":
                del s.grader_command[:]
                s.grader_command.extend(v)
            else:
                setattr(s, k, v)
        return s

    def run_to_end(self, spec: c.RunSpec, timeout: float = 60) -> tuple[c.Run, list[Any]]:
        run = self.ctl.create_run(spec)
        events = list(self.ctl.watch_run(run.run_id, timeout=timeout))
        assert events[-1].kind == cpb.RunEvent.KIND_RUN_DONE
        return events[-1].run, events

    def rollouts(self, run_id: str) -> dict[str, c.Rollout]:
        """Rollouts as the store holds them, by task id and index: "task/i"."""
        return {f"{ro.task_id}/{ro.index_in_group}": ro
                for ro in self.store.list_rollouts(run_id).rollouts}


@pytest.fixture(scope="module")
def svc(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    s = Services(tmp_path_factory.mktemp("controller"), redis_url, f"t{uuid.uuid4().hex[:10]}:")
    yield s
    s.stop()


def env_of(ro: c.Rollout, attempt: int = 0, name: str = "env.json") -> dict[str, str]:
    att = ro.attempts[(attempt or ro.attempt) - 1]
    return json.loads((Path(att.workdir) / "work" / name).read_text())


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_run_of_tasks_times_n_completes_with_rewards(svc: Services) -> None:
    tasks = [{"id": f"t{i}", "x": i, "label": f"task {i}", "meta": {"k": [1, 2]}, "linger": 0.2}
             for i in range(3)]
    run, _ = svc.run_to_end(svc.spec(tasks, group_size=4, model="tiny", stream="ctl-test",
                                     concurrency=3))
    assert run.status == c.RUN_STATUS_SUCCEEDED, run
    assert (run.num_rollouts, run.num_succeeded, run.num_failed) == (12, 12, 0)
    assert run.mean_reward == pytest.approx(0.5)
    stored_run = svc.store.get_run(run.run_id)
    assert stored_run.status == c.RUN_STATUS_SUCCEEDED and stored_run.num_succeeded == 12
    assert stored_run.mean_reward == pytest.approx(0.5)
    signer = CredentialSigner(SECRET.encode())
    rollouts = svc.rollouts(run.run_id)
    assert len(rollouts) == 12
    for i in range(3):
        for k in range(4):
            ro = rollouts[f"t{i}/{k}"]
            assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED and ro.has_reward
            assert ro.reward == (1.0 if k % 2 == 0 else 0.0)  # the grader checked the answer
            assert ro.group_id == f"{run.run_id}/t{i}" and ro.group_size == 4
            assert ro.attempt == 1 and len(ro.attempts) == 1
            env = env_of(ro)
            assert env["OPENAI_BASE_URL"] == GATEWAY_URL
            cred = signer.verify(env["OPENAI_API_KEY"])
            assert (cred.rollout_id, cred.attempt) == (ro.rollout_id, 1)
            assert env["HARNESSRL_MODEL"] == "tiny"
            assert env["HARNESSRL_RUN_ID"] == run.run_id
            assert env["HARNESSRL_ROLLOUT_ID"] == ro.rollout_id
            assert env["HARNESSRL_ATTEMPT"] == "1"
            assert env["HARNESSRL_TASK_ID"] == f"t{i}"
            assert json.loads(env["HARNESSRL_TASK_JSON"]) == tasks[i]
            assert env["HARNESSRL_TASK_X"] == str(i)
            assert env["HARNESSRL_TASK_LABEL"] == f"task {i}"
            assert json.loads(env["HARNESSRL_TASK_META"]) == {"k": [1, 2]}
            assert env["EXTRA_STORE"] == f"127.0.0.1:{svc.store_port}"  # spec.env
            assert not any(k.startswith("HARNESSRL_SECRET") for k in env)
            workdir = Path(ro.attempts[0].workdir)
            assert workdir.name == "attempt-1" and workdir.is_relative_to(svc.tmp / "rollouts")
            assert (workdir / "stdout.log").read_text() == f"harness ran {ro.rollout_id}\n"
            genv = env_of(ro, name="grader_env.json")
            assert genv["HARNESSRL_HARNESS_EXIT_CODE"] == "0"
            assert genv["HARNESSRL_HARNESS_STDOUT"] == str(workdir / "stdout.log")
            assert "OPENAI_API_KEY" not in genv and genv["HARNESSRL_TASK_ID"] == f"t{i}"
    workdirs = {ro.attempts[0].workdir for ro in rollouts.values()}
    assert len(workdirs) == 12
    # never more than `concurrency` harnesses at once
    spans = [tuple(map(float, (Path(w) / "work" / "span.txt").read_text().split())) for w in workdirs]
    assert max(sum(1 for s, e in spans if s <= t <= e) for t, _ in spans) <= 3
    # every completed group went to the run's stream, each once
    groups = svc.store.read_groups(stream="ctl-test", max_groups=10, include_calls=False).groups
    assert sorted(g.group_id for g in groups) == [f"{run.run_id}/t{i}" for i in range(3)]
    assert all(len(g.rollouts) == 4 for g in groups)


def test_crash_is_retried_with_a_new_credential(svc: Services) -> None:
    run, _ = svc.run_to_end(svc.spec(
        [{"id": "flaky", "behavior": "crash_once", "x": 1},
         {"id": "broken", "behavior": "crash", "x": 2}], max_attempts=3))
    assert run.status == c.RUN_STATUS_SUCCEEDED  # the run ended; one rollout failed
    assert (run.num_succeeded, run.num_failed) == (1, 1)
    signer = CredentialSigner(SECRET.encode())
    rollouts = svc.rollouts(run.run_id)
    flaky = rollouts["flaky/0"]
    assert flaky.status == c.ROLLOUT_STATUS_SUCCEEDED and flaky.reward == 1.0
    assert [a.status for a in flaky.attempts] == [c.ROLLOUT_STATUS_FAILED,
                                                  c.ROLLOUT_STATUS_SUCCEEDED]
    first = flaky.attempts[0]
    assert first.exit_code == 3 and "exited with code 3" in first.error
    assert "boom on attempt 1" in first.error  # the harness's stderr, quoted
    keys = [env_of(flaky, k)["OPENAI_API_KEY"] for k in (1, 2)]
    assert keys[0] != keys[1]
    assert [signer.verify(k).attempt for k in keys] == [1, 2]
    assert flaky.attempts[0].workdir != flaky.attempts[1].workdir
    broken = rollouts["broken/0"]
    assert broken.status == c.ROLLOUT_STATUS_FAILED and not broken.has_reward
    assert broken.attempt == 3 and len(broken.attempts) == 3
    assert "exited with code 3" in broken.error and "boom on attempt 3" in broken.error
    assert len({env_of(broken, k)["OPENAI_API_KEY"] for k in (1, 2, 3)}) == 3


def test_hang_is_killed_at_timeout_and_other_rollouts_unaffected(svc: Services) -> None:
    t0 = time.monotonic()
    run, _ = svc.run_to_end(svc.spec(
        [{"id": "hang", "behavior": "hang", "x": 1}, {"id": "fine", "x": 5}], timeout_s=1.5))
    assert time.monotonic() - t0 < 20
    rollouts = svc.rollouts(run.run_id)
    hang = rollouts["hang/0"]
    assert hang.status == c.ROLLOUT_STATUS_FAILED
    assert hang.attempts[0].timed_out and "timed out after 1.5s" in hang.error
    grandchild = int((Path(hang.attempts[0].workdir) / "work" / "grandchild.pid").read_text())
    assert not process_alive(grandchild)
    fine = rollouts["fine/0"]
    assert fine.status == c.ROLLOUT_STATUS_SUCCEEDED and fine.reward == 1.0
    assert fine.error == "" and not fine.attempts[0].timed_out


def test_grader_garbage_fails_the_rollout_with_its_output(svc: Services) -> None:
    run, _ = svc.run_to_end(svc.spec(
        [{"id": "bad", "grader": "garbage", "x": 1}, {"id": "good", "x": 2}], max_attempts=2))
    rollouts = svc.rollouts(run.run_id)
    bad = rollouts["bad/0"]
    assert bad.status == c.ROLLOUT_STATUS_FAILED
    assert "grading failed" in bad.error and "the reward is: high!!" in bad.error
    assert len(bad.attempts) == 1  # a broken grader does not rerun the harness
    assert rollouts["good/0"].status == c.ROLLOUT_STATUS_SUCCEEDED
    assert rollouts["good/0"].reward == 1.0


def test_exit_code_grading(svc: Services) -> None:
    run, _ = svc.run_to_end(svc.spec(
        [{"id": f"e{code}", "grader": "exit", "exit": code} for code in (0, 1, 2)],
        reward_source=c.REWARD_SOURCE_GRADER_EXIT_CODE))
    rollouts = svc.rollouts(run.run_id)
    assert rollouts["e0/0"].reward == 1.0 and rollouts["e0/0"].has_reward
    assert rollouts["e1/0"].reward == 0.0 and rollouts["e1/0"].has_reward
    assert rollouts["e1/0"].status == c.ROLLOUT_STATUS_SUCCEEDED
    assert rollouts["e2/0"].status == c.ROLLOUT_STATUS_FAILED
    assert "exited with code 2" in rollouts["e2/0"].error
    assert run.mean_reward == pytest.approx(0.5)


def test_harness_reported_reward(svc: Services) -> None:
    run, _ = svc.run_to_end(svc.spec(
        [{"id": "r", "behavior": "report", "reward": 0.25, "x": 0},
         {"id": "silent", "x": 0}],
        reward_source=c.REWARD_SOURCE_HARNESS, grader_command=[]))
    rollouts = svc.rollouts(run.run_id)
    r = rollouts["r/0"]
    assert r.status == c.ROLLOUT_STATUS_SUCCEEDED and r.reward == 0.25
    assert r.attempts[0].has_reported_reward and r.attempts[0].reported_reward == 0.25
    silent = rollouts["silent/0"]
    assert silent.status == c.ROLLOUT_STATUS_FAILED and "reported no reward" in silent.error


def test_invalid_specs_are_refused_and_store_nothing(svc: Services, tmp_path: Path) -> None:
    before = len(svc.store.list_runs(limit=10000).runs)
    good = svc.spec([{"x": 1}])
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"id": "a"}\n{not json\n')
    not_object = tmp_path / "list.jsonl"
    not_object.write_text("[1, 2]\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")

    def variant(**kw: Any) -> c.RunSpec:
        s = c.RunSpec()
        s.CopyFrom(good)
        for k, v in kw.items():
            if isinstance(v, list):
                field = getattr(s, k)
                del field[:]
                field.extend(v)
            elif isinstance(v, c.SamplingPolicy):
                getattr(s, k).CopyFrom(v)
            else:
                setattr(s, k, v)
        return s

    cases = {
        "harness_command is empty": variant(harness_command=[]),
        "group_size": variant(group_size=-1),
        "cannot read tasks_file": variant(tasks=[], tasks_file=str(tmp_path / "missing.jsonl")),
        "line 2: not valid JSON": variant(tasks=[], tasks_file=str(bad_json)),
        "must be a JSON object": variant(tasks=[], tasks_file=str(not_object)),
        "has no tasks": variant(tasks=[], tasks_file=str(empty)),
        "no tasks": variant(tasks=[]),
        "not both": variant(tasks_file=str(bad_json)),
        "relative path": variant(harness_command=["bin/harness"]),
        "not an executable": variant(harness_command=[str(tmp_path / "nope")]),
        "duplicate task id": variant(tasks=[c.Task(data_json='{"id": 1}'),
                                            c.Task(data_json='{"task_id": "1"}')]),
        "grader_command is empty": variant(grader_command=[]),
        "not used with REWARD_SOURCE_HARNESS": variant(reward_source=c.REWARD_SOURCE_HARNESS),
        "unknown backend": variant(backend="k8s"),
        "timeout_s": variant(timeout_s=-1),
        # the trainer's loss uses temperature 1 and no nucleus (harnessrl.sampling)
        "sampling temperature=0.7 cannot be matched by the trainer":
            variant(sampling=c.SamplingPolicy(temperature=0.7, max_tokens=64)),
        "sampling top_p=0.9 cannot be matched": variant(sampling=c.SamplingPolicy(top_p=0.9)),
        "max_tokens must be >= 1": variant(sampling=c.SamplingPolicy(max_tokens=0)),
        "unknown tampered_rewards 9": variant(tampered_rewards=9),
        "tampered_penalty is for tampered_rewards PENALTY": variant(tampered_penalty=2.0),
        "tampered_penalty must be a positive number":
            variant(tampered_rewards=c.TAMPERED_REWARDS_PENALTY, tampered_penalty=-1.0),
    }
    # a service's credentials are never a rollout's, even when a run's author names them
    for name in ("HARNESSRL_TLS_DIR", "HARNESSRL_TLS_PEM", "HARNESSRL_SCOPE_TOKEN",
                 "HARNESSRL_ENGINE_API_KEY_FILE", "HARNESSRL_JUDGE_API_KEY"):
        leak = variant()
        leak.env[name] = "/x"
        cases[f"environment variable {name!r} carries a service's credentials"] = leak
    for expected, spec in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            svc.ctl.create_run(spec)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (expected, err.value)
        assert expected in err.value.details(), (expected, err.value.details())
    with pytest.raises(grpc.RpcError) as err:
        svc.ctl.create_run(good, run_id="bad/id")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(svc.store.list_runs(limit=10000).runs) == before
    with pytest.raises(grpc.RpcError) as err:
        svc.ctl.get_run("no-such-run")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # a policy the trainer matches is accepted and kept with the run
    matched = c.SamplingPolicy(temperature=1.0, top_p=1.0, max_tokens=16)
    run, _ = svc.run_to_end(variant(sampling=matched))
    assert run.status == c.RUN_STATUS_SUCCEEDED and run.spec.sampling == matched


def test_tasks_file_ids_and_idempotent_create(svc: Services, tmp_path: Path) -> None:
    f = tmp_path / "tasks.jsonl"
    f.write_text('{"id": "alpha", "x": 1}\n\n{"task_id": 7, "x": 2}\n{"x": 3}\n')
    spec = svc.spec([])
    spec.tasks_file = str(f)
    run_id = f"idem-{uuid.uuid4().hex[:8]}"
    run = svc.ctl.create_run(spec, run_id=run_id)
    assert run.run_id == run_id and run.num_rollouts == 3
    assert svc.ctl.create_run(spec, run_id=run_id).run_id == run_id
    other = c.RunSpec()
    other.CopyFrom(spec)
    other.group_size = 2
    with pytest.raises(grpc.RpcError) as err:
        svc.ctl.create_run(other, run_id=run_id)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    events = list(svc.ctl.watch_run(run_id, timeout=60))
    assert events[-1].run.status == c.RUN_STATUS_SUCCEEDED
    assert sorted(svc.rollouts(run_id)) == ["4/0", "7/0", "alpha/0"]  # "4": its line number
    listed = svc.ctl.list_rollouts(run_id).rollouts
    assert len(listed) == 3 and all(r.status == c.ROLLOUT_STATUS_SUCCEEDED for r in listed)
    # the same CreateRun after the run ended returns it, runs nothing again
    again = svc.ctl.create_run(spec, run_id=run_id)
    assert again.status == c.RUN_STATUS_SUCCEEDED
    assert all(len(r.attempts) == 1 for r in svc.ctl.list_rollouts(run_id).rollouts)


def test_watch_streams_events_and_ends(svc: Services) -> None:
    run = svc.ctl.create_run(svc.spec([{"id": "a", "x": 1}, {"id": "b", "x": 2}],
                                      group_size=2, concurrency=2))
    events = list(svc.ctl.watch_run(run.run_id, timeout=60))
    assert events[-1].kind == cpb.RunEvent.KIND_RUN_DONE
    assert events[-1].run.status == c.RUN_STATUS_SUCCEEDED
    assert all(e.kind == cpb.RunEvent.KIND_ROLLOUT for e in events[:-1])
    seen: dict[str, list[int]] = {}
    for e in events[:-1]:
        seen.setdefault(e.rollout.rollout_id, []).append(e.rollout.status)
    assert len(seen) == 4
    for statuses in seen.values():
        assert statuses[-1] == c.ROLLOUT_STATUS_SUCCEEDED
        assert c.ROLLOUT_STATUS_RUNNING in statuses  # live events, not only the end state
    # watching a finished run replays its final states and ends
    replay = list(svc.ctl.watch_run(run.run_id, timeout=10))
    assert replay[-1].kind == cpb.RunEvent.KIND_RUN_DONE
    assert {e.rollout.rollout_id for e in replay[:-1]} == set(seen)
    assert all(e.rollout.status == c.ROLLOUT_STATUS_SUCCEEDED for e in replay[:-1])


def test_cancel_stops_running_harnesses(svc: Services) -> None:
    run = svc.ctl.create_run(svc.spec([{"id": "s", "behavior": "sleep", "sleep": 120, "x": 1}],
                                      group_size=4, concurrency=2))
    deadline = time.monotonic() + 20
    while True:
        running = [ro for ro in svc.store.list_rollouts(run.run_id).rollouts
                   if ro.status == c.ROLLOUT_STATUS_RUNNING and ro.attempts and
                   (Path(ro.attempts[0].workdir) / "work" / "harness.pid").exists()]
        if len(running) == 2:
            break
        assert time.monotonic() < deadline, "harnesses did not start"
        time.sleep(0.05)
    pids = [int((Path(ro.attempts[0].workdir) / "work" / "harness.pid").read_text()) for ro in running]
    assert all(process_alive(p) for p in pids)
    t0 = time.monotonic()
    cancelled = svc.ctl.cancel_run(run.run_id)
    assert time.monotonic() - t0 < 10
    assert cancelled.status == c.RUN_STATUS_CANCELLED and cancelled.num_cancelled == 4
    assert not any(process_alive(p) for p in pids)
    rollouts = svc.store.list_rollouts(run.run_id).rollouts
    assert [ro.status for ro in rollouts] == [c.ROLLOUT_STATUS_CANCELLED] * 4
    assert sum(1 for ro in rollouts if ro.attempt == 0) == 2  # never started
    assert svc.store.get_run(run.run_id).status == c.RUN_STATUS_CANCELLED
    assert svc.ctl.cancel_run(run.run_id).status == c.RUN_STATUS_CANCELLED  # idempotent


def test_run_survives_store_restart(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    s = Services(tmp_path, redis_url, key_prefix)
    try:
        run = s.ctl.create_run(s.spec([{"id": f"t{i}", "behavior": "sleep", "sleep": 1.0,
                                        "x": i} for i in range(4)], group_size=2,
                                      concurrency=4))
        time.sleep(0.7)  # the first four harnesses are running
        assert s.store_proc is not None
        s.store_proc.kill()  # kill -9
        time.sleep(1.5)  # they finish while the store is down
        s.start_store()
        events = list(s.ctl.watch_run(run.run_id, timeout=90))
        done = events[-1].run
        assert done.status == c.RUN_STATUS_SUCCEEDED, done
        assert (done.num_succeeded, done.num_failed) == (8, 0)
        rollouts = s.store.list_rollouts(run.run_id).rollouts
        assert len(rollouts) == 8
        assert all(ro.status == c.ROLLOUT_STATUS_SUCCEEDED and len(ro.attempts) == 1
                   for ro in rollouts)
        assert s.store.get_run(run.run_id).num_succeeded == 8
    finally:
        s.stop()



def harness_pids(s: Services, run_id: str) -> dict[str, int]:
    """task id -> pid of its running harness, for the attempts that wrote one."""
    pids = {}
    for ro in s.store.list_rollouts(run_id).rollouts:
        if ro.attempts:
            f = Path(ro.attempts[-1].workdir) / "work" / "harness.pid"
            if f.exists():
                pids[ro.task_id] = int(f.read_text())
    return pids


def test_controller_killed_mid_run_adopts_its_jobs(redis_url: str, key_prefix: str,
                                                   tmp_path: Path) -> None:
    """kill -9 of the controller: one harness ends while no controller runs, one runs on; the
    restarted controller resumes the run by itself, adopts both jobs (the first's exit status
    is read back, the second is watched to its end) and launches neither again."""
    s = Services(tmp_path, redis_url, key_prefix)
    try:
        run_id = "resumed"
        spec = s.spec([{"id": "fast", "behavior": "sleep", "sleep": 0.5, "x": 1},
                       {"id": "slow", "behavior": "sleep", "sleep": 6.0, "x": 1},
                       {"id": "later", "x": 2}],
                      group_size=1, concurrency=2, max_attempts=2)
        s.ctl.create_run(spec, run_id=run_id)
        deadline = time.monotonic() + 20
        while len(pids := harness_pids(s, run_id)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        s.controller.kill()  # kill -9: two harnesses running, one rollout pending
        s.ctl.close()
        while process_alive(pids["fast"]):  # it ends with no controller to see it
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert process_alive(pids["slow"])
        s.start_controller()  # resumes the run at start-up, before any request
        done = list(s.ctl.watch_run(run_id, timeout=60))[-1].run
        assert done.status == c.RUN_STATUS_SUCCEEDED and done.num_succeeded == 3, done
        rollouts = s.rollouts(run_id)
        for ro in rollouts.values():
            assert [a.status for a in ro.attempts] == [c.ROLLOUT_STATUS_SUCCEEDED], ro
            assert ro.reward == 1.0
        # the slow harness finished under the new controller's watch, as the same process
        assert not process_alive(pids["slow"])
        assert (Path(rollouts["slow/0"].attempts[0].workdir) / "work" / "span.txt").exists()
        # each harness ran once: one launch record and one "harness ran" line per rollout
        for ro in rollouts.values():
            wd = Path(ro.attempts[0].workdir)
            assert len(list(wd.glob(".*.h1.job.json"))) == 1
            assert (wd / "stdout.log").read_text().count("harness ran") == 1
        assert "adopted from an earlier controller (ended meanwhile)" in \
            s.controller.log_tail(400)
        assert "adopted from an earlier controller (still running)" in \
            s.controller.log_tail(400)
        assert s.ctl.create_run(spec, run_id=run_id).status == c.RUN_STATUS_SUCCEEDED
    finally:
        s.stop()


def test_stopping_the_controller_kills_its_harnesses(redis_url: str, key_prefix: str,
                                                     tmp_path: Path) -> None:
    s = Services(tmp_path, redis_url, key_prefix)
    try:
        run = s.ctl.create_run(s.spec([{"id": "s", "behavior": "sleep", "sleep": 120, "x": 1}],
                                      max_attempts=2))
        pidfile = None
        deadline = time.monotonic() + 20
        while pidfile is None or not pidfile.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
            ro = s.store.list_rollouts(run.run_id).rollouts[0]
            if ro.attempts:
                pidfile = Path(ro.attempts[0].workdir) / "work" / "harness.pid"
        pid = int(pidfile.read_text())
        assert process_alive(pid)
        s.controller.stop()  # SIGTERM
        assert s.controller.proc is not None and s.controller.proc.returncode == 0
        assert not process_alive(pid)
        # The store still says RUNNING: the next controller resumes the run at start-up. The
        # killed attempt fails with the reason, and the retry runs until the run is cancelled.
        assert s.store.get_rollout(ro.rollout_id).status == c.ROLLOUT_STATUS_RUNNING
        s.ctl.close()
        s.start_controller()
        deadline = time.monotonic() + 20
        while len((ro2 := s.store.get_rollout(ro.rollout_id)).attempts) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ro2.attempts[0].status == c.ROLLOUT_STATUS_FAILED
        assert "controller shut down" in ro2.attempts[0].error, ro2.attempts[0].error
        cancelled = s.ctl.cancel_run(run.run_id)
        assert cancelled.status == c.RUN_STATUS_CANCELLED and cancelled.num_cancelled == 1
        assert s.store.get_rollout(ro.rollout_id).status == c.ROLLOUT_STATUS_CANCELLED
        assert s.store.get_run(run.run_id).status == c.RUN_STATUS_CANCELLED
    finally:
        s.stop()


def test_store_gone_past_the_bound_fails_the_run_loudly(redis_url: str, key_prefix: str,
                                                        tmp_path: Path) -> None:
    s = Services(tmp_path, redis_url, key_prefix, store_retry_s=1.5)
    try:
        spec = s.spec([{"id": "s", "behavior": "sleep", "sleep": 0.5, "x": 1}], group_size=3,
                      concurrency=3, max_attempts=2)
        run = s.ctl.create_run(spec, run_id="outage")
        time.sleep(0.3)
        assert s.store_proc is not None
        s.store_proc.kill()
        deadline = time.monotonic() + 30
        while (got := s.ctl.get_run(run.run_id)).status == c.RUN_STATUS_RUNNING:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert got.status == c.RUN_STATUS_FAILED
        assert "unavailable" in got.error and "bound 1.5s" in got.error
        assert "run FAILED" in s.controller.log_tail(200)
        # once the store is back, CreateRun with the same run_id resumes the failed run
        s.start_store()
        assert s.ctl.create_run(spec, run_id="outage").status == c.RUN_STATUS_RUNNING
        done = list(s.ctl.watch_run("outage", timeout=60))[-1].run
        assert done.status == c.RUN_STATUS_SUCCEEDED and done.num_succeeded == 3, done
        assert s.store.get_run("outage").status == c.RUN_STATUS_SUCCEEDED
    finally:
        s.stop()


def test_a_run_resumed_in_process_takes_its_running_jobs_as_they_are(
        redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    """The store gone past the bound fails the run (the short job's end cannot be stored) while
    two harnesses still run; once the store is back, CreateRun resumes it in the same
    controller. Each job still running is taken as it is (the same harness process, one
    attempt): none is refused as a job the backend follows already, and no rollout of the failed
    execution goes on beside the resumed one."""
    s = Services(tmp_path, redis_url, key_prefix, store_retry_s=1.5)
    try:
        spec = s.spec([{"id": f"t{i}", "behavior": "sleep", "sleep": 1.5 if i == 0 else 10,
                        "x": i} for i in range(3)], group_size=1, concurrency=3, max_attempts=2)
        run = s.ctl.create_run(spec, run_id="outage-long")
        deadline = time.monotonic() + 30
        while len(before := harness_pids(s, run.run_id)) < 3:
            assert time.monotonic() < deadline, before
            time.sleep(0.1)
        assert s.store_proc is not None
        s.store_proc.kill()
        while (got := s.ctl.get_run(run.run_id)).status == c.RUN_STATUS_RUNNING:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert got.status == c.RUN_STATUS_FAILED and "unavailable" in got.error
        s.start_store()
        assert s.ctl.create_run(spec, run_id=run.run_id).status == c.RUN_STATUS_RUNNING
        done = list(s.ctl.watch_run(run.run_id, timeout=60))[-1].run
        assert (done.status, done.num_succeeded, done.num_failed) == \
            (c.RUN_STATUS_SUCCEEDED, 3, 0), done
        rollouts = s.store.list_rollouts(run.run_id).rollouts
        assert [len(ro.attempts) for ro in rollouts] == [1, 1, 1], rollouts
        assert harness_pids(s, run.run_id) == before  # the same harnesses, taken as they were
        assert "exists already" not in s.controller.log_tail(400)
    finally:
        s.stop()


def test_admission_starts_groups_only_as_the_trainer_consumes_them(svc: Services) -> None:
    """RunSpec.admission_*: window (0 + 1) x 1 group; a group starts only when the trainer's
    AdmissionUpdate has consumed the one before (docs/modes.md)."""
    tasks = [{"id": f"a{i}", "x": i} for i in range(3)]
    run = svc.ctl.create_run(svc.spec(tasks, group_size=2, stream="adm-test",
                                      admission_max_staleness=0, admission_batch_groups=1))

    def status_when(pred: Any, consumed: int) -> cpb.AdmissionStatus:
        deadline = time.monotonic() + 60
        while True:
            st = svc.ctl.admission_update(run.run_id, consumed, consumed)
            if pred(st) or time.monotonic() > deadline:
                return st
            time.sleep(0.2)

    st = status_when(lambda s: s.groups_done == 1, 0)
    assert (st.groups_admitted, st.groups_done, st.limit, st.groups_waiting) == (1, 1, 1, 2)
    time.sleep(1.0)  # nothing more starts while the trainer has consumed nothing
    pending = [ro for ro in svc.store.list_rollouts(run.run_id).rollouts
               if ro.status == c.ROLLOUT_STATUS_PENDING]
    assert len(pending) == 4 and svc.ctl.admission_update(run.run_id, 0, 0).groups_admitted == 1
    st = status_when(lambda s: s.groups_done == 2, 1)
    assert (st.groups_admitted, st.groups_consumed, st.limit) == (2, 1, 2)
    st = status_when(lambda s: s.groups_done == 3, 2)
    done = list(svc.ctl.watch_run(run.run_id, timeout=60))[-1].run
    assert done.status == c.RUN_STATUS_SUCCEEDED and done.num_succeeded == 6
    with pytest.raises(grpc.RpcError) as e:
        svc.ctl.admission_update("no-such-run", 0, 0)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def tampered_count(svc: Services, policy: str) -> float:
    """harnessrl_controller_rewards_tampered_total{policy} of the controller's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).text
    series = f'harnessrl_controller_rewards_tampered_total{{policy="{policy}"}} '
    return next((float(ln[len(series):]) for ln in text.splitlines()
                 if ln.startswith(series)), 0.0)


def cli(state: Path, *args: str) -> str:
    """A `harnessrl` verb against the store of `state`'s stack.json (as the test's identity)."""
    out = subprocess.run([PY, "-m", "harnessrl.local.cli", *args, "--state-dir", str(state)],
                         capture_output=True, text=True, timeout=60, check=False,
                         env={**os.environ, "COLUMNS": "250", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_tampered_grade_is_stored_marked_and_never_keeps_its_reward(
        svc: Services, tmp_path: Path) -> None:
    """A grader's `"tampered": true` (it claimed reward 1.0): stored on the rollout with the
    evidence, reward 0 under the default, -penalty under PENALTY, counted, and marked by the
    CLI; `"tampered": "yes"` fails the rollout with the reason."""
    before = {p: tampered_count(svc, p) for p in ("zero", "penalty")}
    run, _ = svc.run_to_end(svc.spec([{"id": "forged", "grader": "tampered"},
                                      {"id": "yes", "grader": "tampered", "tampered": "yes"},
                                      {"id": "honest", "grader": "tampered", "x": 1,
                                       "tamper_index": -1}]))
    ros = svc.rollouts(run.run_id)
    forged = ros["forged/0"]
    assert forged.status == c.ROLLOUT_STATUS_SUCCEEDED and forged.tampered, forged
    assert forged.tamper_evidence == EVIDENCE and forged.reward_reason == "forged"
    assert forged.has_reward and forged.reward == 0.0  # not the 1.0 it printed
    honest = ros["honest/0"]
    assert not honest.tampered and honest.reward == 1.0 and not honest.tamper_evidence
    yes = ros["yes/0"]
    assert yes.status == c.ROLLOUT_STATUS_FAILED and not yes.tampered
    assert 'tampered must be true or false (a JSON bool), not "yes"' in yes.error, yes.error
    assert run.num_tampered == 1 and svc.store.get_run(run.run_id).num_tampered == 1

    penalty = svc.spec([{"id": "forged", "grader": "tampered", "claimed": 0.5}],
                       tampered_rewards=c.TAMPERED_REWARDS_PENALTY)
    run_p, _ = svc.run_to_end(penalty)
    assert run_p.spec.tampered_penalty == 1.0  # the default, filled in
    assert svc.rollouts(run_p.run_id)["forged/0"].reward == -1.0
    penalty.tampered_penalty = 0.25
    run_q, _ = svc.run_to_end(penalty)
    forged_q = svc.rollouts(run_q.run_id)["forged/0"]
    assert forged_q.tampered and forged_q.reward == -0.25
    assert tampered_count(svc, "zero") - before["zero"] == 1
    assert tampered_count(svc, "penalty") - before["penalty"] == 2

    state = tmp_path / "state"
    state.mkdir()
    (state / "stack.json").write_text(json.dumps({"store": f"127.0.0.1:{svc.store_port}",
                                                  "supervisor_pid": os.getpid()}))
    table = cli(state, "rollouts", run.run_id)
    rows = {ln.split()[1]: ln for ln in table.splitlines() if f"{run.run_id}/" in ln}
    assert "SUCCEEDED TAMPERED" in rows[f"{run.run_id}/forged/0"]
    assert "TAMPERED" not in rows[f"{run.run_id}/honest/0"]
    assert "1 of 3 rollouts TAMPERED" in " ".join(table.split())
    shown = " ".join(cli(state, "show", forged.rollout_id).split())
    assert f"TAMPERED: the grader found the agent's code forged the outcome; evidence: " \
        f"{EVIDENCE}" in shown
    assert "TAMPERED" not in cli(state, "show", honest.rollout_id)


def test_under_drop_a_tampered_rollout_is_kept_and_the_trainer_learns_nothing_from_it(
        svc: Services) -> None:
    """TAMPERED_REWARDS_DROP: the rollout stays SUCCEEDED, tampered, without a reward; the
    trainer's samples leave it out of its group, as a failed rollout (the others' rewards
    make the advantages)."""
    from services.trainer.samples import group_samples

    before = tampered_count(svc, "drop")
    stream = f"tamper-{uuid.uuid4().hex[:8]}"
    run, _ = svc.run_to_end(svc.spec([{"id": "d", "grader": "tampered", "x": 1}],
                                     group_size=3, stream=stream,
                                     tampered_rewards=c.TAMPERED_REWARDS_DROP))
    ros = svc.rollouts(run.run_id)
    dropped = ros["d/0"]
    assert dropped.status == c.ROLLOUT_STATUS_SUCCEEDED and dropped.tampered
    assert not dropped.has_reward and dropped.tamper_evidence == EVIDENCE
    assert [ros[f"d/{i}"].reward for i in (1, 2)] == [0.0, 1.0]
    assert run.num_succeeded == 3 and run.mean_reward == pytest.approx(0.5)  # of the others
    assert tampered_count(svc, "drop") - before == 1
    (group,) = svc.store.read_groups(stream, consumer_group="t", max_groups=5).groups
    learned = group_samples(group)
    assert learned.dropped_rollouts == [dropped.rollout_id]
    assert learned.rewards == [0.0, 1.0] and len(learned.advantages) == 2


def test_tampered_rewards_from_the_command_line_and_the_trainer_config(
        svc: Services, tmp_path: Path) -> None:
    """`harnessrl run --tampered-rewards penalty --tampered-penalty 0.5` reaches the run; bad
    values are refused before anything runs; the trainer's config builds the same setting."""
    from harnessrl.local import tampered_flags
    from services.trainer.config import TrainerConfig
    from services.trainer.rollouts import step_spec

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "forged", "grader": "tampered"}\n')
    base = ["run", "--controller", svc.ctl_address, "--harness", f"{PY} {svc.harness}",
            "--grader", f"{PY} {svc.grader}", "--tasks", str(tasks), "--group-size", "1",
            "--no-sandbox", "--name", f"cli-{uuid.uuid4().hex[:6]}"]

    def harnessrl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PY, "-m", "harnessrl.local.cli", *args], capture_output=True,
                              text=True, timeout=60, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"})

    done = harnessrl(*base, "--tampered-rewards", "penalty", "--tampered-penalty", "0.5")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 TAMPERED" in done.stdout, done.stdout
    (run,) = [r for r in svc.store.list_runs(limit=5).runs if r.spec.name == base[-1]]
    assert run.spec.tampered_rewards == c.TAMPERED_REWARDS_PENALTY
    (ro,) = svc.store.list_rollouts(run.run_id).rollouts
    assert ro.tampered and ro.reward == -0.5
    done = harnessrl(*base, "--tampered-rewards", "bogus")
    assert done.returncode == 2 and "--tampered-rewards 'bogus': one of zero, penalty, drop" \
        in " ".join(done.stdout.split()), done.stdout
    for bad, why in (({"tampered_penalty": "2"}, "is for --tampered-rewards penalty"),
                     ({"tampered_rewards": "penalty", "tampered_penalty": "-1"},
                      "a positive number"),
                     ({"tampered_rewards": "penalty", "tampered_penalty": "x"}, "not a number")):
        with pytest.raises(ValueError, match=why):  # as `up --config run.yaml` gives them too
            tampered_flags.setting(argparse.Namespace(**bad))
    assert tampered_flags.trainer_flags(argparse.Namespace(tampered_rewards="drop")) == \
        ["--tampered-rewards", "drop"]

    assert step_spec(TrainerConfig(), []).tampered_rewards == c.TAMPERED_REWARDS_ZERO
    cfg = TrainerConfig.load(["--tampered-rewards", "penalty", "--tampered-penalty", "0.5"])
    spec = step_spec(cfg, [])
    assert (spec.tampered_rewards, spec.tampered_penalty) == (c.TAMPERED_REWARDS_PENALTY, 0.5)
    drop = step_spec(TrainerConfig(tampered_rewards="drop"), [])
    assert (drop.tampered_rewards, drop.tampered_penalty) == (c.TAMPERED_REWARDS_DROP, 0.0)
    with pytest.raises(ValueError, match="tampered_rewards"):
        TrainerConfig(tampered_rewards="bogus")
