"""The tiny vision-language model (harnessrl/model/vision.py, issue #45): its chat template,
transformers loading and generation, a differently shaped build, and, with a real vLLM, that the
prompt ids the project's processor makes equal the ids vLLM returns (`return_token_ids`), with
the image placeholders expanded, for one single-image and one two-image multi-turn call."""

from __future__ import annotations

import base64
import dataclasses
import io
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models
from transformers import AutoModelForImageTextToText, PreTrainedTokenizerFast

from harnessrl.model import calc_task
from harnessrl.model.tokenizer import CHAT_TEMPLATE, IM_END
from harnessrl.model.vision import (
    ALT_RECIPE,
    IMAGE_TOKEN,
    VISION_CHAT_TEMPLATE,
    VISION_TOKENS,
    VisionRecipe,
    build_vision_model,
    draw_shape,
    load_processor,
    make_example,
)


def _png_data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _openai_messages(messages: list[dict[str, Any]], images: list[Image.Image]
                     ) -> list[dict[str, Any]]:
    """The same messages as an OpenAI client sends them: each image part an image_url."""
    it = iter(images)
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": _png_data_url(next(it))}}
                       if part["type"] == "image" else part for part in content]
        out.append({**m, "content": content})
    return out


def _cases() -> dict[str, tuple[list[dict[str, Any]], list[Image.Image]]]:
    rng = random.Random(3)
    single, img, _ = make_example(rng)
    two: list[dict[str, Any]] = [
        {"role": "system", "content": "You look at pictures."},
        {"role": "user", "content": [{"type": "text", "text": "First:"}, {"type": "image"},
                                     {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": "blue"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
    ]
    # images of other sizes than the model's: the processor resizes them
    return {"single-image": (single, [img]),
            "two-image": (two, [draw_shape("blue", "triangle", rng, 80),
                                draw_shape("red", "circle", rng, 50)])}


CASES = _cases()


def _prompt_ids(processor: Any, messages: list[dict[str, Any]],
                images: list[Image.Image]) -> list[int]:
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(processor(text=text, images=images)["input_ids"][0])


def test_template_renders_string_content_as_the_text_model() -> None:
    """Text-only calls render exactly as with the text model's template (tools included)."""
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    rng = random.Random(0)
    chat = calc_task.dialogue(calc_task.make_task(rng, "t"), True, rng)
    chat = [{"role": "system", "content": calc_task.SYSTEM_PROMPT}, *chat]
    for tools in (calc_task.TOOLS, None):
        a = tok.apply_chat_template(chat, tools=tools, tokenize=False,
                                    chat_template=CHAT_TEMPLATE)
        b = tok.apply_chat_template(chat, tools=tools, tokenize=False,
                                    chat_template=VISION_CHAT_TEMPLATE)
        assert a == b
    parts = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image"},
                                          {"type": "image_url", "image_url": {"url": "x"}},
                                          {"type": "text", "text": "B"}]}]
    assert tok.apply_chat_template(parts, tokenize=False, add_generation_prompt=True,
                                   chat_template=VISION_CHAT_TEMPLATE) == \
        "<|im_start|>user\nA<image><image>B<|im_end|>\n<|im_start|>assistant\n"


def test_transformers_loads_and_generates(vision_model_dir: Path) -> None:
    processor = load_processor(vision_model_dir)
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"
    tok = processor.tokenizer
    for t in VISION_TOKENS:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    model = AutoModelForImageTextToText.from_pretrained(vision_model_dir)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    messages, images = CASES["single-image"]
    ids = _prompt_ids(processor, messages, images)
    n = VisionRecipe().image_seq_len
    assert ids.count(tok.convert_tokens_to_ids(IMAGE_TOKEN)) == n
    inputs = processor(text=processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False), images=images,
        return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    # the warm-up taught it the answer format: one word, then the end of the turn
    assert tok.convert_tokens_to_ids(IM_END) in new[:4], tok.decode(new)


def test_differently_shaped_build(tmp_path: Path) -> None:
    """The alternative recipe's shapes (3 text layers, 96-pixel images of 16-pixel patches),
    built without warm-up: loads, and expands each image to its own 9 tokens."""
    recipe = dataclasses.replace(ALT_RECIPE, warmup_steps=0)
    assert recipe.image_seq_len == 9
    path = build_vision_model(tmp_path / "alt", recipe)
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert model.config.text_config.num_hidden_layers == 3
    processor = load_processor(path)
    messages, images = CASES["two-image"]
    ids = _prompt_ids(processor, messages, images)
    assert ids.count(processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)) == 2 * 9
    assert build_vision_model(tmp_path / "alt", recipe) == path  # cached: no second build


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(CASES))
def test_processor_ids_equal_vllm_prompt_ids(case: str, vision_engine: Any,
                                             vision_model_dir: Path) -> None:
    """The key property for exact recording: the ids the trainer's processor makes for the
    messages equal the prompt ids vLLM used (placeholders expanded); and vLLM's logprobs of its
    greedy answer match transformers' on those ids and pixels."""
    messages, images = CASES[case]
    body = {"model": vision_engine.model_name, "messages": _openai_messages(messages, images),
            "max_tokens": 4, "temperature": 0, "return_token_ids": True, "logprobs": True,
            "top_logprobs": 5}
    r = httpx.post(vision_engine.openai_base_url + "/chat/completions", json=body,
                   headers=vision_engine.headers, timeout=120)
    r.raise_for_status()
    got = r.json()
    processor = load_processor(vision_model_dir)
    ids = _prompt_ids(processor, messages, images)
    assert got["prompt_token_ids"] == ids
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert ids.count(image_id) == len(images) * VisionRecipe().image_seq_len

    choice = got["choices"][0]
    out_ids = choice["token_ids"]
    vllm_lp = [c["logprob"] for c in choice["logprobs"]["content"]]
    model = AutoModelForImageTextToText.from_pretrained(vision_model_dir)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=images, return_tensors="pt")
    full = torch.tensor([ids + out_ids])
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full),
                       pixel_values=inputs["pixel_values"],
                       pixel_attention_mask=inputs["pixel_attention_mask"]).logits[0]
    logp = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)
    hf_lp = [logp[i, t].item() for i, t in enumerate(out_ids)]
    assert hf_lp == pytest.approx(vllm_lp, abs=1e-3)
    # the runners-up too (the greedy token's logprob is near 0 for a confident model)
    for i, c in enumerate(choice["logprobs"]["content"]):
        for alt in c["top_logprobs"]:
            tid = processor.tokenizer.convert_tokens_to_ids(alt["token"])
            assert logp[i, tid].item() == pytest.approx(alt["logprob"], abs=1e-3)
