"""The gateway's side of the image store (issue #45): each request's images go to the store's
content-addressed image store (`Store.PutImages`) after the engine answered and before the call
is recorded, so the hashes a recorded call carries always resolve; and the processor settings recorded with each call that
carries images (`Call.processor_json`, `harnessrl.processor_settings`), read from the served
models' folders at start.

A hash this gateway stored already (the most recent `known_max`) is not sent again (a harness
resends a conversation's images every turn), only named (`PutImagesRequest.present`): one the
store no longer holds (lost with the last writes of a Redis that crashed under `appendfsync
everysec`) is answered `missing` and sent again, so a recorded call never names a lost image.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

import grpc

from harnessrl.processor_settings import processor_settings
from harnessrl.v1 import store_pb2 as spb
from services.gateway.config import GatewayConfig
from services.gateway.exchange import HTTPError
from services.gateway.image_fetch import FetchRefused, ImageFetcher
from services.gateway.images import Image, RequestImages
from services.gateway.schemas import Invalid

log = logging.getLogger("harnessrl.gateway")

# how the store's refusal for a rollout's bound starts (services/store/images.py QUOTA)
ROLLOUT_QUOTA = "rollout image quota"


class GatewayImages:
    """The gateway's images: the checks' bounds, the processor settings of each served model,
    and the image store (through the store service)."""

    def __init__(self, store: Any, max_bytes: int, max_images: int,
                 processor_dirs: dict[str, str], hold_timeout_s: float,
                 fetch_timeout_s: float = 10.0, known_max: int = 100_000,
                 max_rollout_bytes: int = 64 * 1024 * 1024) -> None:
        self.store = store
        self.fetcher = ImageFetcher(max_bytes, fetch_timeout_s)
        self.max_bytes, self.max_images = max_bytes, max_images
        self.max_rollout_bytes = max_rollout_bytes  # unless the run sets its own
        self.processors = {m: processor_settings(m, d) for m, d in processor_dirs.items()}
        self.hold_timeout_s = hold_timeout_s
        self.known_max = known_max
        self._known: OrderedDict[str, None] = OrderedDict()  # hashes the store has
        self._warned: set[str] = set()

    @classmethod
    def from_config(cls, store: Any, cfg: GatewayConfig) -> GatewayImages:
        return cls(store, cfg.max_image_bytes, cfg.max_images, cfg.processor_dirs,
                   cfg.hold_timeout_s, cfg.image_fetch_timeout_s,
                   max_rollout_bytes=cfg.max_rollout_image_bytes)

    def request(self, session: Any) -> RequestImages:
        found = RequestImages(self.max_bytes, self.max_images, session.fetch_images)
        found.rollout_id = session.cred.rollout_id
        found.max_rollout_bytes = session.max_image_bytes or self.max_rollout_bytes
        return found

    async def collect(self, found: RequestImages, messages: Any, model: str
                      ) -> RequestImages | None:
        """The request's images (None: it has none), http(s) ones fetched (for a run that
        fetches them), with the served model's processor settings."""
        found.collect(messages)
        if found.pending:
            if len(found.images) + len(found.pending) > self.max_images:  # before any fetch
                raise Invalid(("messages",), f"{len(found.images) + len(found.pending)} images "
                              f"in one request: at most {self.max_images} (max_images)",
                              "too_many_images")
            pending = list(found.pending.items())
            results = await asyncio.gather(*(self.fetcher.fetch(url) for url, _ in pending),
                                           return_exceptions=True)
            for (url, where), result in zip(pending, results):
                if isinstance(result, FetchRefused):
                    raise Invalid(where, str(result), "image_fetch_refused")
                if isinstance(result, BaseException):
                    raise result
                found.fetched(url, result)
            found.collect(messages)
        if not found.images:
            return None
        found.processor = self.processors.get(model, b"")
        if not found.processor and model not in self._warned:
            self._warned.add(model)
            log.warning("calls with images to model %r are recorded without processor "
                        "settings: give the gateway its folder (processor_dirs)", model)
        return found

    async def put(self, found: RequestImages | None) -> None:
        """Stores the request's images not known stored yet, those new to the store counted
        against its rollout's bound; waits while the store is unavailable (up to
        hold_timeout_s), else HTTPError: 400 (an image the store's bound refuses), 413 (the
        rollout's images would pass its bound), 507 (the image store is full), 503 or 502
        (the store failed)."""
        if found is None:
            return
        new: dict[str, Image] = {}
        known: dict[str, Image] = {}
        for img in found.images:
            if img.sha256 in self._known:
                self._known.move_to_end(img.sha256)
                known[img.sha256] = img
            else:
                new[img.sha256] = img
        deadline = time.monotonic() + self.hold_timeout_s  # for both puts together
        missing = await self._put(found, list(new.values()), list(known), deadline)
        if missing:  # the store lost them: sent again, counted as new against this rollout
            log.warning("the image store no longer holds %d image(s) this gateway had stored "
                        "(deleted past the store's image_retention_s, or lost by a Redis "
                        "restart): sending them again", len(missing))
            for h in missing:
                self._known.pop(h, None)
            await self._put(found, [known[h] for h in missing], [], deadline)
            new.update((h, known[h]) for h in missing)
        for h in new:
            self._known[h] = None
        while len(self._known) > self.known_max:
            self._known.popitem(last=False)

    async def _put(self, found: RequestImages, images: list[Image], present: list[str],
                   deadline: float) -> list[str]:
        """One PutImages of `images`, naming `present`; the hashes of those it answers
        missing. Raises HTTPError as `put` says."""
        if not images and not present:
            return []
        request = [spb.StoredImage(sha256=i.sha256, media_type=i.media_type, data=i.data)
                   for i in images]
        delay = 0.05
        while True:
            try:
                response = await self.store.put_images(
                    request, timeout=max(1.0, min(30.0, deadline - time.monotonic())),
                    rollout_id=found.rollout_id, max_rollout_bytes=found.max_rollout_bytes,
                    present=present)
                return list(response.missing)
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise HTTPError(400, f"image refused by the store: {err.details()}",
                                    "invalid_request_error", "image_too_large") from err
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and \
                        (err.details() or "").startswith(ROLLOUT_QUOTA):
                    raise HTTPError(413, f"images not stored: {err.details()}",
                                    "invalid_request_error", "rollout_image_quota") from err
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise HTTPError(507, f"image not stored: {err.details()}", "server_error",
                                    "image_store_full") from err
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                        or time.monotonic() + delay > deadline:
                    raise HTTPError(503 if code == grpc.StatusCode.UNAVAILABLE else 502,
                                    f"image store: {code.name} {err.details()}",
                                    "server_error", "image_store_error") from err
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)
