"""Images through the gateway (issue #45, part 2), read from outside: what the store recorded
and what its image store holds, what each API's SDK gets back.

Against the stub engine (fast): images in chat completions (`image_url` data URLs), Responses
(`input_image`) and Anthropic Messages (`image` blocks with base64 sources), each call
recorded with its images' hashes in prompt order, the processor settings and a request body
that refers to the images by hash; the refusals (http URLs, bad base64, unsupported types,
over the size and count bounds) in each API's error shape, with nothing recorded or stored;
the image store's dedupe, bounds and authorization.

Against a real vLLM serving the project's tiny VLM (`@pytest.mark.vllm`): an image sent with
the `openai` SDK is recorded with the prompt ids vLLM returned (image placeholders expanded),
logprobs, and a hash that resolves to the exact bytes sent.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import io
import json
import random
import re
import threading
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest
import redis
import torch
from PIL import Image as PILImage
from transformers import AutoModelForImageTextToText

from conftest import GatewayService, StoreService, StubEngineService, as_identity
from harnessrl import procs
from harnessrl.clients import GatewayAdminClient, StoreClient
from harnessrl.model.vision import IMAGE_TOKEN, VisionRecipe, draw_shape, load_processor
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.gateway.image_fetch import FetchRefused, ImageFetcher, public_address
from services.gateway.image_store import GatewayImages
from services.gateway.schemas import Invalid
from test_gateway import SIGNER, World

MAX_IMAGE_BYTES = 6000  # the gateway's bound in these tests


def png(colour: str, size: int = 24) -> bytes:
    img = PILImage.new("RGB", (size, size), colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def noisy_png(size: int = 64) -> bytes:
    """A PNG of random pixels: it does not compress (about 3 bytes a pixel)."""
    img = PILImage.frombytes("RGB", (size, size), random.Random(size).randbytes(3 * size * size))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def jpeg(colour: str) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", (16, 16), colour).save(buf, format="JPEG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_part(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data, media_type)}}


RED, BLUE, GREEN = png("red"), png("blue"), png("green")
PROCESSOR = {"image_processor": {"size": {"longest_edge": 64}, "patch_size": 8},
             "image_seq_len": 16}


class ImageWorld(World):
    """A store, a stub engine and a gateway with small image bounds and processor settings."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.prefix = f"t{uuid.uuid4().hex[:10]}:"
        self.redis_url = redis_url
        store = StoreService(tmp / "store", redis_url, self.prefix).start()
        self.stub = StubEngineService(tmp / "stub")
        model_dir = tmp / "tiny-model"
        model_dir.mkdir()
        (model_dir / "processor_config.json").write_text(json.dumps(PROCESSOR))
        super().__init__(tmp, store, [self.stub], "--max-image-bytes", str(MAX_IMAGE_BYTES),
                         "--max-images", "3", "--processor-dirs",
                         json.dumps({"tiny": str(model_dir)}))

    def stored_images(self) -> dict[str, bytes]:
        """The image store's keys, read from Redis: sha256 -> bytes."""
        r = redis.Redis.from_url(self.redis_url)
        try:
            keys = [k.decode() for k in r.keys(f"{self.prefix}img:*")]
            return {k.rsplit(":", 1)[1]: r.hget(k, "d")  # type: ignore[misc]
                    for k in keys if re.fullmatch(r"img:[0-9a-f]{64}", k[len(self.prefix):])}
        finally:
            r.close()

    def anthropic(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.gateway.base_url[:-3], api_key=key,
                                   max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[ImageWorld]:
    w = ImageWorld(tmp_path_factory.mktemp("images"), redis_url)
    try:
        yield w
    finally:
        w.close()
        w.stub.proc.stop()
        w.store_svc.stop()


def check_recorded(world: ImageWorld, call: c.Call, images: list[bytes]) -> None:
    """`call` carries `images` (hashes in order, types, sizes), the processor settings, the
    media segment start, and a request body that holds none of their data; the image store
    holds each one's exact bytes."""
    assert [i.sha256 for i in call.images] == [sha(d) for d in images]
    assert [i.size_bytes for i in call.images] == [len(d) for d in images]
    assert {i.media_type for i in call.images} <= {"image/png", "image/jpeg"}
    settings = json.loads(call.processor_json)
    assert settings == {"model": "tiny", "files": {"processor_config.json": PROCESSOR}}
    assert call.segment_start == c.SEGMENT_START_MEDIA and call.segment == call.seq
    body = call.request_json.decode()
    for d in images:
        assert b64(d) not in body
    stored = world.stored_images()
    for d in images:
        assert stored[sha(d)] == d
    got = world.store.get_images([sha(d) for d in images]).images
    assert [(g.found, g.data) for g in got] == [(True, d) for d in images]


# -- the three APIs --------------------------------------------------------------------------
def test_chat_image_url_is_recorded_with_hash_settings_and_stored_bytes(world: ImageWorld
                                                                        ) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    messages: list[Any] = [{"role": "user", "content": [
        {"type": "text", "text": "What colour?"}, image_part(RED),
        {"type": "text", "text": "and"}, image_part(jpeg("blue"), "image/jpg")]}]
    resp = client.chat.completions.create(model="tiny", messages=messages)
    assert resp.choices[0].message.content == "Hello, world!"
    # a second turn resends the images and adds one: all three, in prompt order
    messages += [{"role": "assistant", "content": "red"},
                 {"role": "user", "content": [image_part(GREEN)]}]
    with client.chat.completions.stream(model="tiny", messages=messages) as stream:
        assert stream.get_final_completion().choices[0].message.content == "Hello, world!"
    first, second = world.calls(rid)
    check_recorded(world, first, [RED, jpeg("blue")])
    check_recorded(world, second, [RED, jpeg("blue"), GREEN])
    assert [i.media_type for i in second.images] == ["image/png", "image/jpeg", "image/png"]
    body = json.loads(second.request_json)
    assert body["messages"][2]["content"][0]["image_url"]["url"] == "sha256:" + sha(GREEN)
    assert body["messages"][0]["content"][0] == {"type": "text", "text": "What colour?"}
    assert list(second.logprobs) == [-0.25, -0.5, -0.75, -1.0]
    assert list(second.prompt_token_ids) == list(range(100, 132))  # the engine's, as returned


def test_text_only_calls_keep_token_in_and_record_no_images(world: ImageWorld) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    [call] = world.calls(rid)
    assert not call.images and call.processor_json == b""
    assert call.segment_start == c.SEGMENT_START_FIRST
    assert json.loads(call.request_json)["messages"] == [{"role": "user", "content": "hi"}]


def test_responses_input_image_across_a_chain(world: ImageWorld) -> None:
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    first = client.responses.create(model="tiny", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Colour?"},
        {"type": "input_image", "image_url": data_url(RED), "detail": "auto"}]}])
    assert first.output_text == "Hello, world!"
    second = client.responses.create(model="tiny", previous_response_id=first.id, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(BLUE)},
                                     {"type": "input_text", "text": "And this?"}]}])
    assert second.output_text == "Hello, world!"
    a, b = world.calls(rid)
    check_recorded(world, a, [RED])
    check_recorded(world, b, [RED, BLUE])  # the chain's earlier image first
    assert a.api == b.api == "responses"
    part = json.loads(b.request_json)["input"][0]["content"][0]
    assert part == {"type": "input_image", "image_url": "sha256:" + sha(BLUE)}


