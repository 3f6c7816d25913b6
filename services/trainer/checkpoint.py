"""Checkpoints: everything a trainer needs to continue exactly where it stopped.

Layout, under `<output_dir>/checkpoints/`:

    step-000012/              one checkpoint (the state after step 12)
      config.json, generation_config.json, model.safetensors
                              the model in Hugging Face format: transformers' `from_pretrained`
                              and vLLM's `--model` load the folder as is
      tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
                              the tokenizer, saved alongside
      trainer_state.pt        optimizer state, RNG states (python, numpy, torch[, cuda])
      state.json              step, policy version, the stream entry ids consumed, when
    latest                    text file naming the newest complete checkpoint ("step-000012")
                              (these names, and finding `latest`: harnessrl/checkpoint_folders.py)

A checkpoint of a sharded trainer (world size N > 1) has the same layout, except:

      dcp/                    model and optimizer, sharded, in `torch.distributed.checkpoint`
                              format (each rank writes its own shards; the state dicts are keyed
                              by parameter names, so any world size can load them)
      rng-rank<R>.pt          each rank's RNG states
      trainer_state.pt        rank 0's RNG states only (the optimizer is in dcp/)

The Hugging Face export is the same full model (gathered to rank 0, which writes it), so
transformers and vLLM load it as before. Resuming: at world size N > 1, all ranks load dcp/
(model and optimizer, resharded to the current world size if it differs); at world size 1, the
model from the export and the optimizer from dcp/ (no process group needed). A world-size-1
checkpoint resumed sharded loads the model from the export and the optimizer from
trainer_state.pt, mapped onto the shards. Checkpoints must be on a filesystem every rank sees.

A checkpoint of adapter training (`lora` set, lora.py) holds no full model; instead

      adapter/                the LoRA adapter, a PEFT folder (adapter_config.json,
                              adapter_model.safetensors): peft and vLLM's LoRA loading read it
      state.json              also names the base model folder ("base_model") it was trained on

and the optimizer state (trainer_state.pt; sharded, dcp/, which then holds the LoRA parameters
alone) is the LoRA parameters'. The resumed trainer loads the base from `model_path` (it must be
the recorded folder) and the adapter from adapter/ (as it loads the export above);
`harnessrl export --merge` writes the merged model.

**Atomicity.** A checkpoint is written into a temporary folder (`.tmp-step-000012-<pid>`),
every file and the folder are fsynced, the folder is renamed to its final name and the parent
fsynced, and only then is `latest` replaced (written to a temporary file, fsynced, renamed). A
crash at any point leaves `latest` naming a complete checkpoint (or no `latest` at all); stray
temporary folders are removed by the next writer. The last `keep` checkpoints are kept.

**Stream entries and acknowledgement** (the rule that makes a crash lose no group and train
none twice). `state.json` lists `consumed_entries`: the ids of the stream entries (completed
groups) trained on by the steps since the previous checkpoint. The trainer acknowledges entries
in the store only *after* the checkpoint that includes their steps is committed. Hence:

- crash before the checkpoint is committed: the entries are still pending in the consumer group;
  the resumed trainer (from the previous checkpoint) gets them again and trains them then — the
  lost training never reached a checkpoint, so they are trained once;
- crash after the commit but before (or during) the acknowledgement: the resumed trainer, which
  starts from this checkpoint, acknowledges `consumed_entries` at once without training them
  (acknowledging an acknowledged entry is a no-op).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harnessrl.checkpoint_folders import (LATEST, STATE_FILE, STEP_DIR, latest_checkpoint,
                                          step_dir_name)

from . import lora

log = logging.getLogger("harnessrl.trainer")

TRAINER_STATE_FILE = "trainer_state.pt"
DCP_DIR = "dcp"


@dataclass
class TrainState:
    """The loop's position: what a checkpoint records besides weights and optimizer."""

    step: int = 0
    """Steps completed."""
    policy_version: int = 0
    """Version of the weights (the last one pushed into the engines)."""
    consumed_entries: list[str] = field(default_factory=list)
    """Stream entry ids trained on since the previous checkpoint, not yet acknowledged."""
    run_prefix: str = ""
    """Prefix of the controller run ids of this training run."""
    groups_trained: int = 0
    """Groups taken by the steps so far (trained, or skipped as zero-variance / too few)."""
    groups_dropped: int = 0
    """Groups taken off the stream and not trained (async: too stale), by reason below."""
    drop_reasons: dict[str, int] = field(default_factory=dict)
    staleness_max: int = 0
    """Largest staleness (trainer version - call version) of any trained sample."""


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_states() -> dict[str, Any]:
    py = random.getstate()
    npy = np.random.get_state()
    states: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npy[0], npy[1].tolist(), int(npy[2]), int(npy[3]), float(npy[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    py = states["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npy = states["numpy"]
    np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), npy[2], npy[3], npy[4]))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _finish_folder(root: Path, tmp: Path, name: str, keep: int) -> Path:
    """fsyncs `tmp`, renames it to `name`, moves `latest` to it, prunes (rank 0 only)."""
    final = root / name
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync_file(f)
    for sub in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
        _fsync_dir(sub)
    if final.exists():  # left by a crash before `latest` moved on, or re-saved: replace it
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)
    _write_latest(root, name)
    prune(root, keep)
    return final


