"""The pixels of recorded images, for a trainer whose model is a vision-language model (issue #45,
docs/vision.md): what turns a recorded call's image hashes into the pixel inputs the engine
computed its logprobs from.

- **Which model.** A model folder whose config.json has a `vision_config` is a vision model
  (`is_vision_model`): it loads with `AutoModelForImageTextToText` (`model_class`), and its
  processor with `AutoProcessor` from the folder the run starts from (`model_path`: a
  checkpoint holds the weights and the tokenizer, not the processor), with the image processor
  class that folder pins (the tiny VLM's: `Idefics3ImageProcessorPil`, no torchvision).
- **The bytes** come from the store's image store (`Store.GetImages`, by sha256), fetched per
  group before its advantages are computed (`ImagePixels.fetch`): a rollout an image of which
  the store does not hold is left out with the reason ("missing image: ..."), as a failed
  rollout is; the trainer goes on.
- **The pixels** are the processor's (`ImagePixels.pixels`), of the images decoded as vLLM 0.32
  decodes them (`engine_image`: EXIF orientation applied, transparency over white, RGB).
  Before, the call's recorded processor settings (`Call.processor_json`, made by the gateway
  from the served model's folder with `harnessrl.processor_settings`) must equal the settings
  of the trainer's folder (the served name left out): other settings would give other pixels,
  and the trainer would silently learn from images the policy never saw. A call recorded
  without settings (a gateway without `processor_dirs`) is refused too: nothing shows its
  pixels are the engine's. After, the prompt's `<image>` tokens must be as many as the pixels
  give (patches x `image_seq_len`), so no image goes missing in between. Both are errors of the
  group (ValueError: in sync mode the stream reader redelivers it, then dead-letters it; in
  the pool modes, which build a step's samples when they take its groups, before any hold, the
  trainer stops, as for any group whose samples cannot be built). So is a call that names no
  image and whose prompt holds image tokens (nothing would give them their pixels).
- **The forward** (`pixel_inputs`): a micro-batch with images passes `pixel_values` and
  `pixel_attention_mask`, the samples' images padded with all-zero images, which Idefics3
  removes before its vision tower; a micro-batch without images passes nothing (as a text
  model's).

Refused at start-up (`check_vision_run`): a vision model with more than one trainer process
(FSDP2: `sharding.shard_model` wraps the text model's layers only; not tried with the vision
tower) and with LoRA (the adapter's target modules, its push into vLLM's Idefics3: not tried).
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps

from harnessrl.processor_settings import processor_settings
from harnessrl.v1 import common_pb2 as c

from .samples import Sample

log = logging.getLogger("harnessrl.trainer")

GET_BATCH = 32  # hashes per GetImages request at most ...
GET_BATCH_BYTES = 64 * 1024 * 1024  # ... and recorded bytes (an answer stays well under gRPC's
# 256 MiB message bound, harnessrl/rpc.py; one image over it goes alone)


def is_vision_model(folder: str | Path) -> bool:
    """Whether the model saved in `folder` is a vision-language model (config.json has a
    `vision_config`)."""
    config = Path(folder) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def model_class(folder: str | Path) -> Any:
    """The transformers auto class that loads the model in `folder`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(folder) else AutoModelForCausalLM


def check_vision_run(cfg: Any, world_size: int) -> None:
    """Refuses what the trainer does not do with a vision model (cfg: `TrainerConfig`)."""
    if world_size > 1:
        raise ValueError(
            f"{cfg.model_path} is a vision model and the trainer runs {world_size} processes "
            "(FSDP2): a sharded vision model is not implemented (sharding.py wraps the text "
            "model's layers only, not the vision tower); use nproc=1 (docs/vision.md)")
    if cfg.lora is not None:
        raise ValueError(
            f"{cfg.model_path} is a vision model and lora is set: LoRA on a vision model is "
            "not implemented (the adapter's target modules would reach into the vision tower, "
            "and its push into vLLM's Idefics3 is untested); train all weights, without lora "
            "(docs/vision.md)")


def vision_pixels(cfg: Any, source: str | Path, world_size: int, store: Any
                  ) -> ImagePixels | None:
    """The trainer's `ImagePixels` when the model it loads from `source` (the initial model or
    a checkpoint) is a vision model, else None; refuses what `check_vision_run` refuses. The
    processor is the initial model's (`model_path`): a checkpoint does not hold it."""
    if not is_vision_model(source):
        return None
    check_vision_run(cfg, world_size)
    return ImagePixels.load(cfg.model_path or source, store)


def engine_image(data: bytes) -> Image.Image:
    """`data` decoded as vLLM 0.32 decodes an image (vllm/multimodal/media/image.py): EXIF
    orientation applied, an image with transparency put on white, then RGB."""
    image: Image.Image = Image.open(io.BytesIO(data))
    try:
        image = ImageOps.exif_transpose(image)
    except Exception:  # noqa: BLE001 - vLLM ignores a broken EXIF block too
        pass
    image.load()
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.split()[3])
        return out
    return image.convert("RGB")


