"""Every gRPC service under generated input (hypothesis, fixed seed, bounded count): the
store, the gateway's admin, the controller, the trainer.

At least half the inputs are well-formed requests with one field mutated; the others are
generated whole or are no protobuf at all (`harnessrl.testing.grpc_fuzz`). Each service must
answer every one with an explicit status (OK or one DESIGN.md names, never UNKNOWN or
INTERNAL), within a deadline (a hang fails; only RPCs that wait by design may run into it),
stay up and SERVING, and leave the data of rollouts, runs, streams and engines the fuzzer does
not own exactly as it was. Bytes that parse as no request get INVALID_ARGUMENT
(`harnessrl.rpc`; gRPC alone answers UNKNOWN).

`HARNESSRL_FUZZ_EXAMPLES` sets the inputs per service (default 120: about a minute for the
four); `python bench/fuzz_grpc.py` runs a longer count once and prints the tally.
"""

from __future__ import annotations

import collections
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from conftest import GatewayService, StoreService, StubEngineService, as_identity
from harnessrl import procs, rpc
from harnessrl.clients import ControllerClient, GatewayAdminClient, StoreClient
from harnessrl.testing.grpc_fuzz import Rpc, call, request_strategy
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import controller_pb2 as cpb
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.v1 import store_pb2 as spb
from harnessrl.v1 import trainer_pb2 as tpb

EXAMPLES = int(os.environ.get("HARNESSRL_FUZZ_EXAMPLES", "120"))
TIMEOUT_S = 5.0
BATCH = 150
EXPLICIT = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.OUT_OF_RANGE}
# RPCs that wait by design (for new groups, a run's end, a step, a drain)
MAY_WAIT = {"ReadGroups", "WatchRun", "CheckpointNow", "Pause"}
TALLY: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


def _rpcs(pb2: object, service: str, seeds: dict[str, object]) -> list[Rpc]:
    desc = pb2.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    missing = {m.name for m in desc.methods} - set(seeds)
    assert not missing, f"no seed request for {service}: {missing}"
    return [Rpc(desc.full_name, m, seeds[m.name]) for m in desc.methods]  # type: ignore[arg-type]


def fuzz(name: str, address: str, rpcs: list[Rpc], examples: int = EXAMPLES) -> list[str]:
    """Runs `examples` generated calls; returns the problems found (empty: none)."""
    problems: list[str] = []
    ch = rpc.channel(address, name.split("-")[0])

    def one(data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(rpcs), label="rpc")
        kind, payload = data.draw(request_strategy(r), label="request")
        code, details = call(ch, r, payload, TIMEOUT_S)
        TALLY[name][f"{kind}:{code.name}"] += 1
        TALLY[name]["inputs"] += 1
        ok = code in EXPLICIT or (code == grpc.StatusCode.DEADLINE_EXCEEDED and
                                  r.method.name in MAY_WAIT)
        if not ok:
            problems.append(f"{r.method.name} ({kind}, {len(payload)} bytes: "
                            f"{payload[:80]!r}): {code.name} {details[:300]}")

    try:
        # batches of BATCH inputs, each from its own fixed seed: one long hypothesis run grows
        # its memory without bound (3.5 GB after about 1,000 inputs), a batch stays ~120 MB
        for b in range(math.ceil(examples / BATCH)):
            n = min(BATCH, examples - b * BATCH)
            run = seed(b)(settings(max_examples=n, deadline=None, database=None,
                                   suppress_health_check=list(HealthCheck))(
                given(st.data())(one)))
            run()
    finally:
        ch.close()
    tally = TALLY[name]
    print(f"\n{name}: {dict(sorted(tally.items()))}")
    mutated = sum(n for k, n in tally.items() if k.startswith("mutated:"))
    assert mutated * 2 >= tally["inputs"], f"{mutated} of {tally['inputs']} inputs mutated"
    return problems


def serving(address: str, peer: str) -> bool:
    return rpc.health_check(address, timeout=5, peer=peer)


# -- the store -------------------------------------------------------------------------------
CANARY_STREAM = "canary-7f3a"