def test_anthropic_image_blocks_in_user_messages_and_tool_results(world: ImageWorld) -> None:
    rid = world.rollout()
    ac = world.anthropic(SIGNER.mint(rid, 1, 60))

    def block(data: bytes) -> dict[str, Any]:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": b64(data)}}
    msg = ac.messages.create(model="tiny", max_tokens=16, messages=[{"role": "user", "content": [
        block(RED), {"type": "text", "text": "What colour is it?"}]}])
    assert msg.content[0].text == "Hello, world!"  # type: ignore[union-attr]
    with ac.messages.stream(model="tiny", max_tokens=16, messages=[
            {"role": "user", "content": [block(RED), {"type": "text", "text": "Look"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [block(GREEN),
                                                      {"type": "text", "text": "screen"}]}]},
    ]) as stream:
        assert stream.get_final_message().stop_reason == "end_turn"
    a, b = world.calls(rid)
    check_recorded(world, a, [RED])
    check_recorded(world, b, [RED, GREEN])
    source = json.loads(a.request_json)["messages"][0]["content"][0]["source"]
    assert source == {"type": "base64", "media_type": "image/png", "data": "sha256:" + sha(RED)}


# -- refusals --------------------------------------------------------------------------------
def _bad_images() -> list[tuple[str, Any, str]]:
    big = noisy_png()
    assert len(big) > MAX_IMAGE_BYTES
    return [
        ("http URL", "https://example.com/cat.png", "image_url_not_supported"),
        ("loopback URL", "http://127.0.0.1:6379/", "image_url_not_supported"),
        ("bad base64", "data:image/png;base64,iVBORw0K!!!", "invalid_image"),
        ("not base64", "data:image/png," + b64(RED), "invalid_image"),
        ("svg", data_url(b"<svg/>", "image/svg+xml"), "unsupported_media_type"),
        ("text as png", data_url(b"hello, not an image at all"), "unsupported_media_type"),
        ("too large", data_url(big), "image_too_large"),
    ]


