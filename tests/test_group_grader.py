"""Group graders (services/controller/group_grading.py, the store's SetGroupRewards) with a
real store, real Redis and the controller as a process, on both job backends (local, and
Kubernetes Jobs on the fake API server). The harness records one chat call in the store as
the gateway would; the per-attempt grader gives a reward with parts; the group grader is a
script that looks at the store while it runs (is the group held back? is it on the stream?)
and answers as the task tells it (ranks, crash, short answer, hang, slow)."""

from __future__ import annotations

import json
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest

import conftest
from harnessrl.v1 import common_pb2 as c, store_pb2 as spb
from test_controller import PY, Services, process_alive, tampered_count
from test_controller_kubernetes import k8s_services

REPO = Path(__file__).resolve().parent.parent

HARNESS = """
import json, os, sys
sys.path.insert(0, os.environ["EXTRA_REPO"])
from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c
task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
i = int(os.environ["HARNESSRL_INDEX_IN_GROUP"])
if task.get("crash_index") == i:
    sys.exit(3)
answer = f"answer {i}"
req = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": task["question"]}]}
from harnessrl.identity import Identity
# plays the gateway recording the harness's call, with its identity (a harness has none)
store = StoreClient.connect(os.environ["EXTRA_STORE"],
                            ident=Identity.from_folder(os.environ["EXTRA_GATEWAY_TLS"]))
store.append_calls([c.Call(
    rollout_id=os.environ["HARNESSRL_ROLLOUT_ID"], attempt=int(os.environ["HARNESSRL_ATTEMPT"]),
    seq=0, api="chat.completions", model="m", request_json=json.dumps(req).encode(),
    response_message_json=json.dumps({"role": "assistant", "content": answer}).encode(),
    completion_text=answer)])
store.close()
open("answer.txt", "w").write(answer)
open("harness-only.txt", "w").write("the group grader must not read this")
"""

GRADER = """
import json, os
i = int(open("answer.txt").read().split()[1])
line = {"reward": float(i % 2 == 0), "parts": {"tests": float(i % 2 == 0)},
        "reason": f"answer {i}"}
if json.loads(os.environ["HARNESSRL_TASK_JSON"]).get("attempt_tamper") == i:
    line.update(reward=1.0, tampered=True, evidence="attempt canary")
print(json.dumps(line))
"""

GROUP_GRADER = """
import json, os, sys, time, uuid
sys.path.insert(0, os.environ["EXTRA_REPO"])
from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c
data = json.load(open(os.environ["HARNESSRL_GROUP_INPUT"]))
mode = data["task"].get("group", "ok")
from harnessrl.identity import Identity
store = StoreClient.connect(os.environ["HARNESSRL_STORE_ADDRESS"])  # as its scoped grader
gid = os.environ["HARNESSRL_GROUP_ID"]
held = [c.GroupGrading.Name(r.group_grading)
        for r in store.list_rollouts("", group_id=gid).rollouts]
probe = StoreClient.connect(os.environ["HARNESSRL_STORE_ADDRESS"],  # the test's eye
                            ident=Identity.from_folder(os.environ["EXTRA_ADMIN_TLS"]))
on_stream = [g.group_id for g in probe.read_groups(
    data["task"]["stream"], consumer_group="probe-" + uuid.uuid4().hex, max_groups=100,
    include_calls=False).groups]
store.close()
probe.close()
json.dump({"held": held, "on_stream": on_stream, "input": data}, open("probe.json", "w"))
open(os.path.join(os.environ["EXTRA_PROBES"], f"{os.getpid()}.pid"), "w").write(gid)
if mode == "crash":
    print("kaboom: the rubric file is missing", file=sys.stderr)
    sys.exit(2)
if mode == "hang":
    time.sleep(600)
if mode == "slow":
    time.sleep(float(data["task"]["sleep"]))
rewards = [{"rollout_id": r["rollout_id"], "reward": 0.25 * r["index_in_group"]
            + r["grader"]["reward"], "reason": f"rank {r['index_in_group']}",
            "parts": {"rank": r["index_in_group"], "verifiable": r["grader"]["reward"]}}
           for r in data["rollouts"]]
if mode == "short":
    rewards = rewards[1:]
if mode == "tamper":  # all 1.0 (what the per-attempt grader found tampered too); one tampered
    for r in rewards:
        r.update(reward=1.0, tampered=r["rollout_id"].endswith("/1"), evidence="group canary")
json.dump({"rewards": rewards}, open(os.environ["HARNESSRL_GROUP_OUTPUT"], "w"))
"""