def _settings(raw: bytes | str) -> dict[str, Any]:
    """Processor settings without the served model's name (the engine's and the trainer's names
    of one model may differ)."""
    data = json.loads(raw)
    data.pop("model", None)
    return data


class ImagePixels:
    """`samples.PixelSource` from the store's image store and the model's own processor."""

    def __init__(self, processor: Any, folder: str | Path, store: Any) -> None:
        self.processor = processor
        self.folder = str(folder)
        self.store = store  # harnessrl.clients.StoreClient
        self.settings = _settings(processor_settings("trainer", folder))
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(str(processor.image_token))
        self.image_seq_len = int(processor.image_seq_len)
        self._data: dict[str, bytes] = {}  # sha256 -> bytes, of the group fetched last

    @classmethod
    def load(cls, folder: str | Path, store: Any) -> ImagePixels:
        """The processor saved in `folder` (AutoProcessor: the image processor class it pins)."""
        from transformers import AutoProcessor

        return cls(AutoProcessor.from_pretrained(str(folder)), folder, store)

    def fetch(self, rollouts: Sequence[c.Rollout]) -> dict[str, str]:
        needed = {i.sha256: i.size_bytes for r in rollouts for call in r.calls
                  if not call.aborted for i in call.images}
        self._data = {}
        if needed and self.store is None:
            raise RuntimeError("the trainer has no store client to fetch images from")
        for part in _batches(needed):
            got = self.store.get_images(part).images
            self._data.update((h, g.data) for h, g in zip(part, got, strict=True) if g.found)
        reasons = {}
        for r in rollouts:
            missing = [(call.seq, i.sha256) for call in r.calls if not call.aborted
                       for i in call.images if i.sha256 not in self._data]
            if missing:
                seq, sha = missing[0]
                reasons[r.rollout_id] = (f"missing image: call {seq}'s image {sha} is not in "
                                         f"the image store ({len(missing)} missing)")
        if reasons:  # the store's image_retention_s shorter than a group's wait to be trained?
            log.warning("%d rollouts left out: images the store does not hold (%s)",
                        len(reasons), next(iter(reasons.values())))
        return reasons

    def pixels(self, rollout_id: str, call: c.Call) -> dict[str, Any] | None:
        where = f"rollout {rollout_id} call {call.seq}"
        if not call.images:  # a call's prompt is its whole conversation, images included
            if self.image_token_id in call.prompt_token_ids:
                raise ValueError(f"{where}: its prompt holds image tokens and the call names no "
                                 "image: its pixels cannot be rebuilt")
            return None
        if not call.processor_json:
            raise ValueError(f"{where}: recorded without processor settings (a gateway without "
                             "processor_dirs): nothing shows its pixels would be the engine's")
        if _settings(call.processor_json) != self.settings:
            raise ValueError(
                f"{where}: recorded with other processor settings than the trainer's processor "
                f"({self.folder}): the trainer would learn from other pixels than the engine "
                f"saw. Recorded: {_settings(call.processor_json)}; trainer's: {self.settings}")
        images = [engine_image(self._data[i.sha256]) for i in call.images]
        out = self.processor.image_processor([images], return_tensors="pt")
        inputs = {k: out[k] for k in ("pixel_values", "pixel_attention_mask") if k in out}
        placeholders = list(call.prompt_token_ids).count(self.image_token_id)
        expected = inputs["pixel_values"].shape[1] * self.image_seq_len
        if placeholders != expected:
            raise ValueError(f"{where}: its prompt holds {placeholders} image tokens, and its "
                             f"{len(images)} images give {expected}")
        return inputs


def _batches(sizes: dict[str, int]) -> list[list[str]]:
    """The hashes in GetImages requests of at most GET_BATCH hashes and GET_BATCH_BYTES
    recorded bytes (an image over that alone)."""
    out: list[list[str]] = []
    total = GET_BATCH_BYTES + 1
    for h, size in sizes.items():
        if len(out) == 0 or len(out[-1]) >= GET_BATCH or total + size > GET_BATCH_BYTES:
            out.append([])
            total = 0
        out[-1].append(h)
        total += size
    return out


def pixel_inputs(rows: Sequence[Sample], device: torch.device) -> dict[str, torch.Tensor]:
    """The pixel inputs of one micro-batch (the module docstring): {} when no row has images.
    Each row's images are padded with all-zero ones (and their height and width with zeros, the
    mask false there, as the processor pads the images of one call)."""
    parts = [s.pixels["pixel_values"][0] for s in rows if s.pixels]
    if not parts:
        return {}
    shape = [max(p.shape[d] for p in parts) for d in range(4)]  # images, channels, H, W
    values = torch.zeros((len(rows), *shape), dtype=parts[0].dtype)
    mask = torch.zeros((len(rows), shape[0], *shape[2:]), dtype=torch.bool)
    for k, s in enumerate(rows):
        if s.pixels:
            v = s.pixels["pixel_values"][0]
            n, _, h, w = v.shape
            values[k, :n, :, :h, :w] = v
            m = s.pixels.get("pixel_attention_mask")
            mask[k, :n, :h, :w] = True if m is None else m[0].bool()
    return {"pixel_values": values.to(device), "pixel_attention_mask": mask.to(device)}
