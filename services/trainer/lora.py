"""Adapter training: LoRA on the policy's linear layers, through peft (docs/lora.md).

With `TrainerConfig.lora` set, the trainer loads the base model, wraps it (`apply_lora`: every
base weight frozen, a low-rank pair A (rank x in), B (out x rank) beside each targeted
`nn.Linear`, the layer computing W x + (alpha / rank) B A x), trains the pairs only (the
optimizer gets the trainable parameters alone: no AdamW state for the base), and writes each
adapter as a PEFT folder (the format, `LoraConfig` and the writers: harnessrl/lora_adapters.py).
B starts at zero, so the first adapter's policy is the base model's.

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
from pathlib import Path
from typing import Any

import torch

from harnessrl.checkpoint_folders import ADAPTER_DIR
from harnessrl.lora_adapters import (ADAPTER_CONFIG, ADAPTER_FILE, LoraConfig, check_targets,
                                     wrap, write_peft, write_zero_adapter)

from .sharding import Dist, full_tensor

log = logging.getLogger("harnessrl.trainer")


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
