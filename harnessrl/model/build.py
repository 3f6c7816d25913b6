"""Builds the tiny local model the tests and the demo use: a byte-level BPE tokenizer trained
here, a Qwen3-architecture model (head_dim 64, float32) initialised from a seed, and a short
supervised warm-up on the example task. Nothing comes from a model hub.

The output directory is a Hugging Face model folder (safetensors, config, generation config,
tokenizer with chat template) that transformers and vLLM load as is. It also holds
`recipe.json`: the recipe and its hash, and the built weights' hash (`weights_digest`: the same
recipe built on another CPU may give other weights); building again with the same recipe
returns at once.
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

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from harnessrl.model import calc_task, warmup
from harnessrl.model.tokenizer import train_tokenizer

log = logging.getLogger(__name__)

RECIPE_FILE = "recipe.json"
BUILD_VERSION = 1  # bump when the code below changes what a recipe produces


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the built model's bytes."""

    tie_word_embeddings: bool = True
    """Share the input embedding and the output head (the trainer's push must handle both)."""
    seed: int = 0
    """Seed of the tokenizer corpus, the initial weights and the warm-up data."""
    vocab_size: int = 2048
    """Upper bound of the BPE vocabulary (the trained one may be smaller)."""
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 64
    """vLLM's CPU attention needs head_dim >= 32."""
    max_position_embeddings: int = 32768
    """Positions (RoPE: no weights depend on it) and the tokenizer's model_max_length; room for
    a real agent's prompt (about 40,000 characters at ~1.2 characters per token)."""
    warmup_steps: int = 800
    """Supervised warm-up steps on example-task dialogues (0: random weights)."""
    warmup_batch_size: int = 32
    warmup_lr: float = 3e-3
    copy_fraction: float = 0.35
    """Share of warm-up dialogues whose final answer copies the tool result; the others state a
    random number instead. Sets how often the warmed-up policy is right (see examples/calc)."""

    def digest(self) -> str:
        blob = json.dumps({"build_version": BUILD_VERSION, **dataclasses.asdict(self)},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


WEIGHTLESS_FIELDS = ("max_position_embeddings",)
"""Recipe fields that no weight depends on (RoPE has no parameters, and the warm-up's sequences
are far shorter than either length): a build that differs from the recipe only in them is
relabelled in place (config, tokenizer config, recipe.json) instead of trained again."""


def tokenizer_corpus(seed: int, n_dialogues: int = 2000) -> list[str]:
    """Rendered-looking text of example-task dialogues (the chat markup tokens are added
    separately, so they are replaced by newlines here)."""
    rng = random.Random(seed)
    tools_json = json.dumps(calc_task.TOOLS)
    texts = []
    for i in range(n_dialogues):
        task = calc_task.make_task(rng, f"tok-{i}")
        chat = calc_task.dialogue(task, rng.random() < 0.5, rng)
        call = json.dumps({"name": "calculator",
                           "arguments": {"expression": task["expression"]}})
        texts.append("\n".join([
            "system", calc_task.SYSTEM_PROMPT, "# Tools", "<tools>", tools_json, "</tools>",
            "Call a tool as", '{"name": <name>, "arguments": <args>}',
            "user", task["question"], "assistant", call, "tool", str(task["answer"]),
            "assistant", chat[-1]["content"],
        ]))
    return texts


def _load_recipe(out: Path) -> dict | None:
    try:
        return json.loads((out / RECIPE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def build_tiny_model(out_dir: str | Path, tie_word_embeddings: bool = True, seed: int = 0,
                     **recipe_overrides: object) -> Path:
    """Builds the model into `out_dir` (or returns at once if it already holds this recipe's
    build). Keyword overrides are fields of `Recipe`."""
    recipe = Recipe(tie_word_embeddings=tie_word_embeddings, seed=seed,
                    **recipe_overrides)  # type: ignore[arg-type]
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    # one builder at a time per folder; the others wait and then find the finished build
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _load_recipe(out)
        if found is not None and found.get("digest") == recipe.digest():
            return out
        if found is not None and _relabel(found, recipe, out):
            return out
        return _build(recipe, out)


def _relabel(found: dict, recipe: Recipe, out: Path) -> bool:
    """Turns the build in `out` (recipe.json `found`) into `recipe`'s when they differ only in
    `WEIGHTLESS_FIELDS` and the build was made by this BUILD_VERSION; False otherwise."""
    try:
        old = Recipe(**found["recipe"])
    except (KeyError, TypeError):
        return False
    if old.digest() != found.get("digest"):  # another BUILD_VERSION made it
        return False
    if dataclasses.replace(old, **{f: getattr(recipe, f) for f in WEIGHTLESS_FIELDS}) != recipe:
        return False
    for name, key in (("config.json", "max_position_embeddings"),
                      ("tokenizer_config.json", "model_max_length")):
        data = json.loads((out / name).read_text())
        data[key] = recipe.max_position_embeddings
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    # recipe.json last: an interrupted relabel leaves the old digest and is done again
    found.update(digest=recipe.digest(), recipe=dataclasses.asdict(recipe),
                 relabelled_from=old.digest())
    (out / RECIPE_FILE).write_text(json.dumps(found, indent=2) + "\n")
    log.info("relabelled the tiny model in %s (%s)", out, ", ".join(
        f"{f}={getattr(recipe, f)}" for f in WEIGHTLESS_FIELDS))
    return True


def weights_digest(model_dir: str | Path) -> str:
    """sha256 (16 hex digits) of a model folder's weight files, in name order: two builds of
    one recipe on different CPUs need not give the same weights (the recipe's digest is of the
    recipe), and this tells them apart."""
    h = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def _build(recipe: Recipe, out: Path) -> Path:
    t0 = time.monotonic()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    for stale in out.parent.glob(out.name + ".tmp*"):  # (under the lock) a killed builder's
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)

    tok = train_tokenizer(tokenizer_corpus(recipe.seed), recipe.vocab_size,
                          model_max_length=recipe.max_position_embeddings)
    torch.manual_seed(recipe.seed)
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_heads,
        head_dim=recipe.head_dim, max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=10000.0, tie_word_embeddings=recipe.tie_word_embeddings,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, dtype="float32",
    )
    model = Qwen3ForCausalLM(config).float()
    losses: list[float] = []
    if recipe.warmup_steps:
        losses = warmup.train(model, tok, steps=recipe.warmup_steps,
                              batch_size=recipe.warmup_batch_size, lr=recipe.warmup_lr,
                              copy_fraction=recipe.copy_fraction, seed=recipe.seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    seconds = time.monotonic() - t0
    (tmp / RECIPE_FILE).write_text(json.dumps({
        "digest": recipe.digest(), "recipe": dataclasses.asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_warmup_loss": losses[-1] if losses else None,
        "weights_digest": weights_digest(tmp),
        "build_seconds": round(seconds, 1),
    }, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("built tiny model in %s (%.0fs, weights %s)", out, seconds, weights_digest(out))
    return out


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return tok


def default_model_dir(tie_word_embeddings: bool = True) -> Path:
    """Where the project keeps its tiny model: `$HARNESSRL_CACHE_DIR` (default
    `~/.cache/harnessrl`) / models / tiny-qwen3[-untied]."""
    root = Path(os.environ.get("HARNESSRL_CACHE_DIR", Path.home() / ".cache" / "harnessrl"))
    return root / "models" / ("tiny-qwen3" if tie_word_embeddings else "tiny-qwen3-untied")
