"""The image store (`Store.PutImages`, `Store.GetImages`; issue #45): the bytes of the images
that recorded calls carry (`Call.images`), content-addressed.

Keys (under the store's prefix P):

- `P img:{sha256}` HASH `t` -> media type, `d` -> the image's bytes. The key is the sha256 of
  the bytes, computed here: a caller's hash that does not match is refused, so a key always
  holds the bytes it names and a write never changes what a stored call refers to.
- `P img:bytes` the bytes stored under `img:*` in all, which `max_store_bytes` bounds.

A batch is written by one Lua script: images stored already are left as they are (a harness
resends a conversation's images every turn: each is kept once), and a batch that would take
the total over the bound stores nothing (RESOURCE_EXHAUSTED). Images are not deleted yet: a
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

_PUT_LUA = """
-- KEYS: total, then one image key per image; ARGV: max total, then media type and bytes of
-- each image. Returns {stored, existing}, or -1 (nothing stored) when the new images would
-- take the total over the bound.
local seen, order, size = {}, {}, 0
for i = 2, #KEYS do
  if not seen[KEYS[i]] and redis.call('EXISTS', KEYS[i]) == 0 then
    seen[KEYS[i]] = true
    order[#order + 1] = i
    size = size + #ARGV[2 * i - 1]
  end
end
local total = tonumber(redis.call('GET', KEYS[1]) or '0')
if size > 0 and total + size > tonumber(ARGV[1]) then return -1 end
for _, i in ipairs(order) do
  redis.call('HSET', KEYS[i], 't', ARGV[2 * i - 2], 'd', ARGV[2 * i - 1])
end
if size > 0 then redis.call('INCRBY', KEYS[1], size) end
return {#order, #KEYS - 1 - #order}
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

    async def put(self, images: Sequence[spb.StoredImage]) -> spb.PutImagesResponse:
        if len(images) > MAX_PER_REQUEST:
            raise InvalidArgument(f"{len(images)} images in one request: at most "
                                  f"{MAX_PER_REQUEST}")
        hashes = []
        keys, args = [f"{self.prefix}img:bytes"], [str(self.max_store_bytes).encode()]
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
        result = await self._put(keys=keys, args=args)
        if result == -1:
            raise ResourceExhausted(f"the image store is full (max_image_store_bytes "
                                    f"{self.max_store_bytes})")
        stored, existing = (int(x) for x in result)
        return spb.PutImagesResponse(stored=stored, existing=existing, sha256=hashes)

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
