"""Supervised warm-up of the tiny model on dialogues of the example task, so that it speaks the
chat format and calls the calculator tool before any RL. Plain PyTorch on CPU, deterministic
for a given seed (and thread count).

Loss is taken on the assistant turns only (their text and closing `<|im_end|>`), exactly the
tokens the model generates when the harness runs it.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from harnessrl.model import calc_task
from harnessrl.model.tokenizer import IM_END

log = logging.getLogger(__name__)


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is predicted by the loss (assistant output)


ASSISTANT_START = "<|im_start|>assistant\n"


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in a rendered chat: from the end of each
    `<|im_start|>assistant\n` through its closing `<|im_end|>` (the chat template renders every
    assistant turn so; tests/test_model.py checks it against the generation prompt)."""
    spans = []
    pos = text.find(ASSISTANT_START)
    while pos != -1:
        start = pos + len(ASSISTANT_START)
        end = text.find(IM_END, start)
        if end == -1:
            raise ValueError("an assistant turn without <|im_end|>")
        spans.append((start, end + len(IM_END)))
        pos = text.find(ASSISTANT_START, end)
    return spans


def encode_dialogue(tok: PreTrainedTokenizerFast, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> Example:
    """Token ids of the rendered chat, with the assistant turns marked for the loss."""
    return encode_texts(tok, [tok.apply_chat_template(messages, tools=tools, tokenize=False)])[0]


def encode_texts(tok: PreTrainedTokenizerFast, texts: list[str]) -> list[Example]:
    enc = tok(texts, return_offsets_mapping=True, add_special_tokens=False)
    out = []
    for text, ids, offsets in zip(texts, enc["input_ids"], enc["offset_mapping"]):
        spans = assistant_spans(text)
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in offsets]
        out.append(Example(list(ids), mask))
    return out


def warmup_examples(tok: PreTrainedTokenizerFast, n: int, copy_fraction: float,
                    seed: int) -> list[Example]:
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        task = calc_task.make_task(rng, f"warmup-{i}")
        chat = calc_task.dialogue(task, rng.random() < copy_fraction, rng)
        texts.append(tok.apply_chat_template(chat, tools=calc_task.TOOLS, tokenize=False))
    return encode_texts(tok, texts)


def _batch(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e.input_ids)
        ids[r, :n] = torch.tensor(e.input_ids)
        attn[r, :n] = 1
        lab = torch.tensor([t if m else -100 for t, m in zip(e.input_ids, e.loss_mask)])
        labels[r, :n] = lab
    return ids, attn, labels


def fit(model: PreTrainedModel, steps: int, lr: float,
        loss_of_step: Callable[[int], torch.Tensor], what: str, log_every: int,
        logger: logging.Logger = log) -> list[float]:
    """`steps` AdamW steps (betas 0.9 / 0.98, weight decay 0.01; linear warm-up over a
    twentieth of the steps, then cosine decay; gradients clipped at 1) on the loss
    `loss_of_step(step)` computes; the loss of each step. The warm-ups of the text, swe and
    vision models all train this way."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    losses: list[float] = []
    t0 = time.monotonic()
    for step in range(steps):
        loss = loss_of_step(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            logger.info("%s step %d/%d loss %.4f (%.0fs)", what, step + 1, steps, losses[-1],
                        time.monotonic() - t0)
    model.eval()
    return losses


def train(model: PreTrainedModel, tok: PreTrainedTokenizerFast, *, steps: int, batch_size: int,
          lr: float, copy_fraction: float, seed: int) -> list[float]:
    """Runs `steps` AdamW steps (`fit`) on freshly drawn dialogues; returns the loss of each
    step."""
    torch.manual_seed(seed)
    examples = warmup_examples(tok, steps * batch_size, copy_fraction, seed)

    def loss_of_step(step: int) -> torch.Tensor:
        ids, attn, labels = _batch(examples[step * batch_size:(step + 1) * batch_size],
                                   tok.pad_token_id)
        return model(input_ids=ids, attention_mask=attn, labels=labels).loss

    return fit(model, steps, lr, loss_of_step, "warm-up", 50)
