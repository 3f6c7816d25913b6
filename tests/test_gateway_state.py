"""The gateway's engine registry lives in the store: a gateway killed with kill -9 and started
again with the same flags serves at once with the engines, policy versions and states its
earlier life was given. Real store, Redis, gateway processes and the stub engine."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from conftest import GatewayService, StoreService, StubEngineService
from harnessrl.clients import GatewayAdminClient, StoreClient
from harnessrl.v1 import gateway_pb2 as gpb
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
        time.sleep(1.5)
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
