"""The pass@k estimator against brute force, and the pure parts of evaluation: scoring store
rollouts, the sampling rule for runs on no stream, comparing two results, their HTML page."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest

from harnessrl import evaluation as ev
from harnessrl.local import evaluate
from harnessrl.local.report import render_eval
from harnessrl.passk import mean_pass_at_k, pass_at_k
from harnessrl.sampling import unmatched
from harnessrl.v1 import common_pb2 as c


def brute_force(n: int, c_: int, k: int) -> float:
    """The share of all k-subsets of n samples (the first c_ correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c_ for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration_of_every_k_subset() -> None:
    cases = 0
    for n in range(1, 9):
        for c_ in range(n + 1):
            for k in range(1, n + 1):
                want = brute_force(n, c_, k)
                assert pass_at_k(n, c_, k) == pytest.approx(want, abs=1e-12), (n, c_, k)
                # and the binomial form of the paper
                assert want == pytest.approx(1 - math.comb(n - c_, k) / math.comb(n, k),
                                             abs=1e-12)
                cases += 1
    assert cases == sum(n * (n + 1) for n in range(1, 9))


def test_pass_at_k_edge_cases() -> None:
    for n in range(1, 9):
        for k in range(1, n + 1):
            assert pass_at_k(n, 0, k) == 0.0  # nothing correct
            assert pass_at_k(n, n, k) == 1.0  # everything correct
        assert pass_at_k(n, 1, n) == 1.0  # k = n: any correct sample is drawn
        assert pass_at_k(n, 1, 1) == pytest.approx(1 / n)  # pass@1 = c / n
    for bad in [(3, 1, 4), (1, 0, 2)]:  # k > n
        with pytest.raises(ValueError, match="at least"):
            pass_at_k(*bad)
    with pytest.raises(ValueError, match="k >= 1"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match="impossible"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(0, 0, 1)
    # stable where binomials are huge
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    assert mean_pass_at_k([(4, 0), (4, 4), (4, 2)], 1) == pytest.approx(0.5)


def rollout(task: str, i: int, status: int, reward: float | None = None,
            error: str = "") -> c.Rollout:
    ro = c.Rollout(rollout_id=f"r/{task}/{i}", run_id="r", task_id=task, group_id=f"r/{task}",
                   index_in_group=i, group_size=4, status=status, error=error,
                   attempts=[c.Attempt(attempt=1, num_calls=2, started_at=10.0,
                                       finished_at=12.5, workdir="/nowhere")])
    if reward is not None:
        ro.has_reward, ro.reward = True, reward
    return ro


S, F = c.ROLLOUT_STATUS_SUCCEEDED, c.ROLLOUT_STATUS_FAILED


def test_outcomes_count_failed_and_missing_samples_as_not_passed() -> None:
    rollouts = [rollout("a", i, S, r) for i, r in enumerate([1.0, 0.0, 1.0, 0.5])]
    rollouts += [rollout("b", 0, F, error="harness exited with code 3; stderr: 'boom'"),
                 rollout("b", 1, S, 1.0), rollout("b", 2, S, 0.0),
                 rollout("b", 3, c.ROLLOUT_STATUS_CANCELLED)]
    rollouts += [rollout("c", 1, S, 1.0)]  # three of c's samples are not in the store
    out = ev.task_outcomes(["a", "b", "c"], rollouts, k=4, threshold=1.0)
    a, b, cc = out
    assert (a["n"], a["c"], a["rewards"], a["failures"]) == (4, 2, [1.0, 0.0, 1.0, 0.5], [])
    assert a["avg"] == pytest.approx(0.625) and a["pass@1"] == 0.5
    assert (b["n"], b["c"], b["rewards"]) == (4, 1, [None, 1.0, 0.0, None])
    assert [f["reason"] for f in b["failures"]] == [
        "harness exited with code 3; stderr: 'boom'", "cancelled"]
    assert b["failures"][0]["rollout_id"] == "r/b/0"
    assert (cc["n"], cc["c"], [s["status"] for s in cc["samples"]]) == (
        4, 1, ["MISSING", "SUCCEEDED", "MISSING", "MISSING"])
    sample = a["samples"][0]
    assert sample["calls"] == 2 and sample["duration_s"] == 2.5 and sample["passed"]
    m = ev.metrics(out, 4)
    assert list(m) == ["pass@1", "pass@2", "pass@3", "pass@4", "avg@4"]
    assert m["pass@1"] == pytest.approx((2 / 4 + 1 / 4 + 1 / 4) / 3)
    assert m["pass@4"] == 1.0
    assert m["avg@4"] == pytest.approx((0.625 + 0.25 + 0.25) / 3)
    # a lower threshold counts partial credit as a pass
    assert ev.task_outcomes(["a"], rollouts, 4, threshold=0.5)[0]["c"] == 3


def test_runs_on_no_stream_may_sample_as_they_like_trained_runs_may_not() -> None:
    hot = c.SamplingPolicy(temperature=0.6, top_p=0.9, max_tokens=32)
    assert "cannot be matched" in unmatched(hot)
    assert "cannot be matched" in unmatched(hot, "train")
    assert unmatched(hot, ev.EVAL_STREAM) == ""
    assert unmatched(c.SamplingPolicy(temperature=0.0), "-") == ""  # greedy
    assert "must be >= 0" in unmatched(c.SamplingPolicy(temperature=-1.0), "-")
    assert "(0, 1]" in unmatched(c.SamplingPolicy(top_p=0.0), "-")
    assert "max_tokens" in unmatched(c.SamplingPolicy(max_tokens=0), "-")
    spec = ev.eval_spec(name="e", tasks=[("t", {"id": "t"})], k=3, harness_command=["h"],
                        grader_command=["g"], model="m", sampling=ev.sampling_policy(0.6))
    assert spec.stream == "-" and spec.group_size == 3 and spec.sampling.temperature == 0.6
    assert not spec.sampling.HasField("top_p")
    assert ev.sampling_dict(spec.sampling) == {"temperature": 0.6, "top_p": None,
                                               "max_tokens": None}
    with pytest.raises(ValueError):
        ev.eval_spec(name="e", tasks=[], k=0, harness_command=["h"], grader_command=[],
                     model="m")


def result(tmp_path: Any, rewards: dict[str, list[float | None]]) -> dict[str, Any]:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"id": "{t}"}}\n' for t in rewards))
    rollouts = [rollout(t, i, S if r is not None else F, r, "" if r is not None else "boom")
                for t, rs in rewards.items() for i, r in enumerate(rs)]
    return ev.build_result(model={"kind": "base", "served_name": "tiny"}, tasks_file=tasks,
                           tasks_in_file=len(rewards), task_ids=list(rewards),
                           rollouts=rollouts, k=2, threshold=1.0, harness=["h"], grader=["g"],
                           sampling=None, run_id="eval-x", started_at=0.0,
                           timings={"rollouts_s": 1.0})