def save_sharded_checkpoint(root: str | Path, model: Any, tokenizer: Any,
                            optimizer: torch.optim.Optimizer, state: TrainState, dist: Any,
                            keep: int = 3) -> Path:
    """`save_checkpoint` for a sharded trainer: every rank calls it (collectives inside).
    Model and optimizer shards go to dcp/ (`torch.distributed.checkpoint`), the gathered full
    model to the Hugging Face export (written by rank 0), each rank's RNG states to
    rng-rank<R>.pt. Atomic the same way: `latest` moves only once everything is written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    root = Path(root)
    name = step_dir_name(state.step)
    tmp = Path(dist.agree(str(root / f".tmp-{name}-{os.getpid()}")))
    if dist.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    adapter = lora.is_adapter_model(model)  # then the LoRA parameters alone (frozen: the base)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
    if adapter:
        lora.save_adapter(model, tmp / lora.ADAPTER_DIR, dist)  # gathered; rank 0 writes
    full = {} if adapter else get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    torch.save(rng_states(), tmp / f"rng-rank{dist.rank}.pt")
    dist.barrier()
    final = root / name
    if dist.is_main:
        if not adapter:
            model.save_pretrained(tmp, state_dict=full, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save({"rng": rng_states(), "world_size": dist.world_size},
                   tmp / TRAINER_STATE_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(
            {**asdict(state), "saved_at": time.time(), "world_size": dist.world_size,
             **_model_record(model)}, indent=1) + "\n")
        final = _finish_folder(root, tmp, name, keep)
    del full
    dist.barrier()  # no rank moves on before `latest` names the checkpoint
    return final


def save_checkpoint(root: str | Path, model: Any, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, state: TrainState, keep: int = 3,
                    extra: dict[str, Any] | None = None) -> Path:
    """Writes the checkpoint of `state.step` atomically, points `latest` at it, prunes to the
    last `keep`; returns its folder. `extra` (JSON) goes into state.json for the record."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = step_dir_name(state.step)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if lora.is_adapter_model(model):
        lora.save_adapter(model, tmp / lora.ADAPTER_DIR)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "rng": rng_states()},
               tmp / TRAINER_STATE_FILE)
    (tmp / STATE_FILE).write_text(json.dumps(
        {**asdict(state), "saved_at": time.time(), **_model_record(model), **(extra or {})},
        indent=1) + "\n")
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync_file(f)
    _fsync_dir(tmp)
    if final.exists():  # left by a crash before `latest` moved on, or re-saved: replace it
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)
    _write_latest(root, name)
    prune(root, keep)
    return final


def _model_record(model: Any) -> dict[str, Any]:
    """What state.json records of an adapter-trained model: its base model folder."""
    return {"base_model": lora.base_model_path(model)} if lora.is_adapter_model(model) else {}