class GroupRun:
    """A Services of test_controller with this file's harness, grader and group grader."""

    def __init__(self, s: Services, tmp: Path) -> None:
        self.s, self.tmp = s, tmp
        for name, text in (("h.py", HARNESS), ("g.py", GRADER), ("gg.py", GROUP_GRADER)):
            (tmp / name).write_text(textwrap.dedent(text))
        self.probes = tmp / "probes"
        self.probes.mkdir(exist_ok=True)
        self.stream = f"gg-{uuid.uuid4().hex[:8]}"

    def spec(self, tasks: list[dict[str, Any]], group_size: int = 3, **kw: Any) -> c.RunSpec:
        kw.setdefault("grader_command", [PY, str(self.tmp / "g.py")])
        spec = self.s.spec([{**t, "stream": self.stream, "question": "2+2?"} for t in tasks],
                           group_size=group_size, stream=self.stream, **kw)
        del spec.harness_command[:]
        spec.harness_command.extend([PY, str(self.tmp / "h.py")])
        spec.group_grader_command.extend([PY, str(self.tmp / "gg.py")])
        spec.env["EXTRA_PROBES"] = str(self.probes)
        spec.env["EXTRA_ADMIN_TLS"] = str(conftest.TEST_PKI / "admin")
        return spec

    def stream_groups(self) -> list[c.Group]:
        """Every group on the run's stream (a fresh consumer group reads from the start)."""
        return list(self.s.store.read_groups(self.stream, consumer_group=uuid.uuid4().hex,
                                             max_groups=100).groups)


def group_dir(ro: c.Rollout) -> Path:
    run_root = Path(ro.attempts[0].workdir).parents[1]
    return run_root / "groups" / ro.task_id


