"""Shared fixtures: a private Redis with AOF, service processes on port 0."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl import procs

REPO = Path(__file__).resolve().parent.parent


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
        ready = self.workdir / "store.ready"
        argv = procs.python_module(
            "services.store", "--bind", f"127.0.0.1:{port or self.port}",
            "--redis-url", self.redis_url, "--key-prefix", self.key_prefix,
            "--ready-file", str(ready))
        self.proc = procs.ServiceProcess("store", argv, self.workdir, ready_file=ready).start()
        self.port = self.proc.wait_ready(30)["grpc_port"]
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
