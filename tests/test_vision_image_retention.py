"""The image store's retention (`image_retention_s`, services/store/images.py; issue #45): an
image no PutImages has sent or named for that long is deleted by the next PutImages, its bytes
leave the store's count and so make room under the bound; an image a request sends or names is
kept. Against a real store process and Redis; time is moved by writing an image's last use
(the `img:used` score) back in Redis, the one thing the test does inside the store's keys."""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import pytest
import redis

from harnessrl import procs
from harnessrl.clients import StoreClient
from harnessrl.v1 import store_pb2 as spb
from test_gateway_images import sha, unique_png


def stored(data: bytes) -> spb.StoredImage:
    return spb.StoredImage(media_type="image/png", data=data)


def start_store(tmp_path: Path, redis_url: str, prefix: str, *flags: str) -> tuple:  # type: ignore[type-arg]
    proc, info = procs.start_service(
        "store", "services.store", ["--bind", "127.0.0.1:0", "--redis-url", redis_url,
                                    "--key-prefix", prefix, *flags], tmp_path, timeout=30)
    return proc, StoreClient.connect(f"127.0.0.1:{info['grpc_port']}", timeout=10)


def test_images_unused_past_the_retention_are_deleted_and_make_room(tmp_path: Path,
                                                                     redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    a, b = unique_png(), unique_png()
    d = unique_png()
    while len(d) > len(b):  # d must fit exactly where b was
        d = unique_png()
    proc, store = start_store(tmp_path, redis_url, prefix, "--image-retention-s", "60",
                              "--max-image-store-bytes", str(len(a) + len(b)))
    r = redis.Redis.from_url(redis_url)
    used = f"{prefix}img:used"

    def age(data: bytes, seconds: float) -> None:
        """As if `data` was last sent or named `seconds` ago (by Redis's clock)."""
        now_s, now_us = r.time()
        r.zadd(used, {f"{prefix}img:{sha(data)}": now_s * 1000 + now_us // 1000 - seconds * 1000})

    try:
        assert store.put_images([stored(a), stored(b)], rollout_id="run/t/0").stored == 2
        now_s, _ = r.time()
        pairs: list[tuple[bytes, float]] = r.zrange(used, 0, -1, withscores=True)  # type: ignore[assignment]
        scores = {k.decode(): v for k, v in pairs}
        assert set(scores) == {f"{prefix}img:{sha(a)}", f"{prefix}img:{sha(b)}"}
        assert all(abs(s / 1000 - now_s) < 30 for s in scores.values())  # Redis's clock, in ms
        with pytest.raises(grpc.RpcError) as full:  # the store is full: d does not fit
            store.put_images([stored(d)])
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # both unused for two minutes; a named, so in use again: kept; b goes, and d fits
        age(a, 120)
        age(b, 120)
        put = store.put_images([stored(d)], present=[sha(a)])
        assert (put.stored, list(put.missing)) == (1, [])
        got = {g.sha256: g.found for g in store.get_images([sha(a), sha(b), sha(d)]).images}
        assert got == {sha(a): True, sha(b): False, sha(d): True}
        assert int(r.get(f"{prefix}img:bytes") or 0) == len(a) + len(d)
        assert r.zscore(used, f"{prefix}img:{sha(b)}") is None
        # a gateway that still names b learns it is gone (and sends it again)
        assert list(store.put_images([], present=[sha(b), sha(a)]).missing) == [sha(b)]
        # just within the retention: kept; just past it: deleted (by a request naming neither)
        age(d, 59)
        age(a, 61)
        assert list(store.put_images([], present=[sha(b)]).missing) == [sha(b)]
        got = {g.sha256: g.found for g in store.get_images([sha(a), sha(d)]).images}
        assert got == {sha(a): False, sha(d): True}
        assert int(r.get(f"{prefix}img:bytes") or 0) == len(d)
    finally:
        store.close()
        r.close()
        proc.stop()


def test_without_retention_every_image_is_kept(tmp_path: Path, redis_url: str) -> None:
    """The default (0): rollouts and calls are kept, so are the images they name."""
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    a, b = unique_png(), unique_png()
    proc, store = start_store(tmp_path, redis_url, prefix)
    r = redis.Redis.from_url(redis_url)
    try:
        store.put_images([stored(a)])
        r.zadd(f"{prefix}img:used", {f"{prefix}img:{sha(a)}": 0})  # last used in 1970
        assert store.put_images([stored(b)]).stored == 1
        assert [g.found for g in store.get_images([sha(a), sha(b)]).images] == [True, True]
        assert int(r.get(f"{prefix}img:bytes") or 0) == len(a) + len(b)
    finally:
        store.close()
        r.close()
        proc.stop()
