"""The tiny model: tokenizer, chat template, model folder, cached and deterministic build."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from harnessrl.model import build_tiny_model, calc_task, load_tokenizer
from harnessrl.model.build import tokenizer_corpus, weights_digest
from harnessrl.model.tokenizer import SPECIAL_TOKENS, TOOL_TOKENS, train_tokenizer
from harnessrl.model.warmup import encode_dialogue


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return train_tokenizer(tokenizer_corpus(0), 2048)


def _chat(seed: int = 1, copy: bool = True) -> list[dict]:
    rng = random.Random(seed)
    return calc_task.dialogue(calc_task.make_task(rng, "t"), copy, rng)


def test_tokenizer_round_trip_with_special_tokens(tok: PreTrainedTokenizerFast) -> None:
    text = ('<|im_start|>user\nWhat is 12 * 34? Ünïcödé ✓ {"a": [1, 2]}<|im_end|>\n'
            '<tool_call>\n{"name": "calculator"}\n</tool_call><|endoftext|>')
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    for t in SPECIAL_TOKENS + TOOL_TOKENS:
        assert len(tok.encode(t)) == 1, t
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # special tokens go with skip_special_tokens; the tool markup stays (vLLM's hermes parser
    # needs it in the text)
    assert tok.decode(ids, skip_special_tokens=True) == (
        'user\nWhat is 12 * 34? Ünïcödé ✓ {"a": [1, 2]}\n'
        '<tool_call>\n{"name": "calculator"}\n</tool_call>')
    assert 1000 < len(tok) <= 2048 + len(TOOL_TOKENS)


def test_numbers_are_single_tokens_and_long_ones_split_in_threes(
        tok: PreTrainedTokenizerFast) -> None:
    for n in (0, 7, 42, 100, 555, 999):
        assert tok.convert_ids_to_tokens(tok.encode(str(n))) == [str(n)]
    assert tok.convert_ids_to_tokens(tok.encode("1234567")) == ["123", "456", "7"]
    # the same number is the same token wherever it stands
    a = tok.encode("x 417.")
    b = tok.encode("\n417\n")
    assert tok.convert_tokens_to_ids("417") in a and tok.convert_tokens_to_ids("417") in b


def test_chat_template_renders_tools_tool_calls_and_tool_messages(
        tok: PreTrainedTokenizerFast) -> None:
    chat = _chat()
    text = tok.apply_chat_template(chat, tools=calc_task.TOOLS, tokenize=False)
    expr = chat[2]["tool_calls"][0]["function"]["arguments"]["expression"]
    assert text.startswith("<|im_start|>system\n" + calc_task.SYSTEM_PROMPT + "\n# Tools\n")
    assert json.dumps(calc_task.TOOLS[0]) in text
    assert ("<|im_start|>assistant\n<tool_call>\n"
            f'{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n'
            "</tool_call><|im_end|>\n") in text
    assert f"<|im_start|>tool\n<tool_response>\n{chat[3]['content']}\n</tool_response>" \
           "<|im_end|>\n" in text
    assert text.endswith(f"<|im_start|>assistant\n{chat[4]['content']}<|im_end|>\n")
    # arguments as a JSON string (the OpenAI wire form) render the same as a dict
    as_string = json.loads(json.dumps(chat))
    call = as_string[2]["tool_calls"][0]["function"]
    call["arguments"] = json.dumps(call["arguments"])
    assert tok.apply_chat_template(as_string, tools=calc_task.TOOLS, tokenize=False) == text
    prompt = tok.apply_chat_template(chat[:2], tools=calc_task.TOOLS, tokenize=False,
                                     add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    # without tools: a plain system turn
    plain = tok.apply_chat_template(chat[:2], tokenize=False)
    assert plain == (f"<|im_start|>system\n{calc_task.SYSTEM_PROMPT}<|im_end|>\n"
                     f"<|im_start|>user\n{chat[1]['content']}<|im_end|>\n")


def test_warmup_loss_mask_covers_exactly_the_assistant_turns(
        tok: PreTrainedTokenizerFast) -> None:
    chat = _chat(copy=False)
    ex = encode_dialogue(tok, chat, calc_task.TOOLS)
    masked = [t for t, m in zip(ex.input_ids, ex.loss_mask) if m]
    expected_text = ("<tool_call>\n" + json.dumps(
        {"name": "calculator", "arguments": chat[2]["tool_calls"][0]["function"]["arguments"]})
        + "\n</tool_call><|im_end|>" + chat[4]["content"] + "<|im_end|>")
    assert tok.decode(masked) == expected_text


def test_model_folder_loads_in_transformers_and_calls_the_tool(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    assert next(model.parameters()).dtype == torch.float32
    assert tok.chat_template and tok.eos_token_id == config["eos_token_id"]
    task = calc_task.make_task(random.Random(5), "t")
    chat = [{"role": "system", "content": calc_task.SYSTEM_PROMPT},
            {"role": "user", "content": task["question"]}]
    ids = tok.apply_chat_template(chat, tools=calc_task.TOOLS, add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.startswith('<tool_call>\n{"name": "calculator", "arguments": {"expression": ')


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def test_build_is_cached_deterministic_and_seeded(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", warmup_steps=3)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    t0 = time.monotonic()
    assert build_tiny_model(tmp_path / "a", warmup_steps=3) == a
    assert time.monotonic() - t0 < 1.0
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
    b = build_tiny_model(tmp_path / "b", warmup_steps=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    c = build_tiny_model(tmp_path / "c", warmup_steps=3, seed=1)
    # recipe.json names the weights built: equal for a and b, another for c's seed
    digests = [json.loads((x / "recipe.json").read_text())["weights_digest"] for x in (a, b, c)]
    assert digests[0] == digests[1] == weights_digest(a) != digests[2] == weights_digest(c)
    wa, wc = _weights(a), _weights(c)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    # another recipe in the same folder rebuilds it
    build_tiny_model(tmp_path / "a", warmup_steps=4)
    assert json.loads((a / "recipe.json").read_text())["recipe"]["warmup_steps"] == 4


def test_untied_build_has_its_own_output_head(tmp_path: Path) -> None:
    d = build_tiny_model(tmp_path / "u", tie_word_embeddings=False, warmup_steps=2)
    w = _weights(d)
    assert "lm_head.weight" in w
    assert not torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    tied = _weights(build_tiny_model(tmp_path / "t", warmup_steps=2))
    assert "lm_head.weight" not in tied


def test_positions_change_no_weight_and_an_old_build_is_relabelled(tmp_path: Path) -> None:
    """32,768 positions (room for a 40,000-character prompt) cost no weight: a build with the
    old 1,024 has the same bytes, and is relabelled in place instead of trained again."""
    fresh = build_tiny_model(tmp_path / "fresh", warmup_steps=2)
    old = build_tiny_model(tmp_path / "old", warmup_steps=2, max_position_embeddings=1024)
    assert (old / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()
    stamp = (old / "model.safetensors").stat().st_mtime_ns
    t0 = time.monotonic()
    assert build_tiny_model(tmp_path / "old", warmup_steps=2) == old
    assert time.monotonic() - t0 < 1.0 and (old / "model.safetensors").stat().st_mtime_ns == stamp
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json",
                 "generation_config.json"):
        assert json.loads((old / name).read_text()) == json.loads((fresh / name).read_text())
    recipe = json.loads((old / "recipe.json").read_text())
    assert recipe["digest"] == json.loads((fresh / "recipe.json").read_text())["digest"]
    assert recipe["recipe"]["max_position_embeddings"] == 32768
    assert AutoConfig.from_pretrained(old).max_position_embeddings == 32768
    assert load_tokenizer(old).model_max_length == 32768
