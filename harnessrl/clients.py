"""Typed clients for the harnessrl services; the CLI, the services, the tests and outside
integrations all use these.

Each client wraps one generated stub. Built on a blocking channel (`StoreClient.connect`)
its methods return the response; built on an asyncio channel (`StoreClient.connect_async`)
they return awaitables of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Generic, TypeVar

import grpc

from harnessrl import rpc
from harnessrl.identity import Identity
from harnessrl.v1 import (
    common_pb2 as c,
    controller_pb2 as cpb,
    controller_pb2_grpc,
    gateway_pb2 as gpb,
    gateway_pb2_grpc,
    store_pb2 as spb,
    store_pb2_grpc,
    trainer_pb2 as tpb,
    trainer_pb2_grpc,
)

S = TypeVar("S")
# A `StoreClient` built by `connect_async`: the same methods, returning awaitables, which the
# generated stubs' types cannot say; typed Any where the services hold one.
AsyncStoreClient = Any


class _Client(Generic[S]):
    _stub_cls: Any
    peer: str  # the service's identity, which TLS verifies (harnessrl/identity.py)

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel, timeout: float = 30.0) -> None:
        self.channel = channel
        self.stub: S = self._stub_cls(channel)
        self.timeout = timeout

    @classmethod
    def connect(cls, address: str, timeout: float = 30.0,  # type: ignore[no-untyped-def]
                ident: Identity | None = rpc.OWN):
        """A client on a blocking channel, as `ident` (default: this process's identity,
        harnessrl/identity.py: $HARNESSRL_TLS_DIR, or a local stack's operator identity)."""
        return cls(rpc.channel(address, cls.peer, ident), timeout)

    @classmethod
    def connect_async(cls, address: str, timeout: float = 30.0,  # type: ignore[no-untyped-def]
                      ident: Identity | None = rpc.OWN):
        return cls(rpc.aio_channel(address, cls.peer, ident), timeout)

    def close(self) -> Any:
        return self.channel.close()


def _serialize(request: Any) -> bytes:
    return request.SerializeToString()  # type: ignore[no-any-return]


class StoreClient(_Client[store_pb2_grpc.StoreStub]):
    _stub_cls = store_pb2_grpc.StoreStub
    peer = "store"
    _record_calls: Any = None  # the RecordCalls multi-callable, made on first use

    def put_run(self, run: c.Run) -> c.Run:
        return self.stub.PutRun(spb.PutRunRequest(run=run), timeout=self.timeout)

    def get_run(self, run_id: str) -> c.Run:
        return self.stub.GetRun(c.GetRunRequest(run_id=run_id), timeout=self.timeout)

    def list_runs(self, limit: int = 100) -> spb.ListRunsResponse:
        return self.stub.ListRuns(spb.ListRunsRequest(limit=limit), timeout=self.timeout)

    def create_rollouts(self, rollouts: Iterable[c.Rollout]) -> spb.CreateRolloutsResponse:
        return self.stub.CreateRollouts(
            spb.CreateRolloutsRequest(rollouts=list(rollouts)), timeout=self.timeout
        )

    def start_attempt(self, rollout_id: str, attempt: int, workdir: str = "") -> c.Rollout:
        return self.stub.StartAttempt(
            spb.StartAttemptRequest(rollout_id=rollout_id, attempt=attempt, workdir=workdir),
            timeout=self.timeout,
        )

    def append_calls(self, calls: Iterable[c.Call], timeout: float | None = None
                     ) -> spb.AppendCallsResponse:
        return self.stub.AppendCalls(
            spb.AppendCallsRequest(calls=list(calls)), timeout=timeout or self.timeout
        )

    def record_calls(self) -> Any:
        """Opens a RecordCalls stream (asyncio channel): `await s.write(request)`, an
        AppendCallsRequest or its wire twin AppendCallsRequestBytes (the calls serialised
        already: the gateway's), then `await s.read()` gives its AppendCallsResponse; batches
        answered in order."""
        if self._record_calls is None:
            self._record_calls = self.channel.stream_stream(
                "/harnessrl.v1.Store/RecordCalls", request_serializer=_serialize,
                response_deserializer=spb.AppendCallsResponse.FromString,
                _registered_method=True)
        return self._record_calls()

    def get_gateway_state(self, rollout_id: str, attempt: int, known_next_seq: int = -1,
                          response_id: str = "", timeout: float | None = None
                          ) -> spb.GatewayState:
        return self.stub.GetGatewayState(
            spb.GetGatewayStateRequest(rollout_id=rollout_id, attempt=attempt,
                                       known_next_seq=known_next_seq, response_id=response_id),
            timeout=timeout or self.timeout)

    def report_reward(self, rollout_id: str, attempt: int, reward: float) -> c.Rollout:
        return self.stub.ReportReward(
            spb.ReportRewardRequest(rollout_id=rollout_id, attempt=attempt, reward=reward),
            timeout=self.timeout,
        )

    def finish_attempt(self, request: spb.FinishAttemptRequest) -> c.Rollout:
        return self.stub.FinishAttempt(request, timeout=self.timeout)

    def set_group_rewards(self, request: spb.SetGroupRewardsRequest
                          ) -> spb.SetGroupRewardsResponse:
        return self.stub.SetGroupRewards(request, timeout=self.timeout)

    def get_rollout(self, rollout_id: str, include_calls: bool = False) -> c.Rollout:
        return self.stub.GetRollout(
            spb.GetRolloutRequest(rollout_id=rollout_id, include_calls=include_calls),
            timeout=self.timeout,
        )

    def list_rollouts(self, run_id: str, group_id: str = "", include_calls: bool = False
                      ) -> spb.ListRolloutsResponse:
        return self.stub.ListRollouts(
            spb.ListRolloutsRequest(run_id=run_id, group_id=group_id,
                                    include_calls=include_calls),
            timeout=self.timeout,
        )

    def read_groups(self, stream: str = "train", consumer_group: str = "trainer",
                    consumer: str = "trainer-0", max_groups: int = 1, block_ms: int = 0,
                    include_calls: bool = True, max_deliveries: int = 0,
                    new_only: bool = False) -> spb.ReadGroupsResponse:
        return self.stub.ReadGroups(
            spb.ReadGroupsRequest(stream=stream, consumer_group=consumer_group,
                                  consumer=consumer, max_groups=max_groups, block_ms=block_ms,
                                  include_calls=include_calls, max_deliveries=max_deliveries,
                                  new_only=new_only),
            timeout=self.timeout + block_ms / 1000.0,
        )

    def nack_groups(self, entry_ids: Iterable[str], reason: str, max_deliveries: int,
                    redeliver: bool = False, stream: str = "train",
                    consumer_group: str = "trainer", consumer: str = "trainer-0",
                    include_calls: bool = True) -> spb.NackGroupsResponse:
        return self.stub.NackGroups(
            spb.NackGroupsRequest(stream=stream, consumer_group=consumer_group,
                                  consumer=consumer, entry_ids=list(entry_ids), reason=reason,
                                  max_deliveries=max_deliveries, redeliver=redeliver,
                                  include_calls=include_calls),
            timeout=self.timeout,
        )

    def list_dead_letters(self, stream: str = "train", limit: int = 100
                          ) -> spb.ListDeadLettersResponse:
        return self.stub.ListDeadLetters(spb.ListDeadLettersRequest(stream=stream, limit=limit),
                                         timeout=self.timeout)

    def trim_groups(self, below_entry_id: str = "", stream: str = "train"
                    ) -> spb.TrimGroupsResponse:
        return self.stub.TrimGroups(
            spb.TrimGroupsRequest(stream=stream, below_entry_id=below_entry_id),
            timeout=self.timeout)

    def put_state(self, namespace: str, key: str, value: bytes) -> spb.PutStateResponse:
        return self.stub.PutState(spb.PutStateRequest(namespace=namespace, key=key, value=value),
                                  timeout=self.timeout)

    def delete_state(self, namespace: str, key: str) -> spb.DeleteStateResponse:
        return self.stub.DeleteState(spb.DeleteStateRequest(namespace=namespace, key=key),
                                     timeout=self.timeout)

    def get_state(self, namespace: str, key: str) -> bytes | None:
        r = self.stub.GetState(spb.GetStateRequest(namespace=namespace, key=key),
                               timeout=self.timeout)
        return r.value if r.found else None

    def list_state(self, namespace: str) -> spb.ListStateResponse:
        return self.stub.ListState(spb.ListStateRequest(namespace=namespace),
                                   timeout=self.timeout)

    def put_images(self, images: Iterable[spb.StoredImage], timeout: float | None = None,
                   rollout_id: str = "", max_rollout_bytes: int = 0,
                   present: Iterable[str] = ()) -> spb.PutImagesResponse:
        """Stores images in the content-addressed image store (docs/vision.md), those new to
        it counted against `rollout_id`'s `max_rollout_bytes` (0: no bound); of `present`,
        the hashes not stored are answered in `missing`."""
        return self.stub.PutImages(spb.PutImagesRequest(
            images=list(images), rollout_id=rollout_id, max_rollout_bytes=max_rollout_bytes,
            present=list(present)), timeout=timeout or self.timeout)

    def get_images(self, sha256: Iterable[str], timeout: float | None = None
                   ) -> spb.GetImagesResponse:
        """Images by hash, one per hash in order (`found` false for one not stored)."""
        return self.stub.GetImages(spb.GetImagesRequest(sha256=list(sha256)),
                                   timeout=timeout or self.timeout)

    def ack_groups(self, entry_ids: Iterable[str], stream: str = "train",
                   consumer_group: str = "trainer") -> spb.AckGroupsResponse:
        return self.stub.AckGroups(
            spb.AckGroupsRequest(stream=stream, consumer_group=consumer_group,
                                 entry_ids=list(entry_ids)),
            timeout=self.timeout,
        )


def dead_letters(store_address: str, stream: str = "train", limit: int = 100
                 ) -> list[spb.DeadLetter]:
    """The groups of `stream` that went to its dead-letter stream (failed `max_deliveries`
    times), newest first: what a `harnessrl deadletters` command shows."""
    client = StoreClient.connect(store_address)
    try:
        return list(client.list_dead_letters(stream, limit).dead_letters)
    finally:
        client.close()


class ControllerClient(_Client[controller_pb2_grpc.ControllerStub]):
    _stub_cls = controller_pb2_grpc.ControllerStub
    peer = "controller"

    def create_run(self, spec: c.RunSpec, run_id: str = "") -> c.Run:
        return self.stub.CreateRun(cpb.CreateRunRequest(spec=spec, run_id=run_id),
                                   timeout=self.timeout)

    def get_run(self, run_id: str) -> c.Run:
        return self.stub.GetRun(c.GetRunRequest(run_id=run_id), timeout=self.timeout)

    def list_rollouts(self, run_id: str, include_calls: bool = False
                      ) -> cpb.ListRunRolloutsResponse:
        return self.stub.ListRunRollouts(
            cpb.ListRunRolloutsRequest(run_id=run_id, include_calls=include_calls),
            timeout=self.timeout,
        )

    def cancel_run(self, run_id: str) -> c.Run:
        return self.stub.CancelRun(cpb.CancelRunRequest(run_id=run_id), timeout=self.timeout)

    def admission_update(self, run_id: str, groups_consumed: int, policy_version: int
                         ) -> cpb.AdmissionStatus:
        return self.stub.AdmissionUpdate(cpb.AdmissionUpdateRequest(
            run_id=run_id, groups_consumed=groups_consumed, policy_version=policy_version),
            timeout=self.timeout)

    def watch_run(self, run_id: str, timeout: float | None = None) -> Any:
        """Iterator (async iterator on an asyncio channel) of `RunEvent`s until the run ends."""
        return self.stub.WatchRun(cpb.WatchRunRequest(run_id=run_id), timeout=timeout)


class GatewayAdminClient(_Client[gateway_pb2_grpc.GatewayAdminStub]):
    _stub_cls = gateway_pb2_grpc.GatewayAdminStub
    peer = "gateway"

    def register_engine(self, name: str, base_url: str, model: str = "",
                        policy_version: int = 0, lora: gpb.LoraSupport | None = None
                        ) -> gpb.Engine:
        engine = gpb.Engine(name=name, base_url=base_url, model=model,
                            policy_version=policy_version, lora=lora)
        return self.stub.RegisterEngine(gpb.RegisterEngineRequest(engine=engine),
                                        timeout=self.timeout)

    def remove_engine(self, name: str) -> gpb.RemoveEngineResponse:
        return self.stub.RemoveEngine(gpb.RemoveEngineRequest(name=name), timeout=self.timeout)

    def list_engines(self) -> gpb.ListEnginesResponse:
        return self.stub.ListEngines(gpb.ListEnginesRequest(), timeout=self.timeout)

    def update_engine(self, name: str, policy_version: int | None = None,
                      state: int = gpb.ENGINE_STATE_UNSPECIFIED, reason: str = "") -> gpb.Engine:
        req = gpb.UpdateEngineRequest(name=name, state=state,  # type: ignore[arg-type]
                                      reason=reason)
        if policy_version is not None:
            req.policy_version = policy_version
        return self.stub.UpdateEngine(req, timeout=self.timeout)

    def pause(self, engines: Iterable[str] = (), drain: bool = True,
              drain_timeout_s: float = 60.0, adapter: str = "") -> gpb.PauseResponse:
        return self.stub.Pause(
            gpb.PauseRequest(engines=list(engines), drain=drain, drain_timeout_s=drain_timeout_s,
                             adapter=adapter),
            timeout=self.timeout + drain_timeout_s,
        )

    def resume(self, engines: Iterable[str] = (), adapter: str = "") -> gpb.ResumeResponse:
        return self.stub.Resume(gpb.ResumeRequest(engines=list(engines), adapter=adapter),
                                timeout=self.timeout)

    def set_adapter(self, engine: str, name: str, state: int, version: int | None = None,
                    lora_name: str = "", lora_path: str = "", reason: str = ""
                    ) -> gpb.Adapter:
        req = gpb.SetAdapterRequest(engine=engine, name=name, state=state,  # type: ignore[arg-type]
                                    lora_name=lora_name, lora_path=lora_path, reason=reason)
        if version is not None:
            req.policy_version = version
        return self.stub.SetAdapter(req, timeout=self.timeout)

    def remove_adapter(self, name: str, engines: Sequence[str] = (),
                       drain_timeout_s: float = 0.0) -> gpb.RemoveAdapterResponse:
        return self.stub.RemoveAdapter(gpb.RemoveAdapterRequest(
            name=name, engines=list(engines), drain_timeout_s=drain_timeout_s),
            timeout=self.timeout + (drain_timeout_s or 60.0))  # the gateway drains first


class TrainerClient(_Client[trainer_pb2_grpc.TrainerStub]):
    _stub_cls = trainer_pb2_grpc.TrainerStub
    peer = "trainer"

    def get_status(self) -> tpb.TrainerStatus:
        return self.stub.GetStatus(tpb.GetStatusRequest(), timeout=self.timeout)

    def checkpoint_now(self) -> tpb.CheckpointNowResponse:
        return self.stub.CheckpointNow(tpb.CheckpointNowRequest(), timeout=self.timeout)

    def stop(self, skip_checkpoint: bool = False) -> tpb.TrainerStatus:
        return self.stub.Stop(tpb.StopRequest(skip_checkpoint=skip_checkpoint),
                              timeout=self.timeout)
