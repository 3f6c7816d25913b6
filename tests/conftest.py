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
