"""Shared fixtures: a private Redis with AOF, service processes on port 0, the session's PKI.

Authentication is on in every test, as in production: `pytest_configure` makes a CA with every
identity (harnessrl/pki.py) once per session. Services the tests start get their own identity
from it ($HARNESSRL_TLS_ROOT, harnessrl/procs.py `identity_env`); the test process itself calls
as `admin` (allowed everything), so a test reads any state from outside; tests/test_auth*.py
check the table with each identity.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl import engine_guard, identity, pki, procs
from harnessrl.clients import StoreClient

REPO = Path(__file__).resolve().parent.parent
TEST_PKI: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global TEST_PKI
    import tempfile
    TEST_PKI = Path(tempfile.mkdtemp(prefix="harnessrl-pki-"))
    pki.Pki(TEST_PKI).ensure(pki.ALL_IDENTITIES)
    os.environ[procs.TLS_ROOT_ENV] = str(TEST_PKI)
    os.environ[identity.TLS_DIR_ENV] = str(TEST_PKI / "admin")
    # The engine key (harnessrl/engine_guard.py) the session's engines accept and its clients send
    os.environ[engine_guard.API_KEY_ENV + "_FILE"] = str(
        engine_guard.EngineKeys.ensure(TEST_PKI / "engine-keys").api_key_file)


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil
    if TEST_PKI is not None:
        shutil.rmtree(TEST_PKI, ignore_errors=True)


def as_identity(name: str) -> identity.Identity:
    """The session PKI's `name` identity (to call a service as that identity)."""
    assert TEST_PKI is not None
    return identity.Identity.from_folder(TEST_PKI / name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The container tests run last: their images may still be building in the background
    (.ci/run starts `scripts/images.sh` before the suite; the fixture waits for it)."""
    items.sort(key=lambda item: item.get_closest_marker("containers") is not None)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of the test session's own (AOF on), on a free port."""
    url, proc = procs.start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.stop()


@pytest.fixture
def key_prefix() -> str:
    """A fresh key namespace per test, so tests sharing the Redis never see each other's data."""
    return f"t{uuid.uuid4().hex[:10]}:"


class StoreService:
    """A real store process (`python -m services.store`) on port 0."""

    def __init__(self, workdir: Path, redis_url: str, key_prefix: str) -> None:
        self.workdir = workdir
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.proc: procs.ServiceProcess | None = None
        self.port = 0

    def start(self, port: int = 0) -> "StoreService":
        self.proc, info = procs.start_service(
            "store", "services.store",
            ["--bind", f"127.0.0.1:{port or self.port}", "--redis-url", self.redis_url,
             "--key-prefix", self.key_prefix], self.workdir, timeout=30)
        self.port = info["grpc_port"]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@pytest.fixture
def store_service(tmp_path: Path, redis_url: str, key_prefix: str) -> Iterator[StoreService]:
    svc = StoreService(tmp_path / "store", redis_url, key_prefix).start()
    yield svc
    svc.stop()


TEST_SECRET = "test-secret-0123456789abcdef0123456789"


def running_rollout(store: StoreClient, secret: bytes | None = None) -> tuple[str, str]:
    """A new one-rollout group with its first attempt started, and that attempt's key (signed
    with `secret`, default TEST_SECRET, 10 minutes)."""
    from harnessrl.credentials import CredentialSigner
    from harnessrl.v1 import common_pb2 as c

    rid = f"run/{uuid.uuid4().hex[:8]}/0"
    store.create_rollouts([c.Rollout(rollout_id=rid, run_id="run", task_id="t",
                                     group_id=rid[:-2], group_size=1, max_attempts=1,
                                     stream="-")])
    store.start_attempt(rid, 1)
    return rid, CredentialSigner(secret or TEST_SECRET.encode()).mint(rid, 1, 600)


class StubEngineService:
    """`harnessrl.testing.stub_engine` in its own process: answers like vLLM, no model."""

    def __init__(self, workdir: Path, model: str = "tiny", *flags: str) -> None:
        self.model = model
        self.proc, info = procs.start_service("stub", "harnessrl.testing.stub_engine",
                                              ["--model", model, *flags], workdir, timeout=30)
        self.port = info["http_port"]
        self.base_url = f"http://127.0.0.1:{self.port}"


class GatewayService:
    """A real gateway process on port 0 in front of the given store."""

    def __init__(self, workdir: Path, store_address: str, engines: list[dict[str, object]],
                 *extra: str) -> None:
        import json as _json
        self.workdir = workdir
        self.proc, info = procs.start_service(
            "gateway", "services.gateway",
            ["--http-port", "0", "--grpc-bind", "127.0.0.1:0", "--store-address", store_address,
             "--engines", _json.dumps(engines), *extra], workdir,
            env={"HARNESSRL_GATEWAY_SECRET": TEST_SECRET}, timeout=30)
        self.http_port, self.grpc_port = info["http_port"], info["grpc_port"]
        self.base_url = f"http://127.0.0.1:{self.http_port}/v1"
        self.admin_address = f"127.0.0.1:{self.grpc_port}"

    def stop(self) -> None:
        self.proc.stop()


class GatewayReplica:
    """A gateway process on fixed ports (a restart keeps them), started again by `respawn`."""

    def __init__(self, workdir: Path, store_address: str, engine: dict[str, object],
                 *extra: str) -> None:
        import json as _json
        workdir.mkdir(parents=True, exist_ok=True)
        self.http_port, self.grpc_port = procs.free_port(), procs.free_port()
        self.proc, _ = procs.start_service(
            "gateway", "services.gateway",
            ["--http-port", str(self.http_port), "--grpc-bind", f"127.0.0.1:{self.grpc_port}",
             "--store-address", store_address, "--engines", _json.dumps([engine]), *extra],
            workdir, env={"HARNESSRL_GATEWAY_SECRET": TEST_SECRET}, timeout=30)
        self.admin_address = f"127.0.0.1:{self.grpc_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def restart(self) -> float:
        """kill -9, then the same command again: seconds until it is ready."""
        self.proc.kill()
        t0 = time.monotonic()
        self.proc = self.proc.respawn()
        self.proc.wait_ready(30)
        return time.monotonic() - t0

    def stop(self) -> None:
        self.proc.stop()


@pytest.fixture
def stub_engine(tmp_path: Path) -> Iterator[StubEngineService]:
    svc = StubEngineService(tmp_path / "stub")
    yield svc
    svc.proc.stop()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The project's tiny model (tied embeddings, warmed up), built once and cached across
    sessions under $HARNESSRL_CACHE_DIR (default ~/.cache/harnessrl)."""
    from harnessrl.model import build_tiny_model, default_model_dir

    return build_tiny_model(default_model_dir())


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One vLLM server on the tiny model for the whole test session (its start takes 60-95 s
    on 2 cores); hermes tool parsing on, dev-mode endpoints on, no weight-transfer backend.
    Its routes but /health need the session's engine key (`engine.headers`)."""
    from harnessrl.local.engine import start_engine

    engine = start_engine(tiny_model_dir, workdir=tmp_path_factory.mktemp("vllm"))
    try:
        engine.wait_healthy(timeout=300)
        yield engine
    finally:
        engine.stop(timeout=30)


@pytest.fixture(scope="session")
def vision_model_dir() -> Path:
    """The project's tiny VLM (default recipe), built once and cached like the text model."""
    from harnessrl.model.vision import build_vision_model, default_vision_model_dir

    return build_vision_model(default_vision_model_dir())


@pytest.fixture(scope="session")
def vision_engine(vision_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One vLLM server on the tiny VLM for the whole test session (its own: the text model's
    `vllm_engine` serves another model); started as the project starts every engine
    (`harnessrl.local.engine`), with the gloo weight-transfer backend: tests/test_vision_trainer.py
    pushes trained weights into it (and the base weights back after)."""
    from harnessrl.local.engine import start_engine

    engine = start_engine(vision_model_dir, workdir=tmp_path_factory.mktemp("vllm-vision"),
                          max_model_len=4096, weight_transfer_backend="gloo")
    try:
        engine.wait_healthy(timeout=300)
        yield engine
    finally:
        engine.stop(timeout=30)


@pytest.fixture(scope="session")
def docker_daemon() -> Iterator:
    """A Docker daemon for the container tests (`harnessrl.testing.dockerd`): the one
    DOCKER_HOST names if it answers, else a private dockerd, stopped by its pid at the end.
    No container runtime: the test skips, except with CI=true, where it fails."""
    from harnessrl.testing.dockerd import Dockerd

    try:
        daemon = Dockerd.find_or_start()
    except RuntimeError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and no container runtime: {exc}")
        pytest.skip(f"no container runtime: {exc}")
    yield daemon
    daemon.stop()


@pytest.fixture(scope="session")
def built_images(docker_daemon) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    """Every image docker-compose.yml's CPU profile uses, built by `scripts/images.sh
    --offline` (no registry here; HARNESSRL_IMAGES_ONLINE=1 uses the registry's bases), or
    reused when their input hashes are unchanged. Returns the script's report by name."""
    import json
    import subprocess
    import sys

    report = REPO / ".harnessrl" / "images-report.json"
    report.parent.mkdir(exist_ok=True)
    mode = [] if os.environ.get("HARNESSRL_IMAGES_ONLINE") == "1" else ["--offline"]
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "images.py"), *mode,
                          "--report", str(report)], env=docker_daemon.env, timeout=3600,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout)
    return {row["name"]: row for row in json.loads(report.read_text())}


EXAMPLE_IMAGE = "harnessrl/example-harness:0.1.0"  # examples/calc/Dockerfile


@pytest.fixture(scope="module")
def example_image(built_images: dict[str, dict]) -> str:  # type: ignore[type-arg]
    """The example harness image, built (or reused) with the others."""
    assert EXAMPLE_IMAGE in {row["tag"] for row in built_images.values()}, built_images
    return EXAMPLE_IMAGE


CONTROLLER_SA = "harnessrl/harnessrl-controller"  # k8s/base: the controller's ServiceAccount


@pytest.fixture(scope="session")
def fake_kube_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The fake Kubernetes API server (`harnessrl.testing.fake_kube_apiserver`), in its own
    process, once per test session; its node "has" the image `harnessrl/harness:dev`. It
    enforces the RBAC of k8s/base, and its `.kubeconfig` is the controller's ServiceAccount's
    (namespace harnessrl)."""
    from harnessrl.testing.fake_kube_apiserver import FakeKubeAPIServer

    server = FakeKubeAPIServer(tmp_path_factory.mktemp("fake-kube"),
                               images=["harnessrl/harness:dev"], rbac=[REPO / "k8s" / "base"],
                               identity=CONTROLLER_SA).start()
    yield server
    server.stop()


@pytest.fixture
def fake_kube(fake_kube_server) -> Iterator:  # type: ignore[no-untyped-def]
    """The session's fake API server, for one test: every request it gets during the test
    (the backend's, the controller's, the test's own reads) must come as the controller's
    ServiceAccount, so the test shows what that account's Role allows."""
    since = fake_kube_server.stats()["requests"]
    yield fake_kube_server
    others = {q["user"] for q in fake_kube_server.requests(since)} - {fake_kube_server.user}
    assert not others, f"requests to the fake API server as {others}, not as the controller"


def wait_aof_written(data_dir: Path, marker: str, timeout: float = 10.0) -> None:
    """Returns once a write bearing `marker` (a key, a value) is in the AOF files of the Redis
    whose data dir is `data_dir`, read back from the kernel. Under `appendfsync everysec` Redis
    replies before that write while a background fsync is slow (a loaded disk) and holds it
    back for up to 2 s: a kill -9 in that window loses acknowledged writes
    (docs/reliability.md). A test that kills Redis to show that one write survives waits here
    first, so it tests that write's survival, not Redis's window. (Files, not INFO's
    `aof_buffer_length`: the stack's ACL user may not run INFO.)"""
    want = marker.encode()
    deadline = time.monotonic() + timeout
    while not any(want in f.read_bytes() for f in data_dir.glob("appendonlydir/*.aof")):
        assert time.monotonic() < deadline, f"{marker!r} is not in the AOF of {data_dir}"
        time.sleep(0.02)


class RestartableRedis:
    """A private redis-server (AOF on) that a test can stop, kill -9 and start again on the
    same port and data dir (the session's `redis_url` server is shared and stays up)."""

    def __init__(self, data_dir: Path, appendfsync: str = "everysec") -> None:
        self.data_dir = data_dir
        self.appendfsync = appendfsync
        self.port = procs.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: procs.ServiceProcess | None = None

    def start(self) -> "RestartableRedis":
        _, self.proc = procs.start_redis(self.data_dir, self.port,
                                         appendfsync=self.appendfsync)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def kill(self) -> None:
        """kill -9: no shutdown, no final fsync."""
        if self.proc is not None:
            self.proc.kill()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RestartableRedis]:
    r = RestartableRedis(tmp_path / "own-redis").start()
    yield r
    r.stop()