def _canary_store(store: StoreClient) -> None:
    store.put_run(c.Run(run_id="canary-run", spec=c.RunSpec(name="canary"),
                        status=c.RUN_STATUS_RUNNING))
    for i in range(2):
        rid = f"canary/g/{i}"
        store.create_rollouts([c.Rollout(rollout_id=rid, run_id="canary-run", task_id="t",
                                         group_id="canary/g", index_in_group=i, group_size=2,
                                         stream=CANARY_STREAM)])
        store.start_attempt(rid, 1)
        store.append_calls([c.Call(rollout_id=rid, attempt=1, seq=s, prompt_token_ids=[1, 2],
                                   completion_token_ids=[3], logprobs=[-0.5])
                            for s in range(3)])
        store.finish_attempt(spb.FinishAttemptRequest(
            rollout_id=rid, attempt=1, status=c.ROLLOUT_STATUS_SUCCEEDED, reward=i))
    store.put_state("canary", "k", b"v")


def _store_snapshot(store: StoreClient, r: redis.Redis, prefix: str) -> tuple[object, ...]:
    rollouts = [store.get_rollout(f"canary/g/{i}", include_calls=True).SerializeToString()
                for i in range(2)]
    return (rollouts, store.get_run("canary-run").SerializeToString(),
            [(e.key, e.value) for e in store.list_state("canary").entries],
            r.xrange(f"{prefix}stream:{CANARY_STREAM}"))


STORE_SEEDS: dict[str, object] = {
    "PutRun": spb.PutRunRequest(run=c.Run(run_id="fz-run", spec=c.RunSpec(name="fz"))),
    "GetRun": c.GetRunRequest(run_id="fz-run"),
    "ListRuns": spb.ListRunsRequest(limit=10),
    "CreateRollouts": spb.CreateRolloutsRequest(rollouts=[c.Rollout(
        rollout_id="fz/r1", run_id="fz-run", task_id="t", group_id="fz/g", group_size=1,
        stream="fz")]),
    "StartAttempt": spb.StartAttemptRequest(rollout_id="fz/r1", attempt=1),
    "AppendCalls": spb.AppendCallsRequest(calls=[c.Call(
        rollout_id="fz/r1", attempt=1, seq=0, prompt_token_ids=[1, 2],
        completion_token_ids=[3], logprobs=[-0.5])]),
    "RecordCalls": spb.AppendCallsRequest(calls=[c.Call(
        rollout_id="fz/r1", attempt=1, seq=1, prompt_token_ids=[1],
        completion_token_ids=[3], logprobs=[-0.5])], states=[spb.GatewayCallState(
            segment=True, n_messages=2, digest=b"d" * 16, settings=b"s" * 16, drop_seqs=[0],
            response_id="resp_1", previous_response_id="resp_0",
            messages_json=b'[{"role": "user", "content": "q"}]', keep_responses=8)]),
    "GetGatewayState": spb.GetGatewayStateRequest(rollout_id="fz/r1", attempt=1,
                                                  known_next_seq=-1, response_id="resp_1"),
    "ReportReward": spb.ReportRewardRequest(rollout_id="fz/r1", attempt=1, reward=0.5),
    "FinishAttempt": spb.FinishAttemptRequest(rollout_id="fz/r1", attempt=1,
                                              status=c.ROLLOUT_STATUS_SUCCEEDED, reward=1.0),
    "SetGroupRewards": spb.SetGroupRewardsRequest(group_id="fz/g", rewards=[
        spb.GroupReward(rollout_id="fz/r1", reward=0.5, reason="r",
                        parts=[c.RewardPart(name="judge", value=0.5)])]),
    "GetRollout": spb.GetRolloutRequest(rollout_id="fz/r1", include_calls=True),
    "ListRollouts": spb.ListRolloutsRequest(run_id="fz-run", include_calls=True),
    "ReadGroups": spb.ReadGroupsRequest(stream="fz", max_groups=2, include_calls=True),
    "AckGroups": spb.AckGroupsRequest(stream="fz", entry_ids=["0-1"]),
    "NackGroups": spb.NackGroupsRequest(stream="fz", entry_ids=["0-1"], reason="x",
                                        max_deliveries=3, redeliver=True),
    "ListDeadLetters": spb.ListDeadLettersRequest(stream="fz", limit=5),
    "TrimGroups": spb.TrimGroupsRequest(stream="fz"),
    "PutState": spb.PutStateRequest(namespace="fz", key="k", value=b"v"),
    "DeleteState": spb.DeleteStateRequest(namespace="fz", key="k"),
    "ListState": spb.ListStateRequest(namespace="fz"),
    "GetState": spb.GetStateRequest(namespace="fz", key="k"),
    "PutImages": spb.PutImagesRequest(images=[spb.StoredImage(
        media_type="image/png", data=b"\x89PNG\r\n\x1a\n-fz")]),
    "GetImages": spb.GetImagesRequest(sha256=["0" * 64]),
}


