"""Images in every API the gateway serves, recorded exactly (issue #45).

What each API takes, normalised to what vLLM takes (chat `image_url` parts with data URLs):

- chat completions: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`;
- Responses: `{"type": "input_image", "image_url": "data:..."}` (`responses.py`);
- Anthropic Messages: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`
  (`anthropic.py`).

Each image is checked before anything goes to the engine (`RequestImages`): a data URL with
base64 data, of a supported type (PNG, JPEG, GIF, WebP: read from its bytes), at most
`max_image_bytes` decoded, at most `max_images` per request. Http(s) URLs are refused, unless
the run enables fetching them (`RunSpec.fetch_image_urls`, `image_fetch.py`: public addresses
only, no redirects, size and time bounded; the fetched bytes are checked as inline ones and
forwarded as a data URL). Anything else is a 400 in the API's own error shape, naming the
field.

Recorded with the call (`RequestImages.fields`): each image's sha256 in prompt order
(`Call.images`), the processor settings of the served model (`Call.processor_json`, read from
the model folders of `processor_dirs`), and the request body with each image's data replaced by
`sha256:<hex>`. The bytes go to the store's content-addressed image store (`image_store.py`)
before the engine is asked, so a recorded call's images always resolve; a hash this gateway
stored already is not sent again (a harness resends a conversation's images every turn).
The prompt ids are the engine's (`return_token_ids`), image placeholders expanded. vLLM 0.32
takes no prompt ids with media, so a call with images starts a token segment of its own
(`SEGMENT_START_MEDIA`, `app._plan_tokens`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from harnessrl.v1 import common_pb2 as c
from services.gateway.schemas import Invalid, Loc

MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
_ALIASES = {"image/jpg": "image/jpeg"}
# chat content parts that carry media vLLM would take but the gateway cannot record
_UNRECORDED = frozenset(("image", "image_pil", "image_embeds", "input_image", "audio_url",
                         "input_audio", "audio_embeds", "video_url", "file"))
# keys of a content part vLLM 0.32 reads media from whatever its `type` says (when the part has
# a `uuid`, `chat_utils._parse_chat_message_content_mm_part`): only a checked image_url's own
_MEDIA_KEYS = _UNRECORDED | {"image_url", "uuid"}
REF_PREFIX = "sha256:"  # an image's data in a recorded request body


def _media_type(declared: str) -> str:
    value = declared.strip().lower()
    return _ALIASES.get(value, value)


def sniff(data: bytes) -> str | None:
    """The image type of `data` from its first bytes (None: not one the gateway takes)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def has_parts(request: dict[str, Any]) -> bool:
    """Whether a chat request has a message with list content (the only place parts, images
    among them, can be): a text-only request skips the image checks (the gateway's hot path)."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               for m in request.get("messages") or ())


def chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's chat content from its text and image_url parts: the parts when one is an
    image, else their text joined (what a text-only message was before images)."""
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _check_type(media_type: str, where: Loc) -> None:
    if _media_type(media_type) not in MEDIA_TYPES:
        raise Invalid(where, f"image type {media_type[:60]!r} is not supported (supported: "
                             f"{', '.join(MEDIA_TYPES)})", "unsupported_media_type")


@dataclass(frozen=True, slots=True)
class Image:
    sha256: str  # hex of `data`
    media_type: str  # from the bytes (`sniff`)
    data: bytes

    def ref(self) -> c.ImageRef:
        return c.ImageRef(sha256=self.sha256, media_type=self.media_type,
                          size_bytes=len(self.data))


