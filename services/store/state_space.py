"""Services' own small durable state (`Store.PutState` and friends): `P state:{namespace}`, a
HASH key -> bytes per namespace (the gateway keeps its engine registry here, the judge its
cache). A namespace holds at most `max_keys` keys: the put script checks it atomically."""

from __future__ import annotations

import redis.asyncio as aioredis

from harnessrl.errors import InvalidArgument, ResourceExhausted

_PUT_STATE_LUA = """
-- KEYS: state hash; ARGV: key, value, max keys. 1 stored, -1 namespace full.
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and
   redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


def require(value: str, what: str) -> str:
    """`value`, or InvalidArgument when it is empty."""
    if not value:
        raise InvalidArgument(f"{what} is required")
    return value


class StateSpace:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.r = redis
        self.prefix = prefix
        self._put = redis.register_script(_PUT_STATE_LUA)

    def _key(self, namespace: str) -> str:
        return f"{self.prefix}state:{require(namespace, 'namespace')}"

    async def put(self, namespace: str, key: str, value: bytes, max_keys: int) -> None:
        if await self._put(keys=[self._key(namespace)],
                           args=[require(key, "key"), value, max_keys]) == -1:
            raise ResourceExhausted(f"state namespace {namespace!r} holds {max_keys} keys")

    async def delete(self, namespace: str, key: str) -> bool:
        return bool(await self.r.hdel(self._key(namespace), require(key, "key")))

    async def get(self, namespace: str, key: str) -> bytes | None:
        value = await self.r.hget(self._key(namespace), require(key, "key"))
        return None if value is None else bytes(value)

    async def list(self, namespace: str) -> list[tuple[str, bytes]]:
        items = await self.r.hgetall(self._key(namespace))
        return sorted((k.decode("utf-8", "replace"), bytes(v)) for k, v in items.items())
