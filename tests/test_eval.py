"""`harnessrl eval` end to end, as a user runs it (`python -m harnessrl.local.cli eval`, output not
a terminal): the calc example's harness and grader (wrapped so that one sample's harness
crashes and another's grader prints garbage) against the session's vLLM, through the real
store, gateway and controller that eval starts itself. Then every sample of the JSON is looked
up in the store, and two results are compared with `--compare`. Bad options exit non-zero
with a clear message before anything starts."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c

REPO = Path(__file__).resolve().parent.parent
CALC = REPO / "examples" / "calc"
K = 2

# Task 2's second sample: the harness crashes. Task 3's first sample: the grader prints no
# reward. Everything else runs the calc example's own harness and grader.
HARNESS = f"""
import os, sys
task, index = os.environ["HARNESSRL_TASK_ID"], os.environ["HARNESSRL_INDEX_IN_GROUP"]
if (task, index) == (sys.argv[1], "1"):
    print("boom: the harness crashed", file=sys.stderr)
    sys.exit(3)
os.execv(sys.executable, [sys.executable, {str(CALC / 'harness.py')!r}])
"""
GRADER = f"""
import os, sys
task, index = os.environ["HARNESSRL_TASK_ID"], os.environ["HARNESSRL_INDEX_IN_GROUP"]
if (task, index) == (sys.argv[1], "0"):
    print("this is not a reward")
    sys.exit(0)
