"""A gateway that restarts and scales out, with the session's vLLM (the tiny model) and a real
multi-turn harness on the official `openai` SDK (harnessrl/testing/turns_harness.py):

- under the controller, a chat harness with tools and a Responses harness chaining 3 turns,
  with the gateway killed (kill -9) and started again on its ports between turns: both
  rollouts succeed, the chat's later turns CONTINUE its token segment, the chain resolves;
- two replicas on one store behind a round-robin proxy (a test double for a Kubernetes
  Service), a connection per request, so consecutive calls of a rollout reach different
  replicas: the recorded calls equal a one-gateway run of the same seeded harness, token for
  token.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import TEST_SECRET, GatewayReplica as Replica, StoreService
from harnessrl import procs
from harnessrl.clients import ControllerClient, StoreClient
from harnessrl.credentials import CredentialSigner
from harnessrl.testing import turns_harness
from harnessrl.local.balancer import Balancer
from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb

pytestmark = pytest.mark.vllm

HARNESS = Path(turns_harness.__file__)
SIGNER = CredentialSigner(TEST_SECRET.encode())


@dataclass
class World:
    tmp: Path
    store_svc: StoreService
    store: StoreClient
    gateway: Replica
    controller: ControllerClient
    engine: dict[str, object]
    model: str


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, redis_url: str, vllm_engine  # type: ignore[no-untyped-def]
          ) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("replicas")
    store_svc = StoreService(tmp / "store", redis_url, f"t{uuid.uuid4().hex[:10]}:").start()
    engine = {"name": "engine0", "base_url": vllm_engine.base_url,
              "model": vllm_engine.model_name}
    gateway = Replica(tmp / "gw", store_svc.address, engine)
    ready = tmp / "controller.ready"
    controller = procs.ServiceProcess("controller", procs.python_module(
        "services.controller", "--bind", "127.0.0.1:0", "--store-address", store_svc.address,
        "--gateway-url", gateway.url, "--workdir-root", str(tmp / "rollouts"),
        "--ready-file", str(ready)), tmp, env={"HARNESSRL_SECRET": TEST_SECRET},
        ready_file=ready).start()
    ctl = ControllerClient.connect(f"127.0.0.1:{controller.wait_ready()['grpc_port']}")
    store = StoreClient.connect(store_svc.address, timeout=10)
    yield World(tmp, store_svc, store, gateway, ctl, engine, vllm_engine.model_name)
    ctl.close()
    store.close()
    controller.stop()
    gateway.stop()
    store_svc.stop()


def _wait_for(paths: list[Path], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not there after {timeout_s}s: {paths}"
        time.sleep(0.1)


def _extends(later: c.Call, earlier: c.Call) -> bool:
    head = list(earlier.prompt_token_ids) + list(earlier.completion_token_ids)
    return list(later.prompt_token_ids[:len(head)]) == head


def test_rollouts_continue_across_gateway_restarts_between_turns(world: World) -> None:
    tasks = [{"mode": "chat", "turns": 3, "pause": True},
             {"mode": "responses", "turns": 3, "pause": True}]
    spec = c.RunSpec(
        name="restarts", model=world.model, group_size=1, concurrency=2, timeout_s=600,
        harness_command=[sys.executable, str(HARNESS)],
        grader_command=[sys.executable, str(HARNESS), "--grade"],
        env={"OPENAI_MODEL": world.model},
        tasks=[c.Task(data_json=json.dumps(t)) for t in tasks])
    run = world.controller.create_run(spec)
    deadline = time.monotonic() + 120
    while True:
        rollouts = world.controller.list_rollouts(run.run_id).rollouts
        workdirs = [Path(ro.attempts[-1].workdir) / "work" for ro in rollouts if ro.attempts]
        if len(workdirs) == 2:
            break
        assert time.monotonic() < deadline, "the rollouts did not start"
        time.sleep(0.2)
    restarts = []
    for turn in range(2):  # after turns 0 and 1: the gateway dies and comes back
        _wait_for([w / f"turn-{turn}.done" for w in workdirs])
        restarts.append(world.gateway.restart())
        for w in workdirs:
            (w / f"go-{turn}").write_text("")
    events = list(world.controller.watch_run(run.run_id, timeout=600))
    assert events[-1].kind == cpb.RunEvent.KIND_RUN_DONE
    print("gateway back in", [f"{s:.2f}s" for s in restarts])
    by_mode = {}
    for ro in world.controller.list_rollouts(run.run_id, include_calls=True).rollouts:
        workdir = Path(ro.attempts[-1].workdir)
        assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED, (
            ro.attempts[-1].error, (workdir / "stderr.log").read_text()[-2000:]
            if (workdir / "stderr.log").exists() else "")
        by_mode[json.loads(ro.task_json)["mode"]] = (ro, workdir)
    chat, _ = by_mode["chat"]
    assert [call.segment_start for call in chat.calls] == [
        c.SEGMENT_START_FIRST, c.SEGMENT_START_CONTINUED, c.SEGMENT_START_CONTINUED]
    assert all(_extends(chat.calls[k], chat.calls[k - 1]) for k in (1, 2))
    resp, workdir = by_mode["responses"]
    said = [json.loads(line)
            for line in (workdir / "work" / "transcript.jsonl").read_text().splitlines()]
    assert [s["previous"] for s in said] == [None, said[0]["id"], said[1]["id"]]
    assert [call.api for call in resp.calls] == ["responses"] * 3
    # the chain resolved across both restarts: each turn's prompt is the last one's + answer
    assert all(_extends(resp.calls[k], resp.calls[k - 1]) for k in (1, 2))
    assert [call.segment_start for call in resp.calls][1:] == [c.SEGMENT_START_CONTINUED] * 2


def _run_harness(world: World, url: str, mode: str, seed: int) -> list[c.Call]:
    """The harness as the controller would start it (a subprocess, environment only), on a
    rollout of its own: its recorded calls."""
    rid, proc = _start_harness(world, url, mode, seed)
    return _harness_calls(world, rid, proc)


def _start_harness(world: World, url: str, mode: str, seed: int, pause: bool = False,
                   rid: str = "") -> tuple[str, subprocess.Popen[str]]:
    rid = rid or f"direct/{uuid.uuid4().hex[:8]}/0"
    world.store.create_rollouts([c.Rollout(rollout_id=rid, run_id="direct", task_id="t",
                                            group_id=rid[:-2], group_size=1, max_attempts=1,
                                            stream="-")])
    world.store.start_attempt(rid, 1)
    workdir = world.tmp / "direct" / rid.replace("/", "_")
    workdir.mkdir(parents=True)
    task = {"mode": mode, "turns": 3, "seed": seed, "fresh_connections": True, "pause": pause}
    env = {**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": SIGNER.mint(rid, 1, 600),
           "OPENAI_MODEL": world.model, "HARNESSRL_TASK_JSON": json.dumps(task)}
    return rid, subprocess.Popen([sys.executable, str(HARNESS)], cwd=workdir, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _harness_calls(world: World, rid: str, proc: subprocess.Popen[str]) -> list[c.Call]:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return list(world.store.get_rollout(rid, include_calls=True).calls)


def _workdir(world: World, rid: str) -> Path:
    return world.tmp / "direct" / rid.replace("/", "_")


def _tokens(calls: list[c.Call]) -> list[tuple[object, ...]]:
    return [(call.seq, list(call.prompt_token_ids), list(call.completion_token_ids),
             call.segment_start, call.segment, call.reused_prompt_tokens, call.engine)
            for call in calls]


def test_two_replicas_alternating_record_what_one_gateway_records(world: World) -> None:
    one = {mode: _run_harness(world, world.gateway.url, mode, seed=5)
           for mode in ("chat", "responses")}
    second = Replica(world.tmp / "gw2", world.store_svc.address, world.engine)
    proxy = Balancer([("127.0.0.1", world.gateway.http_port),
                             ("127.0.0.1", second.http_port)]).start()
    try:
        two = {mode: _run_harness(world, proxy.url, mode, seed=5)
               for mode in ("chat", "responses")}
    finally:
        proxy.stop()
        second.stop()
    # every call went through a new connection, alternately to each replica
    assert proxy.connections[0] >= 3 and proxy.connections[1] >= 3, proxy.connections
    assert all(a != b for a, b in zip(proxy.order, proxy.order[1:]))
    for mode in ("chat", "responses"):
        assert len(two[mode]) == 3
        assert _tokens(two[mode]) == _tokens(one[mode]), mode
        assert [call.segment_start for call in two[mode]][1:] == \
            [c.SEGMENT_START_CONTINUED] * 2, mode


def test_a_rollout_moved_to_a_joining_replica_and_back_records_what_one_gateway_records(
        world: World) -> None:
    """Moves are exact: a chat and a Responses rollout whose owner, once a second replica has
    joined, is that replica: turn 0 through the first gateway alone, turn 1 through the new
    replica (its owner now: it reads the store once and continues the segment and the
    chain), turn 2 through the first again after the new one has left (owner again). The
    recorded calls equal a one-gateway run of the same seeded harness, token for token."""
    from harnessrl.v1 import gateway_pb2 as gpb
    from services.gateway.rendezvous import choose
    one = {mode: _run_harness(world, world.gateway.url, mode, seed=7)
           for mode in ("chat", "responses")}
    first = ("127.0.0.1", world.gateway.http_port)
    proxy = Balancer([first]).start()
    second = Replica(world.tmp / "gw-join", world.store_svc.address, world.engine)
    host = socket.gethostname()
    names = [f"{host}:{world.gateway.grpc_port}", f"{host}:{second.grpc_port}"]
    second.stop()  # its port (and so its name) is known: it joins after turn 0
    rids = {}
    for mode in ("chat", "responses"):
        rid = f"direct/{uuid.uuid4().hex[:8]}/0"
        while choose(rid, names) != names[1]:
            rid = f"direct/{uuid.uuid4().hex[:8]}/0"
        rids[mode] = rid
    try:
        started = {mode: _start_harness(world, proxy.url, mode, seed=7, pause=True, rid=rid)
                   for mode, rid in rids.items()}
        workdirs = [_workdir(world, rid) for rid in rids.values()]
        _wait_for([w / "turn-0.done" for w in workdirs])
        second.proc = second.proc.respawn()
        second.proc.wait_ready(30)
        deadline = time.monotonic() + 30
        while True:  # the first lists the second: both views have both owners
            rec = gpb.GatewayReplica.FromString(
                world.store.get_state("gateway-replicas", names[0]) or b"")
            if names[1] in rec.peers:
                break
            assert time.monotonic() < deadline, "the first replica did not list the second"
            time.sleep(0.2)
        proxy.backends, proxy._next = [("127.0.0.1", second.http_port)], 0
        for w in workdirs:
            (w / "go-0").write_text("")
        _wait_for([w / "turn-1.done" for w in workdirs])
        served = httpx.get(f"http://127.0.0.1:{second.http_port}/metrics").text
        second.stop()  # SIGTERM: it drains and leaves
        proxy.backends, proxy._next = [first], 0
        for w in workdirs:
            (w / "go-1").write_text("")
        moved = {mode: _harness_calls(world, rid, started[mode][1])
                 for mode, rid in rids.items()}
    finally:
        proxy.stop()
        second.stop()
    # turn 1 was served by the second replica itself (it owned both rollouts: no forward)
    for route in ("/v1/chat/completions", "/v1/responses"):
        assert f'harnessrl_gateway_requests_total{{route="{route}",status="200"}} 1.0' \
            in served, served
    assert "harnessrl_gateway_forwarded_calls_total 0.0" in served, served
    for mode in ("chat", "responses"):
        assert len(moved[mode]) == 3
        assert _tokens(moved[mode]) == _tokens(one[mode]), mode
        assert [call.segment_start for call in moved[mode]][1:] == \
            [c.SEGMENT_START_CONTINUED] * 2, mode
