"""The trainer's start, resumed or fresh: the model, its tokenizer and optimizer, and the
trainer's state (step, policy version, stream entries consumed, RNG states) — from
`<output_dir>/checkpoints/latest` when there is one (and `resume` is on), else from the initial
model (`model_path`, or the project's tiny model built on first use). A vision-language model
(pixels.py) loads as one, with the processor saved beside the initial model.

With `lora` set (lora.py) the base model is frozen and a LoRA adapter trains: the initial model
always loads, and a checkpoint gives the adapter (and an adapter checkpoint needs `lora` set).
Sharded (`sharding.py`), rank 0 finds the checkpoint and names the model, every rank loads it.
What the resumed trainer then does with the checkpoint's entries and its weights is
`loop.Trainer.start`'s part.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from . import checkpoint as ckpt
from . import lora
from .config import TrainerConfig
from .outputs import RUN_FILE, run_prefix_of
from .pixels import ImagePixels, model_class, vision_pixels
from .sharding import Dist, ShardingConfig, device_for, shard_model
from .step import make_optimizer

log = logging.getLogger("harnessrl.trainer")


@dataclass
class Loaded:
    """What the trainer starts from."""

    model: Any  # the (sharded, with LoRA: adapted) model
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    state: ckpt.TrainState
    checkpoint: Path | None  # the checkpoint resumed from; None: a fresh start
    pixels: ImagePixels | None = None  # a vision model: its images' pixels (pixels.py)


def load(cfg: TrainerConfig, output: Path, d: Dist, on_host: bool, store: Any = None
         ) -> Loaded:
    """Seeds the RNGs, then loads the latest checkpoint or the initial model (`on_host`: built
    in host memory, collocated offload). A vision model (pixels.py) loads with its processor,
    from the initial model's folder, and fetches its images from `store` (a StoreClient)."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    found = d.agree(ckpt.latest_checkpoint(cfg.checkpoints_dir)
                    if cfg.resume and d.is_main else None)
    lora.check_resumable(found, cfg.lora)  # an adapter checkpoint needs lora set
    source = found if found is not None and cfg.lora is None else Path(d.agree(
        initial_model(cfg) if d.is_main else ""))  # LoRA: the base, always
    pixels = vision_pixels(cfg, source, d.world_size, store)  # None: a text model
    model = model_class(source).from_pretrained(source, dtype=getattr(
        torch, cfg.dtype)).to("cpu" if on_host else device_for(cfg.device, d))
    if cfg.lora is not None:  # base frozen; adapter weights from the checkpoint
        model = lora.apply_lora(model, cfg.lora, found)
    model = shard_model(model, d, ShardingConfig(
        mixed_precision=cfg.mixed_precision,
        activation_checkpointing=cfg.activation_checkpointing))
    tokenizer = AutoTokenizer.from_pretrained(source)
    o = cfg.optimizer
    optimizer = make_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2),
                               weight_decay=o.weight_decay, eps=o.eps)
    run_prefix = d.agree(run_prefix_of(output, cfg.run_name) if d.is_main else "")
    if found is not None:
        state = ckpt.load_trainer_state(found, optimizer, model, d)
        if state.run_prefix != run_prefix:
            raise RuntimeError(f"{found} belongs to run {state.run_prefix!r}, but "
                               f"{output / RUN_FILE} says {run_prefix!r}")
        log.info("resumed from %s: step %d, policy version %d", found, state.step,
                 state.policy_version, extra={"step": state.step})
    else:
        state = ckpt.TrainState(run_prefix=run_prefix)
        log.info("starting from %s", source)
    return Loaded(model, tokenizer, optimizer, state, found, pixels)


def initial_model(cfg: TrainerConfig) -> str:
    """The model a fresh trainer starts from: `model_path`, or the tiny model (built once)."""
    if cfg.model_path:
        return cfg.model_path
    from harnessrl.model import build_tiny_model, default_model_dir

    return str(build_tiny_model(default_model_dir()))