def check_graded_group(g: GroupRun, run: c.Run) -> None:
    """Rewards per rollout with their parts; published once, after its grader answered."""
    assert run.status == c.RUN_STATUS_SUCCEEDED and run.num_succeeded == 3, run
    ros = sorted(g.s.store.list_rollouts(run.run_id).rollouts, key=lambda r: r.index_in_group)
    for ro in ros:
        i = ro.index_in_group
        assert ro.group_grading == c.GROUP_GRADING_DONE
        assert ro.reward == pytest.approx(0.25 * i + (i % 2 == 0)), ro
        assert ro.attempt_reward == float(i % 2 == 0)  # the per-attempt grader's, kept
        assert {p.name: p.value for p in ro.reward_parts} == \
            {"rank": i, "verifiable": float(i % 2 == 0)}
        assert ro.reward_reason == f"rank {i}"
    probe = json.loads((group_dir(ros[0]) / "try-1" / "probe.json").read_text())
    assert probe["held"] == ["GROUP_GRADING_WAITING"] * 3  # held while its grader ran
    assert ros[0].group_id not in probe["on_stream"]  # not published before it answered
    sent = probe["input"]["rollouts"]
    assert [r["transcript"] for r in sent] == [[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": f"answer {i}"}] for i in range(3)]  # from the store
    assert [r["grader"]["parts"] for r in sent] == [{"tests": float(i % 2 == 0)}
                                                    for i in range(3)]
    assert "harness-only" not in json.dumps(probe["input"])
    groups = [x for x in g.stream_groups() if x.group_id == ros[0].group_id]
    assert len(groups) == 1  # published once, with the group grader's rewards
    assert sorted(r.reward for r in groups[0].rollouts) == [0.25, 1.0, 1.5]


@pytest.fixture(scope="module")
def local(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("group-grader")
    s = Services(tmp, redis_url, f"t{uuid.uuid4().hex[:10]}:")
    yield GroupRun(s, tmp)
    s.stop()


def test_rewards_land_per_rollout_with_parts_after_the_group_grader(local: GroupRun) -> None:
    run, _ = local.s.run_to_end(local.spec([{"id": "q1", "x": 1}]))
    check_graded_group(local, run)


def test_tampered_rewards_of_the_group_grader_and_of_the_per_attempt_grader(
        local: GroupRun) -> None:
    """A group grader's `"tampered": true` marks its rollout; one the per-attempt grader
    found tampered stays so: both get the run's PENALTY, not the group grader's 1.0."""
    before = tampered_count(local.s, "penalty")
    run, _ = local.s.run_to_end(local.spec([{"id": "tam", "group": "tamper",
                                             "attempt_tamper": 2}],
                                           tampered_rewards=c.TAMPERED_REWARDS_PENALTY,
                                           tampered_penalty=0.5))
    ros = local.s.rollouts(run.run_id)
    assert [ros[f"tam/{i}"].tampered for i in range(3)] == [False, True, True]
    assert [ros[f"tam/{i}"].reward for i in range(3)] == [1.0, -0.5, -0.5]
    assert [ros[f"tam/{i}"].tamper_evidence for i in range(3)] == \
        ["", "group canary", "attempt canary"]
    assert ros["tam/2"].attempt_reward == -0.5  # the per-attempt grader's 1.0 never kept
    assert run.num_tampered == 2
    assert tampered_count(local.s, "penalty") - before == 2  # once each
    (group,) = [x for x in local.stream_groups() if x.group_id == ros["tam/0"].group_id]
    assert sorted(r.reward for r in group.rollouts) == [-0.5, -0.5, 1.0]


def test_a_group_grader_crash_fails_the_group_with_the_reason(local: GroupRun) -> None:
    run, _ = local.s.run_to_end(local.spec([{"id": "boom", "group": "crash"},
                                            {"id": "fine"}]))
    ros = local.s.rollouts(run.run_id)
    for i in range(3):
        ro = ros[f"boom/{i}"]
        assert ro.status == c.ROLLOUT_STATUS_FAILED and not ro.has_reward
        assert ro.group_grading == c.GROUP_GRADING_FAILED
        assert "group grader failed: group grader exited with code 2" in ro.error
        assert "kaboom: the rubric file is missing" in ro.error
        assert ros[f"fine/{i}"].group_grading == c.GROUP_GRADING_DONE  # the other group
    # published once, every rollout failed (the trainer counts it, learns nothing from it);
    # a repeated finish of one of its rollouts publishes nothing more
    local.s.store.finish_attempt(spb.FinishAttemptRequest(
        rollout_id=ros["boom/0"].rollout_id, attempt=1, status=c.ROLLOUT_STATUS_CANCELLED))
    groups = {x.group_id: x for x in local.stream_groups()}
    on_stream = [x.group_id for x in local.stream_groups()]
    assert on_stream.count(f"{run.run_id}/boom") == 1 and f"{run.run_id}/fine" in on_stream
    assert not any(r.has_reward for r in groups[f"{run.run_id}/boom"].rollouts)
    assert run.num_failed == 3 and run.num_succeeded == 3


def test_a_partial_answer_or_a_timeout_fails_the_group(local: GroupRun) -> None:
    run, _ = local.s.run_to_end(local.spec([{"id": "short", "group": "short"},
                                            {"id": "hang", "group": "hang"}],
                                           group_grader_timeout_s=2), timeout=60)
    ros = local.s.rollouts(run.run_id)
    assert "no reward for" in ros["short/1"].error and \
        ros["short/0"].rollout_id in ros["short/1"].error
    assert "group grader timed out after 2s (killed)" in ros["hang/0"].error
    hung = [int(p.stem) for p in local.probes.glob("*.pid")
            if p.read_text() == f"{run.run_id}/hang"]
    assert len(hung) == 1 and not process_alive(hung[0])  # its process group was killed
    for gid in (f"{run.run_id}/short", f"{run.run_id}/hang"):  # never partly rewarded
        group = next(x for x in local.stream_groups() if x.group_id == gid)
        assert not any(r.has_reward for r in group.rollouts)


def test_failed_rollouts_are_passed_as_failed_and_only_succeeded_ones_rewarded(
        local: GroupRun) -> None:
    run, _ = local.s.run_to_end(local.spec([{"id": "c", "crash_index": 1}]))
    ros = local.s.rollouts(run.run_id)
    assert ros["c/1"].status == c.ROLLOUT_STATUS_FAILED and "code 3" in ros["c/1"].error
    assert [ros[f"c/{i}"].reward for i in (0, 2)] == [1.0, 1.5]
    probe = json.loads((group_dir(ros["c/0"]) / "try-1" / "probe.json").read_text())
    assert [r["index_in_group"] for r in probe["input"]["rollouts"]] == [0, 2]
    assert [(f["index_in_group"], f["status"]) for f in probe["input"]["failed"]] == \
        [(1, "ROLLOUT_STATUS_FAILED")]


def test_group_grader_alone_gives_every_reward(local: GroupRun, tmp_path: Path) -> None:
    """REWARD_SOURCE_GROUP_GRADER: no per-attempt grader; the group grader's rewards only."""
    (tmp_path / "gg.py").write_text(textwrap.dedent("""
        import json, os
        data = json.load(open(os.environ["HARNESSRL_GROUP_INPUT"]))
        assert all(r["grader"] is None for r in data["rollouts"]), data
        json.dump({"rewards": [{"rollout_id": r["rollout_id"], "reward": r["index_in_group"]}
                               for r in data["rollouts"]]},
                  open(os.environ["HARNESSRL_GROUP_OUTPUT"], "w"))
    """))
    spec = local.spec([{"id": "alone"}], reward_source=c.REWARD_SOURCE_GROUP_GRADER,
                      grader_command=[])
    del spec.group_grader_command[:]
    spec.group_grader_command.extend([PY, str(tmp_path / "gg.py")])
    run, _ = local.s.run_to_end(spec)
    ros = local.s.rollouts(run.run_id)
    assert [ros[f"alone/{i}"].reward for i in range(3)] == [0.0, 1.0, 2.0]
    assert not any(ros[f"alone/{i}"].HasField("attempt_reward") for i in range(3))
    assert run.mean_reward == pytest.approx(1.0)


def test_invalid_group_grader_specs_are_refused(local: GroupRun) -> None:
    bad = local.spec([{"id": "x"}], reward_source=c.REWARD_SOURCE_GROUP_GRADER,
                     grader_command=[])
    del bad.group_grader_command[:]
    with pytest.raises(grpc.RpcError) as err:
        local.s.ctl.create_run(bad)
    assert "REWARD_SOURCE_GROUP_GRADER needs a group_grader_command" in err.value.details()
    both = local.spec([{"id": "x"}], reward_source=c.REWARD_SOURCE_GROUP_GRADER)
    with pytest.raises(grpc.RpcError) as err:
        local.s.ctl.create_run(both)
    assert "grader_command is not used with REWARD_SOURCE_GROUP_GRADER" in err.value.details()


def test_set_group_rewards_checks_its_answer(local: GroupRun) -> None:
    """The store's rules: only a held group whose rollouts all ended, one reward per
    succeeded rollout, finite numbers; a repeat is a no-op that publishes nothing."""
    store, run_id = local.s.store, f"direct-{uuid.uuid4().hex[:6]}"
    gid = f"{run_id}/t"
    store.create_rollouts([c.Rollout(
        rollout_id=f"{gid}/{i}", run_id=run_id, task_id="t", group_id=gid, index_in_group=i,
        group_size=2, max_attempts=1, stream=local.stream,
        group_grading=c.GROUP_GRADING_WAITING) for i in range(2)])

    def answer(**kw: Any) -> spb.SetGroupRewardsResponse:
        return store.set_group_rewards(spb.SetGroupRewardsRequest(group_id=gid, **kw))

    def refused(code: grpc.StatusCode, text: str, **kw: Any) -> None:
        with pytest.raises(grpc.RpcError) as err:
            answer(**kw)
        assert err.value.code() == code and text in err.value.details(), err.value.details()

    refused(grpc.StatusCode.FAILED_PRECONDITION, "not every rollout has ended")
    for i, reward in enumerate((1.0, 0.0)):
        store.start_attempt(f"{gid}/{i}", 1, "")
        store.finish_attempt(spb.FinishAttemptRequest(
            rollout_id=f"{gid}/{i}", attempt=1, status=c.ROLLOUT_STATUS_SUCCEEDED,
            reward=reward, reward_parts=[c.RewardPart(name="tests", value=reward)]))
    assert gid not in [x.group_id for x in local.stream_groups()]  # held back
    one = spb.GroupReward(rollout_id=f"{gid}/0", reward=0.5)
    refused(grpc.StatusCode.INVALID_ARGUMENT, "want one reward per succeeded rollout",
            rewards=[one])
    refused(grpc.StatusCode.INVALID_ARGUMENT, "not a finite number", rewards=[
        one, spb.GroupReward(rollout_id=f"{gid}/1", reward=float("nan"))])
    refused(grpc.StatusCode.INVALID_ARGUMENT, "distinct, non-empty names", rewards=[
        one, spb.GroupReward(rollout_id=f"{gid}/1", parts=[c.RewardPart(name="")])])
    ok = [one, spb.GroupReward(rollout_id=f"{gid}/1", reward=0.75, reason="good")]
    first = answer(rewards=ok)
    assert first.published
    assert [(r.reward, r.attempt_reward) for r in first.rollouts] == [(0.5, 1.0), (0.75, 0.0)]
    again = answer(error="a late failure")  # answered already: left as it is
    assert not again.published and [r.reward for r in again.rollouts] == [0.5, 0.75]
    assert [x.group_id for x in local.stream_groups()].count(gid) == 1
    store.create_rollouts([c.Rollout(rollout_id="plain/0", run_id="plain", task_id="t",
                                     group_id="plain/t", group_size=1, max_attempts=1)])
    with pytest.raises(grpc.RpcError) as err:
        store.set_group_rewards(spb.SetGroupRewardsRequest(group_id="plain/t"))
    assert "has no group grader" in err.value.details()


def test_controller_killed_while_the_group_grader_runs(redis_url: str, key_prefix: str,
                                                       tmp_path: Path) -> None:
    """kill -9 of the controller while its group grader runs: the grader dies with it; the
    restarted controller runs it again and the group is published once."""
    s = Services(tmp_path, redis_url, key_prefix)
    g = GroupRun(s, tmp_path)
    try:
        run_id = "gg-killed"
        s.ctl.create_run(g.spec([{"id": "k", "group": "slow", "sleep": 4}]), run_id=run_id)
        deadline = time.monotonic() + 30
        while not list(g.probes.glob("*.pid")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first_pid = int(next(g.probes.glob("*.pid")).stem)
        s.controller.kill()  # kill -9 while the group grader sleeps
        s.ctl.close()
        while process_alive(first_pid):  # PR_SET_PDEATHSIG: it dies with the controller
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert [x.group_id for x in g.stream_groups()].count(f"{run_id}/k") == 0
        s.start_controller()  # resumes the run: every rollout ended, the group waits
        done = list(s.ctl.watch_run(run_id, timeout=60))[-1].run
        check_graded_group(g, done)
        gdir = group_dir(s.rollouts(run_id)["k/0"])
        assert sorted(p.name for p in gdir.iterdir()) == ["try-1", "try-2"]
        assert not (gdir / "try-1" / "output.json").exists()  # the killed one never answered
        assert len(list(g.probes.glob("*.pid"))) == 2  # run twice, published once
    finally:
        s.stop()


def test_group_grader_with_kubernetes_jobs(redis_url: str, key_prefix: str, tmp_path: Path,
                                           fake_kube) -> None:  # type: ignore[no-untyped-def]
    """Harness and per-attempt grader in pods (the grader inside the harness's Job), the group
    grader in the controller: the same rewards, parts and publication as with local jobs."""
    s = k8s_services(tmp_path, redis_url, key_prefix, fake_kube)
    try:
        g = GroupRun(s, tmp_path)
        run, _ = s.run_to_end(g.spec([{"id": "q1", "x": 1}]), timeout=90)
        check_graded_group(g, run)
    finally:
        s.stop()


def test_judge_as_the_group_grader(local: GroupRun, tmp_path: Path) -> None:
    """harnessrl.graders.judge as the run's group grader, against a stub judge endpoint:
    valid scores become rewards (combined with the tests' reward), always-malformed answers
    fail the group with the reason."""
    from test_judge import StubJudge, valid

    stub = StubJudge()
    try:
        spec = local.spec([{"id": "judged"}])
        del spec.group_grader_command[:]
        spec.group_grader_command.extend([
            PY, "-m", "harnessrl.graders.judge", "--base-url", stub.base_url, "--model",
            "judge", "--combine", "multiply", "--retries", "1"])
        spec.env["PYTHONPATH"] = str(REPO)
        stub.answers = [valid(3)]
        run, _ = local.s.run_to_end(spec)
        ros = local.s.rollouts(run.run_id)
        scores = [s["score"] for s in json.loads(valid(3), strict=False)["scores"]]
        for i in range(3):
            parts = {p.name: p.value for p in ros[f"judged/{i}"].reward_parts}
            assert parts == {"judge": scores[i], "verifiable": float(i % 2 == 0)}
            assert ros[f"judged/{i}"].reward == pytest.approx(scores[i] * (i % 2 == 0))
        assert len(stub.requests) == 1
        stub.answers = ["not json", '{"scores": []}']
        bad = local.spec([{"id": "malformed"}])
        del bad.group_grader_command[:]
        bad.group_grader_command.extend(spec.group_grader_command)
        bad.env["PYTHONPATH"] = str(REPO)
        run, _ = local.s.run_to_end(bad)
        ro = local.s.rollouts(run.run_id)["malformed/0"]
        assert ro.group_grading == c.GROUP_GRADING_FAILED
        assert "no valid answer in 2 tries" in ro.error, ro.error
    finally:
        stub.server.shutdown()



def test_group_grader_output_and_transcripts_are_checked_and_rendered() -> None:
    """parse_output refuses what the store would refuse (or what is not a number); every API's
    recorded call renders as messages."""
    from harnessrl.transcripts import transcript
    from services.controller.group_grading import parse_output

    ok = parse_output('{"rewards": [{"rollout_id": "a", "reward": 1, "parts": {"j": 0.5}}]}',
                      ["a"])
    assert ok[0].reward == 1.0 and [(p.name, p.value) for p in ok[0].parts] == [("j", 0.5)]
    for bad, why in ((f'{{"rewards": [{{"rollout_id": "a", "reward": 1{"0" * 400}}}]}}',
                      "not a finite number"),
                     ('{"rewards": [{"rollout_id": "a", "reward": 1, "parts": {"": 1}}]}',
                      "parts must be"),
                     ('{"rewards": [{"rollout_id": "a", "reward": 1, "reason": 3}]}',
                      "reason is not a string"),
                     ('{"rewards": [{"rollout_id": "b", "reward": 1}]}', "not a rollout"),
                     ('{"rewards": []}', "no reward for"), ("[]", 'no "rewards" list')):
        with pytest.raises(ValueError, match=why):
            parse_output(bad, ["a"])
    calls = {
        "messages": ({"system": "sys", "messages": [{"role": "user", "content": "q"}]},
                     [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]),
        "responses": ({"instructions": "sys", "input": "q"},
                      [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]),
        "completions": ({"prompt": "q"}, [{"role": "user", "content": "q"}]),
    }
    for api, (req, want) in calls.items():
        got = transcript(c.Call(api=api, request_json=json.dumps(req).encode(),
                                completion_text="a"))
        assert got == [*want, {"role": "assistant", "content": "a"}], api


def test_cancelling_a_run_no_controller_executes_ends_its_waiting_groups(
        local: GroupRun) -> None:
    """CancelRun of a run only the store holds (no execution here): its rollouts are cancelled
    and each group still waiting for its grader fails ("run cancelled"), not left waiting."""
    store, run_id = local.s.store, f"stored-{uuid.uuid4().hex[:6]}"
    spec = local.spec([{"id": "t"}])
    store.put_run(c.Run(run_id=run_id, spec=spec, status=c.RUN_STATUS_RUNNING,
                        created_at=time.time()))
    store.create_rollouts([c.Rollout(
        rollout_id=f"{run_id}/t/{i}", run_id=run_id, task_id="t", group_id=f"{run_id}/t",
        index_in_group=i, group_size=2, max_attempts=1, stream=local.stream,
        group_grading=c.GROUP_GRADING_WAITING) for i in range(2)])
    run = local.s.ctl.cancel_run(run_id)
    assert run.status == c.RUN_STATUS_CANCELLED and run.num_cancelled == 2
    ros = store.list_rollouts(run_id).rollouts
    assert [r.group_grading for r in ros] == [c.GROUP_GRADING_FAILED] * 2
    assert [x.group_id for x in local.stream_groups()].count(f"{run_id}/t") == 1


def test_cancelling_the_run_stops_its_running_group_grader(local: GroupRun) -> None:
    run = local.s.ctl.create_run(local.spec([{"id": "hang2", "group": "hang"}]))
    deadline, pid = time.monotonic() + 30, None
    while pid is None:
        assert time.monotonic() < deadline
        pid = next((int(p.stem) for p in local.probes.glob("*.pid")
                    if p.read_text() == f"{run.run_id}/hang2"), None)
        time.sleep(0.05)
    local.s.ctl.cancel_run(run.run_id)
    done = list(local.s.ctl.watch_run(run.run_id, timeout=30))[-1].run
    assert done.status == c.RUN_STATUS_CANCELLED
    while process_alive(pid):  # its process group is killed, not left to its timeout
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ros = local.s.rollouts(run.run_id)
    assert all(ros[f"hang2/{i}"].group_grading == c.GROUP_GRADING_FAILED for i in range(3))
    assert "run cancelled while its grader ran" in ros["hang2/0"].error


def test_judge_per_attempt_reads_the_attempts_calls_from_the_store(local: GroupRun) -> None:
    """`harnessrl.graders.judge --per-attempt` as the per-attempt grader (local backend): it
    judges each attempt alone from its recorded calls and prints the grader's reward line."""
    from test_judge import StubJudge, valid

    stub = StubJudge()
    try:
        stub.answers = [valid(1, [0.8]), "not json", valid(1, [0.2]), valid(1, [0.5])]
        spec = local.spec([{"id": "alone-judged"}], grader_command=[
            PY, "-m", "harnessrl.graders.judge", "--per-attempt", "--base-url", stub.base_url,
            "--model", "judge", "--retries", "1"], concurrency=1)
        del spec.group_grader_command[:]
        spec.env["PYTHONPATH"] = str(REPO)
        run, _ = local.s.run_to_end(spec)
        ros = local.s.rollouts(run.run_id)
        got = sorted((ros[f"alone-judged/{i}"].reward,
                      {p.name: p.value for p in ros[f"alone-judged/{i}"].reward_parts})
                     for i in range(3))
        assert got == [(0.2, {"judge": 0.2}), (0.5, {"judge": 0.5}), (0.8, {"judge": 0.8})]
        assert len(stub.requests) == 4  # one malformed answer asked again
        prompts = [r["messages"][1]["content"] for r in stub.requests]
        assert all("2+2?" in p and "answer " in p for p in prompts)  # the store's transcript
    finally:
        stub.server.shutdown()