@pytest.mark.parametrize("case", [c[0] for c in _bad_images()])
def test_bad_images_are_refused_400_in_each_api_shape(world: ImageWorld, case: str) -> None:
    _, url, code = {c[0]: c for c in _bad_images()}[case]
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    before = world.stored_images()
    with pytest.raises(openai.BadRequestError) as chat:
        world.client(key).chat.completions.create(model="tiny", messages=[{
            "role": "user", "content": [{"type": "text", "text": "x"},
                                        {"type": "image_url", "image_url": {"url": url}}]}])
    err = chat.value.body
    assert isinstance(err, dict) and err["code"] == code, err
    assert err["param"] == "messages[0].content[1].image_url.url"
    with pytest.raises(openai.BadRequestError) as resp:
        world.client(key).responses.create(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url, "detail": "auto"}]}])
    assert resp.value.body["code"] == code  # type: ignore[index]
    assert resp.value.body["param"] == "input[0].content[0].image_url"  # type: ignore[index]
    if case == "not base64":  # (Anthropic's sources are base64 by their shape)
        assert world.calls(rid) == []
        return
    if url.startswith("data:"):
        media_type, _, data = url[5:].partition(",")
        source: dict[str, Any] = {"type": "base64", "media_type": media_type.split(";")[0],
                                  "data": data}
    else:
        source = {"type": "url", "url": url}
    with pytest.raises(anthropic.BadRequestError) as am:
        world.anthropic(key).messages.create(model="tiny", max_tokens=8, messages=[{
            "role": "user", "content": [{"type": "image", "source": source}]}])
    body = am.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages.0.content.0.source"), body
    assert world.calls(rid) == []  # nothing recorded
    assert world.stored_images() == before  # nothing stored


def test_other_refusals(world: ImageWorld) -> None:
    rid = world.rollout()
    key = SIGNER.mint(rid, 1, 60)
    client = world.client(key)
    with pytest.raises(openai.BadRequestError) as many:  # --max-images 3
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            image_part(png("red", 8 + k)) for k in range(4)]}])
    assert many.value.body["code"] == "too_many_images"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as audio:  # media the gateway cannot record
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])
    assert audio.value.body["code"] == "unsupported_content"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as file_id:
        client.responses.create(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1", "detail": "auto"}]}])
    assert file_id.value.body["param"] == "input[0].content[0].file_id"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as gif_as:
        world.anthropic(key).messages.create(model="tiny", max_tokens=8, messages=[{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/bmp", "data": b64(RED)}}]}])
    assert "messages.0.content.0.source.media_type" in str(gif_as.value)
    # media keys vLLM reads from a part whatever its type (with a uuid), a uuid on an image
    # (vLLM's cache key instead of the content's), media processing settings: all refused
    for part in [{"type": "text", "text": "x", "uuid": "u", "image_url": "http://10.0.0.1/a"},
                 {**image_part(RED), "uuid": "u"}]:
        with pytest.raises(openai.BadRequestError) as sneaked:
            client.chat.completions.create(model="tiny", messages=[
                {"role": "user", "content": [part]}])
        assert sneaked.value.body["code"] == "unsupported_content"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as kwargs:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            image_part(RED)]}], extra_body={"mm_processor_kwargs": {"size": 1}})
    assert kwargs.value.body["param"] == "mm_processor_kwargs"  # type: ignore[index]
    assert world.calls(rid) == []


