"""`harnessrl export CHECKPOINT --out DIR [--merge]`: a trainer checkpoint as a model to serve.

CHECKPOINT is a checkpoint folder (`<output_dir>/checkpoints/step-000012`), or a trainer's
output dir or checkpoints dir (then its latest checkpoint).

- A LoRA checkpoint (adapter training, docs/lora.md): without --merge, its adapter as a PEFT
  folder (adapter_config.json, adapter_model.safetensors), which peft's
  `PeftModel.from_pretrained` and vLLM's `--enable-lora --lora-modules NAME=DIR` load on the
  base model; with --merge, a Hugging Face model folder, the adapter merged into the base
  weights (W + alpha/r B A) and the tokenizer beside it. The base is the folder the checkpoint
  records (state.json), or --base.
- A full fine-tuning checkpoint: its Hugging Face model (weights, config, tokenizer), without
  the trainer's own files; there is no adapter, so --merge writes the same.

DIR must not exist yet (or be empty); it is written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from harnessrl.checkpoint_folders import ADAPTER_DIR, STATE_FILE, latest_checkpoint

TRAINER_FILES = ("state.json", "trainer_state.pt", "dcp")  # and rng-rank<R>.pt


class ExportError(Exception):
    """What the user must change (a message, no traceback)."""


def find_checkpoint(path: Path) -> Path:
    """The checkpoint folder `path` names: itself, or the latest under it or its checkpoints/."""
    path = path.expanduser().resolve()
    if path.name == "latest" and path.is_file():  # checkpoints/latest names the newest
        path = path.parent
    if (path / STATE_FILE).exists():
        return path
    for folder in (path, path / "checkpoints"):
        if (folder / "latest").exists():
            found = latest_checkpoint(folder)
            if found is not None:
                return found.resolve()
    raise ExportError(f"{path}: not a trainer checkpoint (no state.json), nor a folder with "
                      "checkpoints (checkpoints/latest)")


def export(checkpoint: Path, out: Path, merge: bool = False, base: Path | None = None
           ) -> str:
    """Writes `checkpoint` as a model to serve at `out` (see the module docstring); returns a
    sentence saying what was written."""
    from harnessrl import lora_adapters

    ckpt = find_checkpoint(checkpoint)
    out = out.expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty: give a new folder")
    if out.exists():
        out.rmdir()
    state = json.loads((ckpt / "state.json").read_text())
    step = state.get("step")
    adapter = ckpt / ADAPTER_DIR
    if not (adapter / lora_adapters.ADAPTER_FILE).exists():
        if not (ckpt / "config.json").exists():
            raise ExportError(f"{ckpt}: neither an adapter ({ADAPTER_DIR}/) nor a model "
                              "(config.json)")
        _copy(ckpt, out, skip=lambda p: p.name in TRAINER_FILES or p.name.startswith("rng-"))
        return (f"{ckpt} (step {step}) is a full fine-tuning checkpoint: wrote its Hugging "
                f"Face model to {out}" + (" (no adapter: nothing to merge)" if merge else ""))
    base_dir = (base or Path(state.get("base_model", ""))).expanduser()
    if not merge:
        _copy(adapter, out, skip=lambda p: False)
        return (f"wrote the LoRA adapter of {ckpt} (step {step}) in PEFT format to {out}; its "
                f"base model: {base_dir} (serve: vllm --enable-lora --lora-modules NAME={out}; "
                "a full model: --merge)")
    if not (base_dir / "config.json").exists():
        raise ExportError(f"the base model {str(base_dir)!r} the checkpoint was trained on is "
                          "not here (no config.json): give its folder with --base")
    lora_adapters.merge_adapter(base_dir, adapter, out, tokenizer_dir=ckpt)
    return (f"wrote {ckpt} (step {step}) merged into its base {base_dir} as a Hugging Face "
            f"model to {out}")


def _copy(src: Path, out: Path, skip: Any) -> None:
    """The files of `src` (not those `skip` names) into a new folder `out`, atomically."""
    from harnessrl.lora_adapters import replace_folder

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in src.iterdir():
        if f.is_file() and not skip(f):
            shutil.copy2(f, tmp / f.name)
    replace_folder(tmp, out)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `export` verb's flags (cli.py calls this)."""
    p = sub.add_parser("export", help="a trainer checkpoint as a model to serve: a LoRA "
                       "adapter (PEFT format) or, with --merge, a merged Hugging Face model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder, or a trainer's output dir (its "
                   "latest checkpoint)")
    p.add_argument("--out", required=True, help="folder to write (new, or empty)")
    p.add_argument("--merge", action="store_true", help="LoRA: merge the adapter into the base "
                   "model and write a Hugging Face model")
    p.add_argument("--base", default=None, help="--merge: the base model folder (default: the "
                   "one the checkpoint records)")
    return p


def cmd_export(args: argparse.Namespace, console: Any) -> int:
    try:
        said = export(Path(args.checkpoint), Path(args.out), args.merge,
                      Path(args.base) if args.base else None)
    except (ExportError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    console.print(said, markup=False)
    return 0
