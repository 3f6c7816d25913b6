"""The image store (`Store.PutImages`, `Store.GetImages`; issue #45): the bytes of the images
that recorded calls carry (`Call.images`), content-addressed.

Keys (under the store's prefix P):

- `P img:{sha256}` HASH `t` -> media type, `d` -> the image's bytes. The key is the sha256 of
  the bytes, computed here: a caller's hash that does not match is refused, so a key always
  holds the bytes it names and a write never changes what a stored call refers to.
- `P img:bytes` the bytes stored under `img:*` in all, which `max_store_bytes` bounds.
- `P img:ro:{rollout_id}` the bytes of the images a rollout's calls stored first (its
  gateway names the rollout and its bound, `PutImagesRequest.max_rollout_bytes`), kept for
  `ROLLOUT_COUNT_TTL_S` after its last new image.

A batch is written by one Lua script: images stored already are left as they are and cost
nothing (a harness resends a conversation's images every turn: each is kept once), and a batch
that would take the total over the store's bound, or its rollout's over the rollout's, stores
nothing (RESOURCE_EXHAUSTED; the rollout's case names "rollout image quota"). So one rollout's
harness can take at most its bound of the store, not all of it. Images are not deleted yet: a
deployment sizes `max_store_bytes` (and Redis's memory) for its runs' images.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import redis.asyncio as aioredis

from harnessrl.errors import InvalidArgument, ResourceExhausted
from harnessrl.v1 import store_pb2 as spb

MEDIA_TYPES = frozenset(("image/png", "image/jpeg", "image/gif", "image/webp"))
_HEX = re.compile(r"[0-9a-f]{64}")
MAX_PER_REQUEST = 1024  # images per PutImages / GetImages request

ROLLOUT_COUNT_TTL_S = 7 * 24 * 3600  # a rollout's count outlives any of its calls
QUOTA = "rollout image quota"  # how a refusal for a rollout's bound starts

_PUT_LUA = """
-- KEYS: total, the rollout's count (or the total again when none), then one key per image;
-- ARGV: max total, max for the rollout (0: none), the count's TTL, then media type and bytes
-- of each image. Returns {0, stored, existing, rollout's bytes}, {1, total} when the new images
-- would take the total over its bound, {2, rollout's bytes} over the rollout's; nothing is
-- stored in those two cases.
local seen, order, size = {}, {}, 0
for i = 3, #KEYS do
  if not seen[KEYS[i]] and redis.call('EXISTS', KEYS[i]) == 0 then
    seen[KEYS[i]] = true
    order[#order + 1] = i
    size = size + #ARGV[2 * i - 1]
  end
end
local total = tonumber(redis.call('GET', KEYS[1]) or '0')
if size > 0 and total + size > tonumber(ARGV[1]) then return {1, total} end
local rollout = 0
if KEYS[2] ~= KEYS[1] then
  rollout = tonumber(redis.call('GET', KEYS[2]) or '0')
  local most = tonumber(ARGV[2])
  if size > 0 and most > 0 and rollout + size > most then return {2, rollout} end
end
for _, i in ipairs(order) do
  redis.call('HSET', KEYS[i], 't', ARGV[2 * i - 2], 'd', ARGV[2 * i - 1])
end
if size > 0 then
  redis.call('INCRBY', KEYS[1], size)
  if KEYS[2] ~= KEYS[1] then
    rollout = redis.call('INCRBY', KEYS[2], size)
    redis.call('EXPIRE', KEYS[2], ARGV[3])
  end
end
return {0, #order, #KEYS - 2 - #order, rollout}
"""


def check_hash(value: str, what: str = "sha256") -> str:
    if not _HEX.fullmatch(value):
        raise InvalidArgument(f"{what}: 64 lowercase hex digits are required, got {value[:80]!r}")
    return value


class ImageStore:
    def __init__(self, redis: aioredis.Redis, prefix: str, max_image_bytes: int,
                 max_store_bytes: int) -> None:
        self.r = redis
        self.prefix = prefix
        self.max_image_bytes = max_image_bytes
        self.max_store_bytes = max_store_bytes
        self._put = redis.register_script(_PUT_LUA)

    def key(self, sha256: str) -> str:
        return f"{self.prefix}img:{sha256}"

    async def put(self, images: Sequence[spb.StoredImage], rollout_id: str = "",
                  max_rollout_bytes: int = 0, present: Sequence[str] = ()
                  ) -> spb.PutImagesResponse:
        """Stores the images not stored yet; those new ones count against `rollout_id`'s
        `max_rollout_bytes` (0: no bound) and the store's `max_store_bytes`. Of `present`
        (hashes the caller believes stored), those not stored are answered in `missing`."""
        if len(images) + len(present) > MAX_PER_REQUEST:
            raise InvalidArgument(f"{len(images) + len(present)} images in one request: at "
                                  f"most {MAX_PER_REQUEST}")
        if max_rollout_bytes < 0:
            raise InvalidArgument(f"max_rollout_bytes must be >= 0, got {max_rollout_bytes}")
        if max_rollout_bytes and not rollout_id:
            raise InvalidArgument("max_rollout_bytes is given without a rollout_id")
        for i, h in enumerate(present):
            check_hash(h, f"present[{i}]")
        response = await self._store(images, rollout_id, max_rollout_bytes)
        response.missing.extend(h for h, n in zip(present, await self._exist(present)) if not n)
        return response

    async def _exist(self, hashes: Sequence[str]) -> list[int]:
        if not hashes:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for h in hashes:
                pipe.exists(self.key(h))
            return [int(x) for x in await pipe.execute()]

    async def _store(self, images: Sequence[spb.StoredImage], rollout_id: str,
                     max_rollout_bytes: int) -> spb.PutImagesResponse:
        total_key = f"{self.prefix}img:bytes"
        hashes = []
        keys = [total_key, f"{self.prefix}img:ro:{rollout_id}" if rollout_id else total_key]
        args = [str(self.max_store_bytes).encode(), str(max_rollout_bytes).encode(),
                str(ROLLOUT_COUNT_TTL_S).encode()]
        for i, img in enumerate(images):
            if not img.data:
                raise InvalidArgument(f"images[{i}].data is empty")
            if len(img.data) > self.max_image_bytes:
                raise InvalidArgument(f"images[{i}]: {len(img.data)} bytes, over the store's "
                                      f"{self.max_image_bytes}-byte limit (max_image_bytes)")
            if img.media_type not in MEDIA_TYPES:
                raise InvalidArgument(f"images[{i}].media_type {img.media_type[:80]!r} is not "
                                      f"one of {sorted(MEDIA_TYPES)}")
            digest = hashlib.sha256(img.data).hexdigest()
            if img.sha256 and img.sha256 != digest:
                raise InvalidArgument(f"images[{i}].sha256 {img.sha256[:80]!r} is not the "
                                      f"sha256 of its data ({digest})")
            hashes.append(digest)
            keys.append(self.key(digest))
            args += [img.media_type.encode(), img.data]
        if not hashes:
            return spb.PutImagesResponse()
        status, *counts = (int(x) for x in await self._put(keys=keys, args=args))
        if status == 1:
            raise ResourceExhausted(f"the image store is full (max_image_store_bytes "
                                    f"{self.max_store_bytes})")
        if status == 2:
            raise ResourceExhausted(
                f"{QUOTA}: rollout {rollout_id} has stored {counts[0]} bytes of images; these "
                f"would take it over its {max_rollout_bytes} (RunSpec.max_rollout_image_bytes "
                f"or the gateway's max_rollout_image_bytes)")
        stored, existing, rollout_bytes = counts
        return spb.PutImagesResponse(stored=stored, existing=existing, sha256=hashes,
                                     rollout_bytes=rollout_bytes)

    async def get(self, hashes: Sequence[str]) -> list[spb.StoredImage]:
        if len(hashes) > MAX_PER_REQUEST:
            raise InvalidArgument(f"{len(hashes)} hashes in one request: at most "
                                  f"{MAX_PER_REQUEST}")
        for i, h in enumerate(hashes):
            check_hash(h, f"sha256[{i}]")
        if not hashes:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for h in hashes:
                pipe.hmget(self.key(h), ["t", "d"])
            found = await pipe.execute()
        out = []
        for h, (media_type, data) in zip(hashes, found):
            if data is None:
                out.append(spb.StoredImage(sha256=h, found=False))
            else:
                out.append(spb.StoredImage(sha256=h, media_type=bytes(media_type).decode(),
                                           data=bytes(data), found=True))
        return out

    async def stored_bytes(self) -> int:
        return int(await self.r.get(f"{self.prefix}img:bytes") or 0)