# -- the image store -------------------------------------------------------------------------
def test_image_store_dedupes_checks_hashes_and_bounds(tmp_path: Path, redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    proc, info = procs.start_service(
        "store", "services.store",
        ["--bind", "127.0.0.1:0", "--redis-url", redis_url, "--key-prefix", prefix,
         "--max-image-bytes", "2000", "--max-image-store-bytes", str(len(RED) + len(BLUE))],
        tmp_path, timeout=30)
    store = StoreClient.connect(f"127.0.0.1:{info['grpc_port']}", timeout=10)
    r = redis.Redis.from_url(redis_url)
    try:
        def img(data: bytes, digest: str = "") -> spb.StoredImage:
            return spb.StoredImage(sha256=digest, media_type="image/png", data=data)
        put = store.put_images([img(RED), img(RED, sha(RED))])
        assert (put.stored, put.existing, list(put.sha256)) == (1, 1, [sha(RED)] * 2)
        put = store.put_images([img(RED)])
        assert (put.stored, put.existing) == (0, 1)  # dedupe: kept once
        assert int(r.get(f"{prefix}img:bytes") or 0) == len(RED)
        with pytest.raises(grpc.RpcError) as wrong:  # a key always holds the bytes it names
            store.put_images([img(BLUE, sha(RED))])
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as large:
            store.put_images([img(noisy_png())])
        assert large.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as kind:
            store.put_images([spb.StoredImage(media_type="text/html", data=b"<p>")])
        assert kind.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the store bound: BLUE fits exactly; GREEN with it would not, and nothing is stored
        with pytest.raises(grpc.RpcError) as full:
            store.put_images([img(BLUE), img(GREEN)])
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert store.put_images([img(BLUE)]).stored == 1
        assert store.put_images([img(RED), img(BLUE)]).existing == 2  # stored ones still fit
        with pytest.raises(grpc.RpcError):
            store.put_images([img(GREEN)])
        got = store.get_images([sha(BLUE), sha(GREEN), sha(RED)]).images
        assert [(g.sha256, g.found, g.data, g.media_type) for g in got] == [
            (sha(BLUE), True, BLUE, "image/png"), (sha(GREEN), False, b"", ""),
            (sha(RED), True, RED, "image/png")]
        assert int(r.get(f"{prefix}img:bytes") or 0) == len(RED) + len(BLUE)
        with pytest.raises(grpc.RpcError) as bad:
            store.get_images(["../etc"])
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        store.close()
        r.close()
        proc.stop()


def test_gateway_answers_507_when_the_image_store_is_full(tmp_path: Path,
                                                          redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    proc, info = procs.start_service(
        "store", "services.store",
        ["--bind", "127.0.0.1:0", "--redis-url", redis_url, "--key-prefix", prefix,
         "--max-image-store-bytes", str(len(RED))], tmp_path / "s", timeout=30)
    store = StoreService(tmp_path, redis_url, prefix)
    store.port, store.proc = info["grpc_port"], proc
    stub = StubEngineService(tmp_path / "stub")
    w = World(tmp_path, store, [stub])
    try:
        rid = w.rollout()
        client = w.client(SIGNER.mint(rid, 1, 60))
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            image_part(RED)]}])
        with pytest.raises(openai.APIStatusError) as full:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
                image_part(RED), image_part(BLUE)]}])
        assert full.value.status_code == 507
        assert full.value.body["code"] == "image_store_full"  # type: ignore[index]
        [call] = w.calls(rid)  # the refused call was not recorded
        assert [i.sha256 for i in call.images] == [sha(RED)]
        assert call.processor_json == b""  # no processor_dirs for the model
    finally:
        w.close()
        stub.proc.stop()
        proc.stop()


def unique_png() -> bytes:
    """A small PNG no other test stored (a random colour)."""
    return png("#%06x" % random.randrange(1 << 24), size=8)


def test_a_rollouts_new_images_count_against_its_bound(tmp_path: Path, redis_url: str) -> None:
    """The store's side: the bytes of images a rollout stores first count against the bound
    its gateway names; past it nothing of the request is stored; an image stored already,
    by any rollout, costs nothing."""
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    svc = StoreService(tmp_path / "store", redis_url, prefix).start()
    store = StoreClient.connect(svc.address, timeout=10)
    r = redis.Redis.from_url(redis_url)
    a, b, d = unique_png(), unique_png(), unique_png()

    def put(rid: str, most: int, *data: bytes) -> spb.PutImagesResponse:
        return store.put_images([spb.StoredImage(media_type="image/png", data=x) for x in data],
                                rollout_id=rid, max_rollout_bytes=most)
    try:
        bound = len(a) + len(b)
        assert put("run/t/0", bound, a).rollout_bytes == len(a)
        with pytest.raises(grpc.RpcError) as over:  # a fits, b and d together would not
            put("run/t/0", bound, a, b, d)
        assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert over.value.details().startswith("rollout image quota: rollout run/t/0 has "
                                               f"stored {len(a)} bytes")
        assert [g.found for g in store.get_images([sha(b), sha(d)]).images] == [False, False]
        done = put("run/t/0", bound, a, b)  # exactly its bound
        assert (done.stored, done.existing, done.rollout_bytes) == (1, 1, bound)
        assert int(r.get(f"{prefix}img:ro:run/t/0") or 0) == bound
        assert 0 < r.ttl(f"{prefix}img:ro:run/t/0") <= 7 * 24 * 3600
        other = put("run/t/1", 1, a, b)  # stored already: another rollout pays nothing
        assert (other.stored, other.existing, other.rollout_bytes) == (0, 2, 0)
        assert put("run/t/1", len(d), d).rollout_bytes == len(d)  # its own bound, not t/0's
        assert int(r.get(f"{prefix}img:bytes") or 0) == bound + len(d)
        for rid, most in (("", 10), ("run/t/2", -1)):
            with pytest.raises(grpc.RpcError) as bad:
                put(rid, most, unique_png())
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        store.close()
        r.close()
        svc.stop()