def test_fuzz_store(store_service: StoreService, redis_url: str, key_prefix: str) -> None:
    store = StoreClient.connect(store_service.address, timeout=10)
    r = redis.Redis.from_url(redis_url)
    try:
        _canary_store(store)
        before = _store_snapshot(store, r, key_prefix)
        from harnessrl.v1 import store_pb2
        problems = fuzz("store", store_service.address,
                        _rpcs(store_pb2, "Store", STORE_SEEDS))
        assert store_service.proc is not None and store_service.proc.alive
        assert serving(store_service.address, "store")
        assert _store_snapshot(store, r, key_prefix) == before, "the canary data changed"
        assert not problems, "\n".join(problems[:20])
    finally:
        store.close()


# -- the gateway's admin ---------------------------------------------------------------------
def test_fuzz_gateway_admin(tmp_path: Path, store_service: StoreService,
                            stub_engine: StubEngineService) -> None:
    gateway = GatewayService(tmp_path / "gw", store_service.address,
                             [{"name": "canary-e", "base_url": stub_engine.base_url,
                               "model": "tiny", "policy_version": 4}])
    admin = GatewayAdminClient.connect(gateway.admin_address, timeout=10)

    def canary() -> tuple[object, ...]:
        e = {x.name: x for x in admin.list_engines().engines}["canary-e"]
        return e.base_url, e.model, e.policy_version, e.state
    try:
        before = canary()
        from harnessrl.v1 import gateway_pb2
        seeds: dict[str, object] = {
            "RegisterEngine": gpb.RegisterEngineRequest(engine=gpb.Engine(
                name="fz-e", base_url=stub_engine.base_url, model="tiny",
                lora=gpb.LoraSupport(enabled=True, base_adapter="zero", max_loras=4))),
            "RemoveEngine": gpb.RemoveEngineRequest(name="fz-e"),
            "ListEngines": gpb.ListEnginesRequest(),
            "UpdateEngine": gpb.UpdateEngineRequest(name="fz-e", policy_version=1,
                                                    state=gpb.ENGINE_STATE_READY),
            "Pause": gpb.PauseRequest(engines=["fz-e"], drain=False),
            "Resume": gpb.ResumeRequest(engines=["fz-e"]),
            "SetAdapter": gpb.SetAdapterRequest(engine="fz-e", name="fz-a", policy_version=1,
                                                lora_name="fz-a-v1", lora_path="/a",
                                                state=gpb.ENGINE_STATE_READY),
            "RemoveAdapter": gpb.RemoveAdapterRequest(engines=["fz-e"], name="fz-a",
                                                      drain_timeout_s=0.5),
            "Sync": gpb.SyncRequest(engines=["fz-e"], drain=True, drain_timeout_s=0.5,
                                    origin="fz-peer"),
        }
        problems = fuzz("gateway-admin", gateway.admin_address,
                        _rpcs(gateway_pb2, "GatewayAdmin", seeds))
        assert gateway.proc.alive
        admin.resume()  # a fuzzed Pause of every engine is legitimate
        assert serving(gateway.admin_address, "gateway")
        assert canary() == before, "the canary engine changed"
        assert not problems, "\n".join(problems[:20])
    finally:
        admin.close()
        gateway.stop()