def test_compare_and_the_side_by_side_page(tmp_path: Any) -> None:
    a = result(tmp_path, {"t1": [1.0, 0.0], "t2": [0.0, 0.0], "t3": [None, 1.0]})
    b = copy.deepcopy(a)
    b["metrics"] = {**a["metrics"], "pass@1": a["metrics"]["pass@1"] + 0.25}
    b["tasks"][1] = {**b["tasks"][1], "c": 1, "pass@1": 0.5}
    diff = evaluate.compare(a, b)
    assert diff["metrics"]["pass@1"]["diff"] == pytest.approx(0.25)
    assert diff["metrics"]["avg@2"]["diff"] == 0.0
    assert [t["diff_pass@1"] for t in diff["tasks"]] == [0.0, 0.5, 0.0]
    assert diff["tasks"][1]["a"] == "0/2" and diff["tasks"][1]["b"] == "1/2"
    assert diff["warnings"] == []
    b["k"], b["tasks"] = 4, b["tasks"][:2]
    diff = evaluate.compare(a, b)
    assert diff["only_a"] == ["t3"] and any("k differ" in w for w in diff["warnings"])
    page = render_eval([("A.json", a), ("B.json", b)])
    assert 'id="eval-metrics"' in page and "B - A" in page and "+0.250" in page
    assert "boom" in page  # the failed sample, named with its reason
    assert "<th>B.json passed</th>" in page


def test_model_argument_names_a_folder_a_checkpoint_or_a_trainer_output_dir(
        tmp_path: Any) -> None:
    out = tmp_path / "train"
    step = out / "checkpoints" / "step-000003"
    step.mkdir(parents=True)
    (step / "config.json").write_text("{}")
    (step / "state.json").write_text('{"step": 3, "policy_version": 3}')
    (out / "checkpoints" / "latest").write_text("step-000003")
    for arg in (out, out / "checkpoints", step):
        m = evaluate.resolve_model(str(arg), None)
        assert (m.kind, m.model_dir, m.served_name) == ("checkpoint", step.resolve(), "tiny")
        assert m.describe()["step"] == 3 and m.describe()["policy_version"] == 3
    plain = tmp_path / "hf"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert evaluate.resolve_model(str(plain), "mine").describe() == {
        "kind": "model_dir", "served_name": "mine", "path": str(plain.resolve())}
    assert evaluate.resolve_model(None, None).kind == "base"
    with pytest.raises(evaluate.EvalError, match="neither a model folder"):
        evaluate.resolve_model(str(tmp_path), None)
    assert evaluate.engine_root("http://h:1/v1/") == "http://h:1"