def test_a_rollout_past_its_image_bound_gets_413_and_others_go_on(world: ImageWorld) -> None:
    """Through the gateway: a run's `max_rollout_image_bytes` bounds what each of its
    rollouts adds to the image store (413 past it, the call not recorded, its images not
    stored); another rollout of the run has a bound of its own; a run that sets none is
    counted against the gateway's default."""
    run_id = f"quota-{uuid.uuid4().hex[:6]}"
    a, b, d = unique_png(), unique_png(), unique_png()
    world.store.put_run(c.Run(run_id=run_id, spec=c.RunSpec(
        max_rollout_image_bytes=len(a) + len(b))))

    def rollout(i: int, run: str = run_id) -> tuple[str, openai.OpenAI]:
        rid = f"{run}/t/{i}"
        world.store.create_rollouts([c.Rollout(rollout_id=rid, run_id=run, task_id="t",
                                               group_id=f"{run}/t", group_size=3, stream="-")])
        world.store.start_attempt(rid, 1)
        return rid, world.client(SIGNER.mint(rid, 1, 60))

    def ask(client: openai.OpenAI, *data: bytes) -> Any:
        return client.chat.completions.create(model="tiny", messages=[{
            "role": "user", "content": [image_part(x) for x in data]}])
    first, client = rollout(0)
    ask(client, a)
    ask(client, a, b)  # b fits exactly
    with pytest.raises(openai.APIStatusError) as over:
        ask(client, a, b, d)
    assert over.value.status_code == 413
    assert over.value.body["code"] == "rollout_image_quota"  # type: ignore[index]
    assert len(world.calls(first)) == 2 and sha(d) not in world.stored_images()
    second, client2 = rollout(1)
    ask(client2, d)  # a bound of its own
    assert world.stored_images()[sha(d)] == d and len(world.calls(second)) == 1
    r = redis.Redis.from_url(world.redis_url)
    try:
        assert int(r.get(f"{world.prefix}img:ro:{first}") or 0) == len(a) + len(b)
        other_run = f"plain-{uuid.uuid4().hex[:6]}"
        world.store.put_run(c.Run(run_id=other_run, spec=c.RunSpec()))
        third, client3 = rollout(0, other_run)
        e = unique_png()
        ask(client3, e)  # the gateway's default bound (64 MiB): counted, not refused
        assert int(r.get(f"{world.prefix}img:ro:{third}") or 0) == len(e)
    finally:
        r.close()


def test_an_image_the_store_lost_is_sent_again(world: ImageWorld) -> None:
    """The gateway does not resend an image it stored, but names it; one the store lost (a
    Redis restart that lost its last writes under appendfsync everysec, here deleted from
    Redis) is sent again with the next call that carries it, so the call's hash resolves."""
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 60))
    x = unique_png()
    msg = {"role": "user", "content": [image_part(x)]}
    client.chat.completions.create(model="tiny", messages=[msg])
    assert world.stored_images()[sha(x)] == x
    r = redis.Redis.from_url(world.redis_url)
    try:
        assert r.delete(f"{world.prefix}img:{sha(x)}") == 1
    finally:
        r.close()
    client.chat.completions.create(model="tiny", messages=[msg, {"role": "assistant",
                                   "content": "a square"}, {"role": "user", "content": "and?"}])
    second = world.calls(rid)[1]
    assert [i.sha256 for i in second.images] == [sha(x)]
    assert world.stored_images()[sha(x)] == x
    got = world.store.put_images([], present=[sha(x), sha(b"never stored")])
    assert list(got.missing) == [sha(b"never stored")]


@pytest.mark.parametrize("name,put,get", [
    ("gateway", True, True), ("trainer", True, True), ("reader", False, True),
    ("operator", False, True), ("controller", False, False), ("grader", False, False)])
def test_image_store_authorization(store_service: StoreService, name: str, put: bool,
                                   get: bool) -> None:
    """The gateway and the trainer read and write images; viewers read; the controller and
    graders (which run next to the agent's code) neither. A rollout has no store identity at
    all: its one credential is its gateway key, which serves no image route."""
    store = StoreClient.connect(store_service.address, timeout=10, ident=as_identity(name))
    try:
        for allowed, rpc in ((put, lambda: store.put_images([spb.StoredImage(
                media_type="image/png", data=RED)])),
                             (get, lambda: store.get_images([sha(RED)]))):
            if allowed:
                rpc()
            else:
                with pytest.raises(grpc.RpcError) as denied:
                    rpc()
                assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        store.close()


def test_rollout_key_reaches_no_image_route(world: ImageWorld) -> None:
    rid = world.rollout()
    r = httpx.get(f"{world.gateway.base_url}/harnessrl/images/{sha(RED)}",
                  headers={"Authorization": f"Bearer {SIGNER.mint(rid, 1, 60)}"})
    assert r.status_code == 404