def _options(model: Any) -> Any:
    """State dict options of `model`: an adapter-trained model's state is its LoRA parameters
    (the frozen base is `model_path`'s, not the checkpoint's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if lora.is_adapter_model(model):
        return StateDictOptions(ignore_frozen_params=True, strict=False)
    return None


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(root / LATEST)
    _fsync_dir(root)


def prune(root: Path, keep: int) -> None:
    """Keeps the newest `keep` checkpoints (and always the one `latest` names); removes
    temporary folders left by crashed writers."""
    current = latest_checkpoint(root)
    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if (m := STEP_DIR.match(p.name)) and p.is_dir())
    for _, path in steps[:-keep] if keep > 0 else steps:
        if current is None or path.resolve() != current.resolve():
            shutil.rmtree(path, ignore_errors=True)
    for p in root.glob(".tmp-*"):
        if not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)


def retained_consumed_floor(root: str | Path) -> str:
    """The lowest stream entry id consumed by a retained checkpoint other than the oldest: the
    stream may be trimmed below it and every retained checkpoint can still be resumed from with
    the entries its later steps consumed ("" when nothing bounds it)."""
    root = Path(root)
    if not root.exists():
        return ""
    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if (m := STEP_DIR.match(p.name)) and (p / STATE_FILE).exists())
    ids = [e for _, p in steps[1:] for e in read_state(p).consumed_entries]
    if not ids:
        return ""

    def key(entry_id: str) -> tuple[int, int]:
        ms, _, seq = entry_id.partition("-")
        return int(ms), int(seq or 0)

    return min(ids, key=key)


def read_state(path: str | Path) -> TrainState:
    data = json.loads((Path(path) / STATE_FILE).read_text())
    return TrainState(step=int(data["step"]), policy_version=int(data["policy_version"]),
                      consumed_entries=list(data["consumed_entries"]),
                      run_prefix=str(data.get("run_prefix", "")),
                      groups_trained=int(data.get("groups_trained", 0)),
                      groups_dropped=int(data.get("groups_dropped", 0)),
                      drop_reasons={str(k): int(v)
                                    for k, v in data.get("drop_reasons", {}).items()},
                      staleness_max=int(data.get("staleness_max", 0)))


def load_trainer_state(path: str | Path, optimizer: torch.optim.Optimizer,
                       model: Any = None, dist: Any = None) -> TrainState:
    """Loads the optimizer state and the RNG states of the checkpoint at `path` (the model is
    loaded from the same folder with `from_pretrained`); returns its `TrainState`.

    With a sharded checkpoint (dcp/) or a sharded trainer (`dist.sharded`), `model` is needed:
    the model and optimizer are loaded through `torch.distributed.checkpoint.state_dict`, which
    maps names onto whatever sharding the current world has (see the module docstring)."""
    path = Path(path)
    blob = torch.load(path / TRAINER_STATE_FILE, weights_only=True, map_location="cpu")
    sharded_ckpt = (path / DCP_DIR).is_dir()
    sharded_now = dist is not None and dist.sharded
    if not sharded_ckpt and not sharded_now:
        optimizer.load_state_dict(blob["optimizer"])
        set_rng_states(blob["rng"])
        return read_state(path)
    if model is None:
        raise ValueError(f"{path} is a sharded checkpoint or the trainer is sharded: pass the "
                         "model to load_trainer_state")
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    if sharded_ckpt:
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=str(path / DCP_DIR))
        set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"], options=_options(model))
    else:  # a world-size-1 checkpoint, resumed sharded: the model came from the export
        names = [n for n, p in model.named_parameters() if p.requires_grad]  # the optimizer's
        osd = blob["optimizer"]
        full = {"state": {names[i]: v for i, v in osd["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                 for g in osd["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, full,
                                 options=StateDictOptions(full_state_dict=True))
    rank_rng = path / f"rng-rank{dist.rank if sharded_now else 0}.pt"
    set_rng_states(torch.load(rank_rng, weights_only=True) if rank_rng.exists()
                   else blob["rng"])
    return read_state(path)
