"""A second tiny model, for the swe example's learning proof: warmed up on mini-swe-agent
dialogues instead of the calculator's. Same architecture family and chat template as the calc
model (`build.py`, whose recipe and digest this module leaves alone), its own recipe:

- the tokenizer is trained on code-like text: the rendered warm-up dialogues (mini's prompts,
  the libraries' problem statements and command outputs) and the libraries' source files;
- the warm-up is supervised training on those dialogues (given as message lists, rendered with
  the model's own chat template and mini's `bash` tool), loss on the assistant turns only
  (`warmup.encode_texts`); the output head is applied only where the loss is taken, which is
  what makes ~1,000-token dialogues affordable on two CPU cores.

`build_swe_model(out_dir, dialogues, corpus, recipe)` writes a Hugging Face folder that vLLM
and transformers load, with `recipe.json` (recipe, digest of recipe + data, warm-up losses).
Building again with the same recipe and data returns at once.
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
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from harnessrl.model.tokenizer import IM_END, IM_START, SPECIAL_TOKENS, TOOL_TOKENS, \
    train_tokenizer
from harnessrl.model.warmup import Example, encode_texts, fit

log = logging.getLogger(__name__)
RECIPE_FILE = "recipe.json"
SWE_BUILD_VERSION = 1


@dataclass(frozen=True)
class SweRecipe:
    """Everything that decides the swe model's bytes, besides the dialogues themselves."""

    seed: int = 0
    vocab_size: int = 4096
    """Upper bound of the BPE vocabulary; code needs more merges than the calculator."""
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    warmup_steps: int = 300
    warmup_batch_size: int = 8
    warmup_lr: float = 3e-3

    def digest(self, data_digest: str) -> str:
        blob = json.dumps({"build_version": SWE_BUILD_VERSION, "data": data_digest,
                           **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def data_digest(dialogues: list[list[dict[str, Any]]], corpus: list[str],
                tools: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for part in (dialogues, corpus, tools):
        h.update(json.dumps(part, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _plain(text: str) -> str:
    for t in [*SPECIAL_TOKENS, *TOOL_TOKENS]:
        text = text.replace(t, "\n")
    return text


def render_texts(tok: Any, dialogues: list[list[dict[str, Any]]],
                 tools: list[dict[str, Any]]) -> list[str]:
    return [tok.apply_chat_template(d, tools=tools, tokenize=False) for d in dialogues]


def _template_texts(dialogues: list[list[dict[str, Any]]],
                    tools: list[dict[str, Any]]) -> list[str]:
    """The dialogues rendered with the chat template by a throwaway tokenizer (the template
    needs no vocabulary), markup removed: the tokenizer's training text."""
    from jinja2 import Template

    from harnessrl.model.tokenizer import CHAT_TEMPLATE
    tpl = Template(CHAT_TEMPLATE)
    return [_plain(tpl.render(messages=d, tools=tools, add_generation_prompt=False))
            for d in dialogues]


def train_swe(model: Qwen3ForCausalLM, examples: list[Example], *, steps: int, batch_size: int,
              lr: float, seed: int, pad_id: int,
              weights: list[float] | None = None) -> list[float]:
    """AdamW, linear warm-up then cosine decay; examples drawn by `seed`. Loss on the masked
    (assistant) tokens only, the output head applied only there."""
    torch.manual_seed(seed)
    rng = random.Random(seed)

    def loss_of_step(step: int) -> torch.Tensor:
        batch = rng.choices(examples, weights=weights, k=batch_size)
        width = max(len(e.input_ids) for e in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        target = torch.full((len(batch), width), -100, dtype=torch.long)
        for r, e in enumerate(batch):
            n = len(e.input_ids)
            ids[r, :n] = torch.tensor(e.input_ids)
            attn[r, :n] = 1
            # position i predicts token i+1: the label of i is token i+1 when that is masked
            lab = [e.input_ids[i + 1] if e.loss_mask[i + 1] else -100 for i in range(n - 1)]
            target[r, :n - 1] = torch.tensor(lab)
        hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
        sel = target != -100
        logits = model.lm_head(hidden[sel])
        return torch.nn.functional.cross_entropy(logits, target[sel])

    return fit(model, steps, lr, loss_of_step, "swe warm-up", 20, log)


def build_swe_model(out_dir: str | Path, dialogues: list[list[dict[str, Any]]],
                    corpus: list[str], tools: list[dict[str, Any]],
                    recipe: SweRecipe = SweRecipe(),
                    weights: list[float] | None = None) -> Path:
    """Builds (or finds) the swe model in `out_dir`: tokenizer on `corpus` + the dialogues,
    Qwen3 initialised from the seed, supervised warm-up on `dialogues` (drawn with `weights`,
    default uniform)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = recipe.digest(data_digest(dialogues, corpus, tools) + json.dumps(weights))
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if json.loads((out / RECIPE_FILE).read_text()).get("digest") == digest:
                return out
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        return _build(out, dialogues, corpus, tools, recipe, digest, weights)


def _build(out: Path, dialogues: list[list[dict[str, Any]]], corpus: list[str],
           tools: list[dict[str, Any]], recipe: SweRecipe, digest: str,
           weights: list[float] | None) -> Path:
    t0 = time.monotonic()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    texts = _template_texts(dialogues[:2000], tools)
    tok = train_tokenizer([*texts, *corpus], recipe.vocab_size,
                          model_max_length=recipe.max_position_embeddings)
    t_tok = time.monotonic() - t0
    torch.manual_seed(recipe.seed)
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_heads,
        head_dim=recipe.head_dim, max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=10000.0, tie_word_embeddings=recipe.tie_word_embeddings,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, dtype="float32")
    model = Qwen3ForCausalLM(config).float()
    examples = encode_texts(tok, render_texts(tok, dialogues, tools))
    lengths = sorted(len(e.input_ids) for e in examples)
    losses = train_swe(model, examples, steps=recipe.warmup_steps,
                       batch_size=recipe.warmup_batch_size, lr=recipe.warmup_lr,
                       seed=recipe.seed, pad_id=tok.pad_token_id, weights=weights) \
        if recipe.warmup_steps else []
    model.generation_config = GenerationConfig(
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    seconds = time.monotonic() - t0
    tail = losses[-20:]
    (tmp / RECIPE_FILE).write_text(json.dumps({
        "digest": digest, "recipe": dataclasses.asdict(recipe), "kind": "swe",
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab": len(tok), "dialogues_distinct": len(examples),
        "dialogue_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2],
                            "max": lengths[-1]},
        "final_warmup_loss": sum(tail) / len(tail) if tail else None,
        "warmup_losses_every_10": losses[::10],
        "tokenizer_seconds": round(t_tok, 1), "build_seconds": round(seconds, 1),
    }, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("built the swe model in %s (%.0fs)", out, seconds)
    return out


__all__ = ["SweRecipe", "build_swe_model", "IM_START", "IM_END"]