# -- a real vLLM serving the project's tiny VLM ----------------------------------------------
@pytest.fixture(scope="module")
def vlm_world(vision_engine: Any, vision_model_dir: Path, redis_url: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A store and a gateway in front of the tiny VLM's vLLM, with its processor folder."""
    tmp = tmp_path_factory.mktemp("vlm")
    store = StoreService(tmp / "store", redis_url, f"t{uuid.uuid4().hex[:10]}:").start()
    w = World.__new__(World)
    w.store_svc, w.store, w.engines, w._n = store, StoreClient.connect(store.address), [], 0
    w.gateway = GatewayService(
        tmp / "gw", store.address, [{"name": "vlm", "base_url": vision_engine.base_url,
                                     "model": vision_engine.model_name}],
        "--processor-dirs", json.dumps({vision_engine.model_name: str(vision_model_dir)}))
    w.admin = GatewayAdminClient.connect(w.gateway.admin_address)
    try:
        yield w
    finally:
        w.close()
        store.stop()


@pytest.mark.vllm
def test_image_through_the_gateway_to_vllm_is_recorded_exactly(
        vlm_world: World, vision_engine: Any, vision_model_dir: Path) -> None:
    model = vision_engine.model_name
    rng = random.Random(45)
    picture = draw_shape("red", "triangle", rng, 80)
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    data = buf.getvalue()
    question = "What colour is the shape?"
    rid = vlm_world.rollout()
    key = SIGNER.mint(rid, 1, 120)
    client = openai.OpenAI(base_url=vlm_world.gateway.base_url, api_key=key, max_retries=0,
                           timeout=120)
    # (a data URL with a parameter: the gateway forwards it as data:image/png;base64,...)
    url = f"data:image/png;name=shape.png;base64,{b64(data)}"
    resp = client.chat.completions.create(
        model=model, max_tokens=4, temperature=0, logprobs=True,
        messages=[{"role": "user", "content": [{"type": "text", "text": question},
                                               {"type": "image_url", "image_url": {"url": url}}]}],
        extra_body={"return_token_ids": True})
    engine_prompt = (resp.model_extra or {})["prompt_token_ids"]
    engine_completion = (resp.choices[0].model_extra or {})["token_ids"]
    [call] = vlm_world.calls(rid)
    # the prompt ids vLLM returned, placeholders expanded, are the recorded ones ...
    assert list(call.prompt_token_ids) == engine_prompt
    assert list(call.completion_token_ids) == engine_completion
    # ... and what the model's own processor makes of the same message and image
    processor = load_processor(vision_model_dir)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": question}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)
    ids = list(processor(text=text, images=[picture])["input_ids"][0])
    assert ids == engine_prompt
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert ids.count(image_id) == VisionRecipe().image_seq_len
    # logprobs: one per completion token, those the engine returned
    assert resp.choices[0].logprobs is not None and resp.choices[0].logprobs.content
    assert list(call.logprobs) == pytest.approx(
        [t.logprob for t in resp.choices[0].logprobs.content], abs=1e-6)
    assert len(call.logprobs) == len(call.completion_token_ids) > 0
    # the hash resolves to the exact bytes sent; the settings are the model folder's
    [ref] = call.images
    assert ref.sha256 == sha(data) and ref.media_type == "image/png"
    [stored] = vlm_world.store.get_images([ref.sha256]).images
    assert stored.found and stored.data == data
    settings = json.loads(call.processor_json)
    assert settings["files"]["processor_config.json"] == json.loads(
        (vision_model_dir / "processor_config.json").read_text())
    recipe = VisionRecipe()
    assert settings["vision"] == {
        "vision_config.image_size": recipe.image_size,
        "vision_config.patch_size": recipe.patch_size, "scale_factor": recipe.scale_factor,
        "image_token_id": image_id}
    assert call.segment_start == c.SEGMENT_START_MEDIA
    # the record rebuilds the engine's computation: transformers, given the recorded ids and
    # the pixels of the stored bytes, gives the recorded logprobs (a gateway that sent the
    # engine other pixels than it stored fails here)
    pixels = processor(text=text, images=[PILImage.open(io.BytesIO(stored.data))],
                       return_tensors="pt")
    full = torch.tensor([list(call.prompt_token_ids) + list(call.completion_token_ids)])
    vlm = AutoModelForImageTextToText.from_pretrained(vision_model_dir)
    with torch.no_grad():
        logits = vlm(input_ids=full, attention_mask=torch.ones_like(full),
                     pixel_values=pixels["pixel_values"],
                     pixel_attention_mask=pixels["pixel_attention_mask"]).logits[0]
    n = len(call.prompt_token_ids)
    logp = torch.log_softmax(logits[n - 1:-1], dim=-1)
    assert [logp[i, t].item() for i, t in enumerate(call.completion_token_ids)] == \
        pytest.approx(list(call.logprobs), abs=1e-3)

    # the same image through the Anthropic SDK: the same prompt ids, the same stored image
    ac = anthropic.Anthropic(base_url=vlm_world.gateway.base_url[:-3], api_key=key,
                             max_retries=0, timeout=120)
    ac.messages.create(model=model, max_tokens=4, messages=[{
        "role": "user", "content": [{"type": "text", "text": question}, {"type": "image",
                                                                          "source": {
            "type": "base64", "media_type": "image/png", "data": b64(data)}}]}])
    # and a screenshot in a tool result: both images expanded, both stored
    other = io.BytesIO()
    draw_shape("blue", "circle", rng, 50).save(other, format="PNG")
    ac.messages.create(model=model, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": question},
                                     {"type": "image", "source": {
                                         "type": "base64", "media_type": "image/png",
                                         "data": b64(data)}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(other.getvalue())}}]}]}])
    _, second, third = vlm_world.calls(rid)
    assert list(second.prompt_token_ids) == engine_prompt
    assert [i.sha256 for i in second.images] == [sha(data)]
    assert list(third.prompt_token_ids).count(image_id) == 2 * VisionRecipe().image_seq_len
    assert [i.sha256 for i in third.images] == [sha(data), sha(other.getvalue())]
    assert vlm_world.store.get_images([sha(other.getvalue())]).images[0].data == \
        other.getvalue()


