"""The store's Redis client: redis-py's asyncio client, its commands packed by hiredis.

redis-py parses replies with hiredis (C) in both of its clients, but packs commands with
hiredis only in the sync one: its asyncio connections encode each argument in Python. The
store's busiest command is one EVALSHA per batch of recorded calls, 14 arguments a call
(`call_log`), and packing them in Python cost about 6 of the store's 31 us of CPU per call
(measured with a batch of 8 calls on this 2-core machine). Every connection of the pool packs
with redis-py's own hiredis serializer instead, whatever the URL's connection class (TCP,
TLS, unix socket); what it sends is the same RESP.
"""

from __future__ import annotations

from typing import Any

import hiredis  # noqa: F401 - a dependency of the store (pyproject.toml): fail here without it
import redis.asyncio as aioredis
from redis.connection import HiredisRespSerializer

_PACKER = HiredisRespSerializer()


class _HiredisPacking:
    """Mixed in before a redis-py asyncio connection class: `pack_command` in C (pipelines
    pack each of their commands through it too)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return _PACKER.pack(*args)


def connect(url: str, **kwargs: Any) -> aioredis.Redis:
    """`redis.asyncio.Redis.from_url(url, **kwargs)`, its connections packing with hiredis."""
    client = aioredis.Redis.from_url(url, **kwargs)
    pool = client.connection_pool
    base = pool.connection_class
    pool.connection_class = type(f"Hiredis{base.__name__}", (_HiredisPacking, base), {})
    return client
