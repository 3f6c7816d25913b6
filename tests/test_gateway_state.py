"""The gateway's engine registry lives in the store: a gateway killed with kill -9 and started
again with the same flags serves at once with the engines, policy versions and states its
earlier life was given. Real store, Redis, gateway processes and the stub engine."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from conftest import GatewayService, StoreService, StubEngineService
from harnessrl.clients import GatewayAdminClient, StoreClient
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.v1 import store_pb2 as spb
from services.gateway.engines import EngineRegistry
from services.gateway.registry_state import RegistryState
from test_gateway import SIGNER, World, chat


def test_restarted_gateway_serves_at_once_with_its_registry(
        tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService) -> None:
    world = World(tmp_path, store_service, [stub_engine])
    store = StoreClient.connect(store_service.address, timeout=10)
    try:
        admin = world.admin
        admin.update_engine("e0", policy_version=7)
        admin.register_engine("late", stub_engine.base_url + "/v1", "tiny", policy_version=3)
        admin.update_engine("late", state=gpb.ENGINE_STATE_MARKED, reason="push failed")
        admin.register_engine("gone", "http://127.0.0.1:9", "tiny")
        admin.remove_engine("gone")
        before = {e.name: e for e in admin.list_engines().engines}

        world.gateway.proc.kill()  # kill -9: nothing saved on the way out
        world.gateway = GatewayService(tmp_path / "gw2", store_service.address,
                                       [{"name": "e0", "base_url": stub_engine.base_url,
                                         "model": "tiny"}])  # the same flags: version 0
        world.admin.close()
        world.admin = admin = GatewayAdminClient.connect(world.gateway.admin_address)
        after = {e.name: e for e in admin.list_engines().engines}
        assert set(after) == {"e0", "late"}
        assert after["e0"].policy_version == 7 and after["e0"].state == gpb.ENGINE_STATE_READY
        assert after["late"].policy_version == 3
        assert after["late"].state == gpb.ENGINE_STATE_MARKED
        assert after["late"].reason == "push failed"
        for name in after:
            assert after[name].base_url == before[name].base_url

        # the first call after the restart is served and recorded with the stored version
        rid = world.rollout()
        chat(world.client(SIGNER.mint(rid, 1, 60)))
        assert [c.policy_version for c in world.calls(rid)] == [7]
        assert [c.engine for c in world.calls(rid)] == ["e0"]  # never the MARKED one

        # a paused engine stays paused across a restart (until the trainer resumes it)
        admin.pause(["e0"], drain=False)
        world.gateway.proc.kill()
        world.gateway = GatewayService(tmp_path / "gw3", store_service.address, [])
        world.admin.close()
        world.admin = admin = GatewayAdminClient.connect(world.gateway.admin_address, timeout=30)
        engines = {e.name: e for e in admin.list_engines().engines}
        assert engines["e0"].paused and engines["e0"].policy_version == 7
        admin.resume()
        assert not any(e.paused for e in admin.list_engines().engines)
        # a change while the store restarts waits for it, and is saved
        store_service.kill()
        done: list[gpb.Engine] = []
        t = threading.Thread(target=lambda: done.append(
            admin.update_engine("e0", policy_version=8)))
        t.start()
        # past replica_ttl_s (5 s): the gateway's announcement expires, and the heartbeat that
        # renews it once the store is back reads the registry again, while the change is
        # still being saved: the change stays (the store's older record does not replace it)
        time.sleep(6)
        assert not done, "answered before the store had it"
        store_service.start()  # same port
        t.join(30)
        assert done and done[0].policy_version == 8
        engines = {e.name: e for e in admin.list_engines().engines}
        assert engines["e0"].policy_version == 8
        # what the store holds is what ListEngines shows
        stored = {e.key: gpb.Engine.FromString(e.value)
                  for e in store.list_state("gateway-engines").entries}
        assert {k: (v.policy_version, v.state, v.paused) for k, v in stored.items()} == {
            "e0": (8, gpb.ENGINE_STATE_READY, False),
            "late": (3, gpb.ENGINE_STATE_MARKED, False)}
    finally:
        store.close()
        world.close()


class SlowWriteStore:
    """A test double of the store's state calls (AsyncStoreClient's put_state, delete_state,
    list_state): it holds records in a dict, and a write waits until `release` is set (a store
    that is down while the write retries); `then_put` (key, value) lands just after a write
    (a peer's write of the same key that reaches the store later)."""

    def __init__(self) -> None:
        self.records: dict[str, bytes] = {}
        self.release = asyncio.Event()
        self.then_put: tuple[str, bytes] | None = None

    async def put_state(self, namespace: str, key: str, value: bytes) -> None:
        await self.release.wait()
        self.records[key] = value
        if self.then_put is not None:
            k, v = self.then_put
            self.records[k], self.then_put = v, None

    async def delete_state(self, namespace: str, key: str) -> None:
        await self.release.wait()
        self.records.pop(key, None)

    async def list_state(self, namespace: str) -> spb.ListStateResponse:
        return spb.ListStateResponse(entries=[spb.StateEntry(key=k, value=v)
                                              for k, v in self.records.items()])


async def test_a_reload_while_a_change_is_being_saved_keeps_the_change() -> None:
    """The race the test above can meet (a heartbeat that catches up, reading the registry,
    while an UpdateEngine waits for the store): the engine being saved keeps its own state;
    the others take the store's."""
    registry = EngineRegistry()
    for name in ("e0", "e1"):
        registry.register(name, "http://127.0.0.1:9/v1", "tiny", 7)
    store = SlowWriteStore()
    state = RegistryState(store, "gateway-engines")  # type: ignore[arg-type]
    for name, version in (("e0", 7), ("e1", 9)):  # e1: a peer's change
        store.records[name] = gpb.Engine(name=name, base_url="http://127.0.0.1:9", model="tiny",
                                         policy_version=version).SerializeToString()
    saving = asyncio.create_task(state.save(registry.update("e0", 8, gpb.ENGINE_STATE_UNSPECIFIED, "")))
    await asyncio.sleep(0)  # the save waits for the store
    await state.reload(registry, [], 5)  # the catch-up reads the store's older e0
    assert registry.engines["e0"].policy_version == 8, "the change in flight was undone"
    assert registry.engines["e1"].policy_version == 9
    store.release.set()
    await saving
    assert gpb.Engine.FromString(store.records["e0"]).policy_version == 8
    await state.reload(registry, [], 5)  # saved: the store's record is this replica's again
    assert registry.engines["e0"].policy_version == 8


async def test_a_peers_change_saved_after_this_replicas_is_taken_once_the_save_is_done() -> None:
    """A reload skips e0 while this replica saves version 8; a peer's version 9 of e0 then
    reaches the store after this replica's write. When the save is done, e0 is read again:
    this replica serves the store's (the peer's) version, not its own."""
    registry = EngineRegistry()
    registry.register("e0", "http://127.0.0.1:9/v1", "tiny", 7)
    store = SlowWriteStore()
    state = RegistryState(store, "gateway-engines")  # type: ignore[arg-type]
    saving = asyncio.create_task(state.save(registry.update("e0", 8, gpb.ENGINE_STATE_UNSPECIFIED, "")))
    await asyncio.sleep(0)  # the save waits for the store
    await state.reload(registry, ["e0"], 5)  # the peer's notice: e0 is being saved, skipped
    assert registry.engines["e0"].policy_version == 8
    peer = gpb.Engine(name="e0", base_url="http://127.0.0.1:9", model="tiny", policy_version=9)
    store.then_put = ("e0", peer.SerializeToString())  # the peer's write lands after ours
    store.release.set()
    await saving
    assert registry.engines["e0"].policy_version == 9, "the peer's later change was dropped"