# -- fetching image URLs (a run that enables it) ---------------------------------------------
class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.server.hosts.append(self.headers["Host"])  # type: ignore[attr-defined]
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/red.png")
            self.end_headers()
            return
        if self.path == "/slow":
            time.sleep(3)
        body = {"/red.png": RED, "/big": noisy_png(), "/text": b"not an image"}.get(self.path)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def image_server() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.hosts = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("ip,public", [
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("::1", False), ("fe80::1%eth0", False), ("fc00::1", False), ("::ffff:127.0.0.1", False),
    ("::ffff:10.0.0.1", False), ("not-an-ip", False),
    # IPv6 forms that carry an IPv4 address (NAT64, 6to4, Teredo, IPv4-compatible and
    # -translated) and the old site-local range
    ("64:ff9b::a00:1", False), ("64:ff9b:1::1", False), ("2002:a00:1::", False),
    ("2001::1", False), ("::127.0.0.1", False), ("::ffff:0:7f00:1", False), ("fec0::1", False),
    ("93.184.216.34", True), ("8.8.8.8", True), ("2606:4700::1111", True)])
def test_only_public_addresses_are_fetched_from(ip: str, public: bool) -> None:
    assert public_address(ip) is public


def _fetcher(server: http.server.ThreadingHTTPServer, *addresses: str,
             timeout_s: float = 2.0) -> ImageFetcher:
    """A fetcher whose names resolve to `addresses`, and which connects to `server` where the
    address it checked was 93.184.216.34 (a test double: nothing public is reachable here)."""
    async def resolve(host: str, port: int) -> list[str]:
        return list(addresses)
    return ImageFetcher(MAX_IMAGE_BYTES, timeout_s, resolve=resolve,
                        connect_port={"93.184.216.34": server.server_address[1]})


def test_fetcher_checks_addresses_redirects_size_and_time(
        image_server: http.server.ThreadingHTTPServer) -> None:
    public = _fetcher(image_server, "93.184.216.34")
    assert asyncio.run(public.fetch("http://images.example/red.png")) == RED
    assert image_server.hosts == ["images.example"]  # type: ignore[attr-defined]
    for fetcher, url, problem in [
        (_fetcher(image_server, "93.184.216.34", "10.0.0.7"), "http://images.example/red.png",
         "resolves to 10.0.0.7, not a public address"),  # every address is checked
        (_fetcher(image_server), "http://images.example/red.png", "resolves to nothing"),
        (public, "http://images.example/redirect", "redirects are not followed"),
        (public, "http://images.example/big", "byte limit"),
        (_fetcher(image_server, "93.184.216.34", timeout_s=0.5), "http://images.example/slow",
         "took over 0.5 s"),
        (public, "http://user:pw@images.example/red.png", "credentials"),
        (public, "http://images.example/missing", "answered 404"),
    ]:
        with pytest.raises(FetchRefused, match=problem):
            asyncio.run(fetcher.fetch(url))
    # the real resolver: loopback by name or by number is refused before any connection
    real = ImageFetcher(MAX_IMAGE_BYTES, 2.0)
    port = image_server.server_address[1]
    before = list(image_server.hosts)  # type: ignore[attr-defined]
    for url in (f"http://localhost:{port}/red.png", f"http://127.0.0.1:{port}/red.png",
                f"http://2130706433:{port}/red.png", f"http://[::1]:{port}/red.png"):
        with pytest.raises(FetchRefused, match="not a public address|does not resolve"):
            asyncio.run(real.fetch(url))
    assert image_server.hosts == before  # type: ignore[attr-defined]


