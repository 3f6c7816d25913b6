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
- `P img:used` ZSET: each image's key, scored by the last time (Redis's clock, ms) a PutImages
  sent or named it (`present`: a gateway names every image of a call it records).

A batch is written by one Lua script: images stored already are left as they are and cost
nothing (a harness resends a conversation's images every turn: each is kept once), and a batch
that would take the total over the store's bound, or its rollout's over the rollout's, stores
nothing (RESOURCE_EXHAUSTED; the rollout's case names "rollout image quota"). So one rollout's
harness can take at most its bound of the store, not all of it.

Retention (the store's `image_retention_s`; 0, the default, keeps every image, as rollouts and
calls are kept): each PutImages first marks the images it sends or names that the store holds
as used now, then deletes up to 256 images no request has sent or named for that long, taking
their bytes off the total, and only then checks the bounds, so what expired makes room for the
new. An image in use is never deleted by its own request. A call recorded longer ago than the
retention may name an image GetImages answers `found` false (the trainer drops that rollout,
naming the image). Nothing runs between requests: a store that takes no images deletes none.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence

import redis.asyncio as aioredis

from harnessrl.errors import InvalidArgument, ResourceExhausted
from harnessrl.v1 import store_pb2 as spb

log = logging.getLogger(__name__)

MEDIA_TYPES = frozenset(("image/png", "image/jpeg", "image/gif", "image/webp"))
_HEX = re.compile(r"[0-9a-f]{64}")
MAX_PER_REQUEST = 1024  # images per PutImages / GetImages request

ROLLOUT_COUNT_TTL_S = 7 * 24 * 3600  # a rollout's count outlives any of its calls
QUOTA = "rollout image quota"  # how a refusal for a rollout's bound starts

_PUT_LUA = """
-- KEYS: total, the rollout's count (or the total again when none), the use index, then one key
-- per image sent and one per image named (`present`);
-- ARGV: max total, max for the rollout (0: none), the count's TTL, retention in ms (0: keep),
-- the number of images sent, then media type and bytes of each image sent.
-- Returns {0, stored, existing, rollout's bytes, swept, missing...} (missing: the 1-based
-- indices of the named images not stored), {1, total} when the new images would take the
-- total over its bound, {2, rollout's bytes} over the rollout's; nothing is stored in those two.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local sent = tonumber(ARGV[5])
local first_named = 4 + sent
-- what this request sends or names and the store holds is in use now: it is kept
for i = 4, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('ZADD', KEYS[3], now, KEYS[i]) end
end
-- retention: the images no call has named for that long go, and their bytes leave the total
local swept = 0
local keep = tonumber(ARGV[4])
if keep > 0 then
  for _, k in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now - keep, 'LIMIT', 0, 256)) do
    local n = redis.call('HSTRLEN', k, 'd')
    if n > 0 then
      redis.call('UNLINK', k)
      redis.call('DECRBY', KEYS[1], n)
      swept = swept + 1
    end
    redis.call('ZREM', KEYS[3], k)
  end
end
local seen, order, size = {}, {}, 0
for i = 4, first_named - 1 do
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
  redis.call('ZADD', KEYS[3], now, KEYS[i])
end
if size > 0 then
  redis.call('INCRBY', KEYS[1], size)
  if KEYS[2] ~= KEYS[1] then
    rollout = redis.call('INCRBY', KEYS[2], size)
    redis.call('EXPIRE', KEYS[2], ARGV[3])
  end
end
local out = {0, #order, sent - #order, rollout, swept}
for i = first_named, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then out[#out + 1] = i - first_named + 1 end
end
return out
"""

def check_hash(value: str, what: str = "sha256") -> str:
    if not _HEX.fullmatch(value):
        raise InvalidArgument(f"{what}: 64 lowercase hex digits are required, got {value[:80]!r}")
    return value


class ImageStore:
    def __init__(self, redis: aioredis.Redis, prefix: str, max_image_bytes: int,
                 max_store_bytes: int, retention_s: float = 0.0) -> None:
        self.r = redis
        self.prefix = prefix
        self.max_image_bytes = max_image_bytes
        self.max_store_bytes = max_store_bytes
        self.retention_ms = max(0, round(retention_s * 1000))
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
        total_key = f"{self.prefix}img:bytes"
        hashes = []
        keys = [total_key, f"{self.prefix}img:ro:{rollout_id}" if rollout_id else total_key,
                f"{self.prefix}img:used"]
        args = [str(self.max_store_bytes).encode(), str(max_rollout_bytes).encode(),
                str(ROLLOUT_COUNT_TTL_S).encode(), str(self.retention_ms).encode(),
                str(len(images)).encode()]
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
        if not hashes and not present:
            return spb.PutImagesResponse()
        keys += [self.key(h) for h in present]
        status, *counts = (int(x) for x in await self._put(keys=keys, args=args))
        if status == 1:
            raise ResourceExhausted(f"the image store is full (max_image_store_bytes "
                                    f"{self.max_store_bytes})")
        if status == 2:
            raise ResourceExhausted(
                f"{QUOTA}: rollout {rollout_id} has stored {counts[0]} bytes of images; these "
                f"would take it over its {max_rollout_bytes} (RunSpec.max_rollout_image_bytes "
                f"or the gateway's max_rollout_image_bytes)")
        stored, existing, rollout_bytes, swept, *missing = counts
        if swept:
            log.info("image store: %d images no call named for %.0f s deleted (retention)",
                     swept, self.retention_ms / 1000)
        return spb.PutImagesResponse(stored=stored, existing=existing, sha256=hashes,
                                     rollout_bytes=rollout_bytes,
                                     missing=[present[i - 1] for i in missing])

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