# -- the controller --------------------------------------------------------------------------
def test_fuzz_controller(tmp_path: Path, store_service: StoreService) -> None:
    controller, info = procs.start_service(
        "controller", "services.controller",
        ["--bind", "127.0.0.1:0", "--store-address", store_service.address,
         "--gateway-url", "http://127.0.0.1:9/v1", "--secret-file", str(tmp_path / "secret"),
         "--workdir-root", str(tmp_path / "rollouts"), "--max-jobs", "2",
         "--store-request-retry-s", "2"], tmp_path / "controller", timeout=30)
    address = f"127.0.0.1:{info['grpc_port']}"
    client = ControllerClient.connect(address, timeout=30)
    spec = c.RunSpec(name="fz", tasks=[c.Task(task_id="t1", data_json='{"q": 1}')],
                     harness_command=["/bin/true"], grader_command=["/bin/true"],
                     reward_source=c.REWARD_SOURCE_GRADER_EXIT_CODE, stream="-", timeout_s=5)
    try:
        canary = client.create_run(spec, run_id="canary-run-c")
        for _ in client.watch_run("canary-run-c", timeout=60):
            pass
        before = (client.get_run("canary-run-c").SerializeToString(),
                  [r.SerializeToString() for r in client.list_rollouts("canary-run-c").rollouts])
        assert canary.run_id == "canary-run-c"
        from harnessrl.v1 import controller_pb2
        seeds: dict[str, object] = {
            "CreateRun": cpb.CreateRunRequest(spec=spec, run_id="fz-run-1"),
            "GetRun": c.GetRunRequest(run_id="fz-run-1"),
            "ListRunRollouts": cpb.ListRunRolloutsRequest(run_id="fz-run-1"),
            "CancelRun": cpb.CancelRunRequest(run_id="fz-run-1"),
            "WatchRun": cpb.WatchRunRequest(run_id="fz-run-1"),
            "AdmissionUpdate": cpb.AdmissionUpdateRequest(run_id="fz-run-1", groups_consumed=1,
                                                          policy_version=1),
        }
        problems = fuzz("controller", address, _rpcs(controller_pb2, "Controller", seeds))
        assert controller.alive
        assert serving(address, "controller")
        after = (client.get_run("canary-run-c").SerializeToString(),
                 [r.SerializeToString() for r in client.list_rollouts("canary-run-c").rollouts])
        assert after == before, "the canary run changed"
        assert not problems, "\n".join(problems[:20])
    finally:
        client.close()
        controller.stop()


# -- the trainer -----------------------------------------------------------------------------
@pytest.fixture
def trainer_server() -> Iterator[tuple[str, object]]:
    """The trainer's gRPC service (`ServerThread`) over a `TrainerControl` that a stand-in
    loop thread answers between "steps", as `train_sync` does."""
    from services.trainer.control import TrainerControl
    from services.trainer.server import ServerThread

    control = TrainerControl()
    server = ServerThread("127.0.0.1:0", control, ident=as_identity("trainer")).start()
    stop = threading.Event()

    def loop() -> None:
        step = 0
        while not stop.wait(0.05):
            step += 1
            control.update(step=step)
            for fut in control.take_checkpoint_requests():
                fut.set_result((f"/ckpt/step-{step}", step))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield f"127.0.0.1:{server.port}", control
    stop.set()
    t.join(5)
    server.stop()


def test_fuzz_trainer(trainer_server: tuple[str, object]) -> None:
    address, _ = trainer_server
    from harnessrl.v1 import trainer_pb2
    seeds: dict[str, object] = {"GetStatus": tpb.GetStatusRequest(),
                                "CheckpointNow": tpb.CheckpointNowRequest(),
                                "Stop": tpb.StopRequest(skip_checkpoint=True)}
    problems = fuzz("trainer", address, _rpcs(trainer_pb2, "Trainer", seeds),
                    examples=max(20, EXAMPLES // 3))
    assert serving(address, "trainer")
    assert not problems, "\n".join(problems[:20])


def test_run_specs_that_would_exhaust_the_controller_are_refused() -> None:
    """Found by the fuzzer at 2000 inputs: a group_size of 2^31-1 drove the controller out of
    memory building the run's rollouts."""
    from harnessrl.errors import InvalidArgument
    from services.controller import run_spec

    base = c.RunSpec(name="x", tasks=[c.Task(task_id=f"t{i}") for i in range(30)],
                     harness_command=["/bin/true"], grader_command=["/bin/true"])
    for change in ({"group_size": 2**31 - 1}, {"timeout_s": 1e308},
                   {"grader_timeout_s": 1e300},
                   {"max_rollout_image_bytes": -1}):  # (every image call of it refused 400)
        spec = c.RunSpec()
        spec.CopyFrom(base)
        for k, v in change.items():
            setattr(spec, k, v)
        with pytest.raises(InvalidArgument):
            run_spec.resolve_tasks(run_spec.normalize(spec, ("local",), "local"))
    spec = c.RunSpec()
    spec.CopyFrom(base)
    spec.group_size = 4000  # 30 x 4000 rollouts: over the per-run bound
    with pytest.raises(InvalidArgument, match="rollouts per run"):
        run_spec.resolve_tasks(run_spec.normalize(spec, ("local",), "local"))
    spec.group_size = 8
    assert len(run_spec.resolve_tasks(run_spec.normalize(spec, ("local",), "local"))) == 30