os.execv(sys.executable, [sys.executable, {str(CALC / 'grader.py')!r}])
"""


def harnessrl(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harnessrl.local.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory, vllm_engine: Any,
              redis_url: str) -> Iterator[dict[str, Any]]:
    """One `harnessrl eval` of 3 calc tasks x k=2 on the session's engine (by its URL)."""
    tmp = tmp_path_factory.mktemp("eval")
    lines = (CALC / "tasks.jsonl").read_text().splitlines()
    tasks = tmp / "tasks.jsonl"
    tasks.write_text("\n".join(lines[:5]) + "\n")  # 5 in the file, --limit 3
    ids = [json.loads(x)["id"] for x in lines[:3]]
    (tmp / "harness.py").write_text(HARNESS)
    (tmp / "grader.py").write_text(GRADER)
    out = tmp / "result.json"
    proc = harnessrl(
        "eval", "--model", vllm_engine.openai_base_url, "--tasks", str(tasks), "--limit", "3",
        "--harness", f"{sys.executable} {tmp / 'harness.py'} {ids[1]}",
        "--grader", f"{sys.executable} {tmp / 'grader.py'} {ids[2]}",
        # the wrappers exec the calc example's scripts, which their argv does not name
        "--sandbox", json.dumps({"read_only_paths": [str(CALC)]}),
        "-k", str(K), "--temperature", "0.8", "--max-tokens", "48", "--out", str(out),
        "--state-dir", str(tmp / "state"), "--redis-url", redis_url, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    yield {"proc": proc, "result": json.loads(out.read_text()), "out": out, "ids": ids,
           "tasks": tasks, "tmp": tmp, "redis_url": redis_url}


@pytest.mark.vllm
def test_eval_reports_pass_at_k_and_each_task_with_its_failures_named(
        evaluated: dict[str, Any], vllm_engine: Any) -> None:
    r, ids = evaluated["result"], evaluated["ids"]
    assert r["format"] == "harnessrl.eval/1"
    assert r["model"] == {"kind": "url", "served_name": vllm_engine.model_name,
                          "url": vllm_engine.base_url}
    assert r["tasks_file"] == str(evaluated["tasks"])
    assert r["tasks_sha256"] == hashlib.sha256(evaluated["tasks"].read_bytes()).hexdigest()
    assert (r["tasks_in_file"], r["tasks_evaluated"], r["limit"], r["k"]) == (5, 3, 3, K)
    assert r["sampling"] == {"temperature": 0.8, "top_p": None, "max_tokens": 48}
    assert list(r["metrics"]) == ["pass@1", "pass@2", "avg@2"]
    m = r["metrics"]
    assert 0.0 <= m["pass@1"] <= m["pass@2"] <= 1.0 and 0.0 <= m["avg@2"] <= 1.0
    assert set(r["timings"]) >= {"start_s", "rollouts_s", "total_s"}
    assert [t["task_id"] for t in r["tasks"]] == ids
    assert (r["samples"], r["samples_failed"]) == (6, 2)
    assert r["calls_mean"] > 0
    by_task = {t["task_id"]: t for t in r["tasks"]}
    for t in r["tasks"]:
        assert t["n"] == K and t["c"] == sum(s["passed"] for s in t["samples"])
        assert t["pass@1"] == t["c"] / K
    crashed = by_task[ids[1]]
    assert crashed["rewards"][1] is None and crashed["rewards"][0] is not None
    (fail,) = crashed["failures"]
    assert fail["index"] == 1 and "exited with code 3" in fail["reason"]
    assert "boom" in fail["reason"]
    graded_badly = by_task[ids[2]]
    (fail,) = graded_badly["failures"]
    assert fail["index"] == 0 and "grad" in fail["reason"] and "not a reward" in fail["reason"]
    # the grader's own JSON (the calc grader's reason) rides along with each graded sample
    assert by_task[ids[0]]["samples"][0]["grader"]["reason"]
    # the recomputed metrics agree with the per-task counts
    from harnessrl.passk import pass_at_k
    assert m["pass@2"] == pytest.approx(sum(pass_at_k(K, t["c"], 2) for t in r["tasks"]) / 3)
    # progress as plain lines (not a terminal), a table, the page
    out = evaluated["proc"].stdout
    assert "[harnessrl] eval run" in out and "pass@1" in out
    page = evaluated["out"].with_suffix(".html").read_text()
    assert 'id="eval-metrics"' in page and "boom" in page


@pytest.mark.vllm
def test_every_sample_is_a_graded_rollout_in_the_store_never_in_a_stream(
        evaluated: dict[str, Any], tmp_path: Path) -> None:
    """The JSON's samples are the store's rollouts of the run: same ids, rewards, statuses;
    their calls recorded with token ids and logprobs under the imposed sampling; nothing
    published to any stream."""
    from conftest import StoreService

    r = evaluated["result"]
    store_info = r["store"]
    svc = StoreService(tmp_path / "store", store_info["redis_url"],
                       store_info["key_prefix"]).start()
    store = StoreClient.connect(svc.address)
    try:
        rollouts = {ro.rollout_id: ro for ro in
                    store.list_rollouts(r["run_id"], include_calls=True).rollouts}
        run = store.get_run(r["run_id"])
    finally:
        store.close()
        svc.stop()
    samples = [s for t in r["tasks"] for s in t["samples"]]
    assert {s["rollout_id"] for s in samples} == set(rollouts)
    assert run.spec.stream == "-" and run.spec.group_size == K
    for t in r["tasks"]:
        for s in t["samples"]:
            ro = rollouts[s["rollout_id"]]
            assert ro.task_id == t["task_id"] and ro.index_in_group == s["index"]
            assert ro.stream in ("", "-")
            if s["reward"] is None:
                assert ro.status == c.ROLLOUT_STATUS_FAILED and ro.error == s["error"]
                continue
            assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED and ro.has_reward
            assert ro.reward == s["reward"] and s["calls"] == len(ro.calls) > 0
            for call in ro.calls:
                assert call.completion_token_ids and len(call.logprobs) == \
                    len(call.completion_token_ids)
                imposed = json.loads(call.sampling_override_json)["imposed"]
                assert imposed == {"temperature": 0.8, "max_tokens": 48}
    keys = redis.Redis.from_url(evaluated["redis_url"]).keys(
        f"{store_info['key_prefix']}stream:*")
    assert keys == [], keys


@pytest.mark.vllm
def test_compare_puts_two_results_side_by_side(evaluated: dict[str, Any]) -> None:
    a = evaluated["result"]
    b = copy.deepcopy(a)  # the same evaluation, as if a later policy passed one more sample
    first = b["tasks"][0]
    first["c"] = min(K, first["c"] + 1)
    first["pass@1"] = first["c"] / K
    b["metrics"]["pass@1"] = sum(t["pass@1"] for t in b["tasks"]) / len(b["tasks"])
    tmp = evaluated["tmp"]
    (tmp / "b.json").write_text(json.dumps(b))
    proc = harnessrl("eval", "--compare", str(evaluated["out"]), str(tmp / "b.json"),
                     "--out", str(tmp / "diff.json"), "--html", str(tmp / "diff.html"),
                     cwd=tmp, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "B - A" in proc.stdout and "pass@1" in proc.stdout
    diff = json.loads((tmp / "diff.json").read_text())
    want = b["metrics"]["pass@1"] - a["metrics"]["pass@1"]
    assert diff["metrics"]["pass@1"]["diff"] == pytest.approx(want)
    assert diff["metrics"]["avg@2"]["diff"] == 0.0
    assert [t["task_id"] for t in diff["tasks"]] == evaluated["ids"]
    assert diff["tasks"][0]["diff_pass@1"] == pytest.approx(
        first["pass@1"] - a["tasks"][0]["pass@1"])
    assert diff["warnings"] == []
    page = (tmp / "diff.html").read_text()
    assert "result.json" in page and "b.json" in page and "B - A" in page


@pytest.mark.parametrize("args,message", [
    (["--tasks", "/nonexistent/tasks.jsonl"], "no such file"),
    (["-k", "0"], "must be >= 1"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--model", "/nonexistent/model"], "no such directory"),
    (["--compare", "/nonexistent/a.json", "/nonexistent/b.json"], "not a readable JSON"),
])
def test_bad_options_exit_non_zero_with_a_clear_message(tmp_path: Path, args: list[str],
                                                        message: str) -> None:
    proc = harnessrl("eval", *args, "--state-dir", str(tmp_path / "state"), cwd=tmp_path,
                     timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stdout + proc.stderr
    assert not (tmp_path / "state").exists()  # nothing was started


def test_a_task_file_that_is_not_jsonl_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"id": "a"}\nnot json\n')
    proc = harnessrl("eval", "--tasks", str(bad), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "line 2: not valid JSON" in proc.stdout + proc.stderr


def test_up_refuses_an_eval_task_file_that_is_not_there(tmp_path: Path) -> None:
    proc = harnessrl("up", "--eval-tasks", str(tmp_path / "nope.jsonl"), "--state-dir",
                     str(tmp_path / "state"), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "--eval-tasks" in proc.stdout + proc.stderr
    proc = harnessrl("up", "--eval-tasks", str(CALC / "tasks.jsonl"), "--eval-k", "0",
                     "--state-dir", str(tmp_path / "state"), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "--eval-k must be >= 1" in proc.stdout + proc.stderr