def test_fetched_images_are_checked_and_forwarded_inline(
        image_server: http.server.ThreadingHTTPServer) -> None:
    images = GatewayImages(None, MAX_IMAGE_BYTES, 3, {}, 1.0)
    images.fetcher = _fetcher(image_server, "93.184.216.34")

    class Run:  # what GatewayImages reads of a gateway session
        fetch_images, max_image_bytes = True, 0
        cred = types.SimpleNamespace(rollout_id="r/t/0")
    messages: list[Any] = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://images.example/red.png"}}]}]
    found = asyncio.run(images.collect(images.request(Run()), messages, "tiny"))
    assert found is not None and [i.sha256 for i in found.images] == [sha(RED)]
    # vLLM gets the bytes the gateway checked, as a data URL: it fetches nothing itself
    assert messages[0]["content"][0]["image_url"]["url"] == data_url(RED)
    for path, code in (("/text", "unsupported_media_type"), ("/redirect", "image_fetch_refused")):
        with pytest.raises(Invalid) as bad:
            asyncio.run(images.collect(images.request(Run()), [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"http://images.example{path}"}}]}],
                "tiny"))
        assert bad.value.code == code
        assert bad.value.loc == ("messages", 0, "content", 0, "image_url", "url")


def test_a_run_that_fetches_image_urls_still_refuses_loopback(
        world: ImageWorld, image_server: http.server.ThreadingHTTPServer) -> None:
    """Through the gateway: the run's setting turns fetching on, and a URL on this machine is
    refused (400), never fetched."""
    run_id = f"fetch-{uuid.uuid4().hex[:6]}"
    world.store.put_run(c.Run(run_id=run_id, spec=c.RunSpec(fetch_image_urls=True)))
    rid = f"{run_id}/t/0"
    world.store.create_rollouts([c.Rollout(rollout_id=rid, run_id=run_id, task_id="t",
                                           group_id=f"{run_id}/t", group_size=1, stream="-")])
    world.store.start_attempt(rid, 1)
    key = SIGNER.mint(rid, 1, 60)
    url = f"http://localhost:{image_server.server_address[1]}/red.png"
    with pytest.raises(openai.BadRequestError) as refused:
        world.client(key).chat.completions.create(model="tiny", messages=[{
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert refused.value.body["code"] == "image_fetch_refused"  # type: ignore[index]
    assert "not a public address" in refused.value.body["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as am:
        world.anthropic(key).messages.create(model="tiny", max_tokens=8, messages=[{
            "role": "user", "content": [{"type": "image", "source": {"type": "url",
                                                                     "url": url}}]}])
    assert "messages.0.content.0.source.url" in str(am.value)
    assert image_server.hosts == []  # type: ignore[attr-defined]
    assert world.calls(rid) == []


@pytest.mark.vllm
def test_a_local_stack_records_its_vision_models_processor_settings(
        vision_engine: Any, vision_model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    """`harnessrl up`'s stack gives its gateway the model folder's processor files when the
    model has them (a vision model): an image call through it is recorded with them."""
    from conftest import running_rollout
    from harnessrl.credentials import load_secret
    from harnessrl.identity import Identity
    from harnessrl.local.stack import Stack, StackConfig

    cfg = StackConfig(state_dir=tmp_path / "stack", redis_url=redis_url,
                      key_prefix=f"t{uuid.uuid4().hex[:10]}:", model_dir=vision_model_dir,
                      num_engines=0, external_engines=(vision_engine.base_url,),
                      served_model_name=vision_engine.model_name, weight_transfer_backend=None)
    with Stack(cfg) as stack:
        store = StoreClient.connect(stack.store_address,
                                    ident=Identity.from_folder(stack.tls / "controller"))
        rid, key = running_rollout(store, load_secret(None, stack.secret_file))
        client = openai.OpenAI(base_url=stack.gateway_url, api_key=key, max_retries=0,
                               timeout=120)
        client.chat.completions.create(
            model=vision_engine.model_name, max_tokens=2, temperature=0,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "What colour is the shape?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(RED)}"}}
            ]}])
        [call] = store.get_rollout(rid, include_calls=True).calls
        store.close()
    assert [i.sha256 for i in call.images] == [sha(RED)]
    settings = json.loads(call.processor_json)
    assert settings["files"]["processor_config.json"] == json.loads(
        (vision_model_dir / "processor_config.json").read_text())
