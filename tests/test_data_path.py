"""The data path end to end: the example harness (official openai SDK, a subprocess knowing
nothing of harnessrl) runs under the controller, talks to a real vLLM through the gateway, gets
graded, and its trajectory sits in the store, token for token. Real Redis, real vLLM, real
gRPC services as processes."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from harnessrl.clients import ControllerClient, StoreClient
from harnessrl.local.stack import Stack, StackConfig
from harnessrl.v1 import common_pb2 as c

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "calc"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def spec(tasks: int, n: int, model: str, concurrency: int = 4) -> c.RunSpec:
    lines = (EXAMPLE / "tasks.jsonl").read_text().splitlines()[:tasks]
    return c.RunSpec(
        name="calc", tasks=[c.Task(task_id=json.loads(x)["id"], data_json=x) for x in lines],
        group_size=n, harness_command=[sys.executable, str(EXAMPLE / "harness.py")],
        grader_command=[sys.executable, str(EXAMPLE / "grader.py")],
        reward_source=c.REWARD_SOURCE_GRADER_JSON, concurrency=concurrency, timeout_s=180,
        max_attempts=2, model=model)


@pytest.fixture
def stack(tmp_path: Path, redis_url: str, key_prefix: str, vllm_engine) -> Stack:  # type: ignore[no-untyped-def]
    cfg = StackConfig(state_dir=tmp_path / "state", redis_url=redis_url, key_prefix=key_prefix,
                      served_model_name=vllm_engine.model_name,
                      external_engines=(vllm_engine.base_url,))
    with Stack(cfg) as s:
        yield s


def wait_run(stack: Stack, run_id: str, timeout: float = 900) -> c.Run:
    ctl = ControllerClient.connect(stack.controller_address)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = ctl.get_run(run_id)
        if run.status != c.RUN_STATUS_RUNNING:
            ctl.close()
            return run
        time.sleep(1)
    raise TimeoutError(f"run {run_id} still running after {timeout}s")


def check_trajectories(stack: Stack, run: c.Run, tok: PreTrainedTokenizerFast) -> int:
    """Every rollout has its reward and all of its calls; each call's completion token ids
    decode to exactly what the harness received, with one logprob per token. Returns the
    number of calls checked."""
    store = StoreClient.connect(stack.store_address)
    rollouts = store.list_rollouts(run.run_id, include_calls=True).rollouts
    store.close()
    assert len(rollouts) == run.num_rollouts
    checked = 0
    for ro in rollouts:
        assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED, (ro.rollout_id, ro.error)
        assert ro.has_reward and 0.0 <= ro.reward <= 1.0
        workdir = Path(ro.attempts[-1].workdir)
        received = [json.loads(x) for x in (workdir / "work" / "transcript.jsonl").read_text()
                    .splitlines()]
        # A model that fails to call the tool ends its run after one call (reward 0).
        assert len(ro.calls) == len(received) >= 1, ro.rollout_id
        for call, got in zip(ro.calls, received):
            assert len(call.logprobs) == len(call.completion_token_ids) > 0
            assert all(lp <= 0.0 for lp in call.logprobs)
            assert call.policy_version == 0 and call.engine == "engine0"
            assert len(call.prompt_token_ids) > 0
            text = tok.decode(call.completion_token_ids, skip_special_tokens=True)
            if got["tool_calls"]:
                full = tok.decode(call.completion_token_ids, skip_special_tokens=False)
                parsed = [json.loads(m) for m in TOOL_CALL.findall(full)]
                assert [(p["name"], p["arguments"]) for p in parsed] == [
                    (t["name"], json.loads(t["arguments"])) for t in got["tool_calls"]]
            else:
                assert text == (got["content"] or ""), (text, got["content"])
            message = json.loads(call.response_message_json)
            assert (message.get("content") or None) == (got["content"] or None)
            checked += 1
        # The first prompt is the harness's question, rendered by the chat template.
        task = json.loads(ro.task_json)
        assert task["question"] in tok.decode(ro.calls[0].prompt_token_ids)
    # The harness is multi-turn: question -> tool call -> tool result -> answer.
    multi = sum(len(ro.calls) >= 2 for ro in rollouts)
    assert multi >= 0.75 * len(rollouts), f"only {multi} of {len(rollouts)} runs had 2+ calls"
    return checked


def test_example_run_is_recorded_token_for_token(stack: Stack, tiny_model_dir: Path) -> None:
    ctl = ControllerClient.connect(stack.controller_address)
    run = ctl.create_run(spec(tasks=4, n=4, model=stack.cfg.served_model_name))
    ctl.close()
    run = wait_run(stack, run.run_id)
    assert run.status == c.RUN_STATUS_SUCCEEDED and run.num_succeeded == 16, run
    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    assert check_trajectories(stack, run, tok) >= 32
    # The four completed groups are in the trainer's stream.
    store = StoreClient.connect(stack.store_address)
    groups = store.read_groups(max_groups=10, block_ms=2000).groups
    store.close()
    assert sorted(len(g.rollouts) for g in groups) == [4, 4, 4, 4]


def test_store_killed_mid_run_loses_nothing(stack: Stack, tiny_model_dir: Path) -> None:
    ctl = ControllerClient.connect(stack.controller_address)
    run = ctl.create_run(spec(tasks=4, n=4, model=stack.cfg.served_model_name, concurrency=4))
    ctl.close()
    store = StoreClient.connect(stack.store_address, timeout=5)
    deadline = time.monotonic() + 300
    before: dict[str, list[c.Call]] = {}
    while time.monotonic() < deadline:  # wait until some calls are recorded, mid-run
        ros = store.list_rollouts(run.run_id, include_calls=True).rollouts
        before = {r.rollout_id: list(r.calls) for r in ros if r.calls}
        if sum(map(len, before.values())) >= 4:
            break
        time.sleep(0.2)
    store.close()
    assert before, "no calls recorded before the kill"
    stack.restart("store", kill=True)  # kill -9, then start again on the same port
    run = wait_run(stack, run.run_id)
    assert run.status == c.RUN_STATUS_SUCCEEDED and run.num_succeeded == 16, run
    store = StoreClient.connect(stack.store_address)
    after = {r.rollout_id: list(r.calls)
             for r in store.list_rollouts(run.run_id, include_calls=True).rollouts}
    store.close()
    for rid, calls in before.items():  # everything recorded before the kill is still there
        attempt = calls[0].attempt
        if after[rid] and after[rid][0].attempt == attempt:
            assert after[rid][:len(calls)] == calls
    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    check_trajectories(stack, run, tok)  # and every response a harness got is recorded