@dataclass(slots=True)
class RequestImages:
    """The images of one request: checked where each API names them, then collected in the
    order of the chat messages sent to the engine (`collect`)."""

    max_bytes: int
    max_images: int
    fetch: bool = False  # http(s) URLs are fetched (RunSpec.fetch_image_urls): `pending`
    processor: bytes = b""  # the served model's processor settings (Call.processor_json)
    rollout_id: str = ""  # whose bound the images new to the store count against
    max_rollout_bytes: int = 0  # that bound (RunSpec.max_rollout_image_bytes or the gateway's)
    images: list[Image] = field(default_factory=list)  # in prompt order (after `collect`)
    raw: dict[str, Image] = field(default_factory=dict)  # each string decoded -> its image
    _normal: dict[str, str] = field(default_factory=dict)  # each URL checked -> as forwarded
    pending: dict[str, Loc] = field(default_factory=dict)  # http(s) URLs to fetch -> where

    def data_url(self, url: Any, where: Loc) -> str:
        """Checks an image URL (a data URL with base64 data); returns it as forwarded:
        `data:<type>;base64,<data>`, the type lowercased (`image/jpg` as `image/jpeg`) and
        other parameters dropped."""
        if not isinstance(url, str):
            raise Invalid(where, "an image URL (a string) is required", "invalid_image")
        if url in self._normal:
            return self._normal[url]
        scheme = url[:8].lower()
        if scheme.startswith(("http://", "https://")):
            if not self.fetch:
                raise Invalid(where, "image URLs are not fetched for this run: send the image "
                                     "inline (a data:image/...;base64,... URL, or base64 data)",
                              "image_url_not_supported")
            self.pending.setdefault(url, where)
            return url  # until fetched (`fetched`)
        head, comma, data = url.partition(",")
        if not head.lower().startswith("data:") or not comma:
            raise Invalid(where, "a data URL (data:image/png;base64,...) is required",
                          "invalid_image")
        params = head[5:].split(";")
        if "base64" not in (p.strip().lower() for p in params[1:]):
            raise Invalid(where, "the data URL must hold base64 data (data:<type>;base64,...)",
                          "invalid_image")
        image = self._decode(params[0], data, where)
        normal = f"data:{_media_type(params[0])};base64,{data}"
        self.raw[url] = self.raw[normal] = image
        self._normal[url] = self._normal[normal] = normal
        return normal

    def base64(self, media_type: Any, data: Any, where: Loc) -> str:
        """Checks base64 image data (Anthropic's `source`); returns it as a data URL."""
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise Invalid(where, "'media_type' and 'data' (strings) are required",
                          "invalid_image")
        _check_type(media_type, (*where, "media_type"))
        image = self.raw.get(data) or self._decode(media_type, data, (*where, "data"))
        self.raw[data] = image
        url = f"data:{_media_type(media_type)};base64,{data}"
        self.raw[url], self._normal[url] = image, url
        return url

    def _decode(self, media_type: str, data: str, where: Loc) -> Image:
        _check_type(media_type, where)
        if len(data) // 4 * 3 > self.max_bytes + 3:  # before decoding it
            raise Invalid(where, f"image over the gateway's {self.max_bytes}-byte limit "
                                 "(max_image_bytes)", "image_too_large")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as err:
            raise Invalid(where, f"image data is not valid base64 ({err})",
                          "invalid_image") from None
        return self._image(raw, where)

    def _image(self, raw: bytes, where: Loc) -> Image:
        if len(raw) > self.max_bytes:
            raise Invalid(where, f"image of {len(raw)} bytes, over the gateway's "
                                 f"{self.max_bytes}-byte limit (max_image_bytes)",
                          "image_too_large")
        found = sniff(raw)
        if found is None:
            raise Invalid(where, "the image data is not a PNG, JPEG, GIF or WebP image",
                          "unsupported_media_type")
        return Image(hashlib.sha256(raw).hexdigest(), found, raw)

    def collect(self, messages: Any) -> list[Image]:
        """The images of the chat `messages` (as sent to the engine), in prompt order, each
        checked (`data_url`); refuses media parts the gateway does not record."""
        out: list[Image] = []
        for i, msg in enumerate(messages or ()):
            content = msg.get("content") if isinstance(msg, dict) else None
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                where: Loc = ("messages", i, "content", j)
                extra = sorted(k for k in _MEDIA_KEYS & part.keys() if k != kind) \
                    if isinstance(part, dict) else []
                if extra:  # (vLLM would take them, unchecked and unrecorded)
                    raise Invalid((*where, extra[0]), f"a {kind!r} content part may not carry "
                                  f"{extra[0]!r}", "unsupported_content")
                if kind == "image_url":
                    spec = part.get("image_url")
                    if not isinstance(spec, dict):
                        raise Invalid((*where, "image_url"), "an object with 'url' is required",
                                      "invalid_image")
                    spec["url"] = self.data_url(spec.get("url"), (*where, "image_url", "url"))
                    if spec["url"] in self.raw:  # (else an http(s) URL yet to be fetched)
                        out.append(self.raw[spec["url"]])
                elif kind in _UNRECORDED:
                    raise Invalid((*where, "type"), f"content parts of type {kind!r} are not "
                                  "supported: images go in image_url parts with data URLs",
                                  "unsupported_content")
        if len(out) > self.max_images:
            raise Invalid(("messages",), f"{len(out)} images in one request: at most "
                                         f"{self.max_images} (max_images)", "too_many_images")
        self.images = out
        return out

    def fetched(self, url: str, data: bytes) -> None:
        """A pending URL's bytes, checked as an inline image's; forwarded as a data URL."""
        image = self._image(data, self.pending.pop(url))
        normal = f"data:{image.media_type};base64,{base64.b64encode(data).decode()}"
        self.raw[normal] = image
        self._normal[url] = self._normal[normal] = normal

    def fields(self, call: c.Call) -> None:
        """Records the images on `call`: their hashes, the processor settings, and the request
        body with each image's data replaced by `sha256:<hex>`."""
        if not self.images:
            return
        call.images.extend(img.ref() for img in self.images)
        call.processor_json = self.processor
        call.request_json = redact(call.request_json, self.raw)


def redact(body: bytes, raw: dict[str, Image]) -> bytes:
    """`body` (JSON) with every string that is an image's data replaced by its reference."""
    def walk(value: Any) -> Any:
        if isinstance(value, str):
            image = raw.get(value) if len(value) > 16 else None
            return REF_PREFIX + image.sha256 if image is not None else value
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value
    try:
        return orjson.dumps(walk(orjson.loads(body)))
    except orjson.JSONDecodeError:
        return body
