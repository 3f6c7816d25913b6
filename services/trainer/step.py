"""One optimizer step of a causal LM on a list of samples.

`train_step` reads top to bottom: normalisation weights over the whole batch → micro-batches
(samples sorted longest first, right-padded) → per micro-batch: forward, float32 logprobs of the
sampled tokens, loss, backward (gradients accumulate) → gradient clipping → AdamW step.

Because every token's normalisation weight is computed over the whole batch before any
micro-batch runs (`loss.sample_weights`), the accumulated gradient is the gradient of the one
batch loss, whatever the micro-batch size: results differ only by float rounding.

Padding is on the right and attention is causal, so real tokens never attend to padding and no
attention mask is needed (position ids count from 0 in every row, as in the unpadded sequence).
Logprobs are log_softmax of the logits cast to float32, at temperature 1: they are comparable
with the behaviour logprobs only if the engine reports logprobs of the untempered distribution.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from .loss import LossConfig, LossTerms, policy_loss, sample_weights
from .samples import Sample


@dataclass(frozen=True)
class StepConfig:
    """How one optimizer step runs."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss (clip range, IS cap, normalisation)."""
    micro_batch_size: int = 8
    """Most samples in one forward/backward pass."""
    micro_batch_max_tokens: int | None = None
    """Most padded tokens (rows x longest row) in one pass; None: no limit. A sample longer
    than this still runs, alone."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this total L2 norm before the optimizer step."""
    pad_token_id: int = 0
    """Token id put in padding positions (never attended to by real tokens, never trained)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")


@dataclass(frozen=True)
class StepMetrics:
    loss: float
    """The batch loss (before the update)."""
    kl: float
    """Mean over loss tokens of the k3 estimate of KL(behaviour || policy)."""
    clip_frac: float
    capped_frac: float
    entropy: float
    """Mean over loss tokens of the policy's next-token entropy (nats)."""
    tokens: int
    """Loss tokens (completion tokens trained on)."""
    input_tokens: int
    """All tokens run through the model (prompts, inserted tokens, completions; no padding)."""
    samples: int
    micro_batches: int
    grad_norm: float
    """Total gradient L2 norm before clipping."""
    step_time_s: float

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


def make_optimizer(
    model: torch.nn.Module,
    lr: float = 1e-5,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (tied weights appear once)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)


def micro_batches(
    lengths: Sequence[int], size: int, max_tokens: int | None = None
) -> list[list[int]]:
    """Indices of samples grouped into micro-batches: longest first (least padding), each with
    at most `size` samples and at most `max_tokens` padded tokens. Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            last = batches[-1]
            rows, width = len(last) + 1, lengths[last[0]]  # the first is the longest
            if rows <= size and (max_tokens is None or rows * width <= max_tokens):
                last.append(i)
                continue
        batches.append([i])
    return batches


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 logprob of each target under `logits` ([B, T, V] → [B, T]), and the entropy of
    each next-token distribution (no gradient; None when not asked for)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            entropy = lse - (probs * logits).sum(-1)
    return logprobs, entropy


def _pad(rows: list[list], value: float | int, dtype: torch.dtype, device: torch.device
         ) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype,
                        device=device)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    config: StepConfig | None = None,
) -> StepMetrics:
    """One optimizer step of `model` on `samples` (see the module docstring)."""
    config = config or StepConfig()
    start = time.perf_counter()
    if not samples or sum(s.num_loss_tokens for s in samples) == 0:
        raise ValueError("train_step needs samples with at least one loss token")
    device = next(model.parameters()).device
    weights = sample_weights(
        [s.num_loss_tokens for s in samples], [s.rollout_id for s in samples],
        config.loss.normalization,
    )
    batches = micro_batches([len(s) for s in samples], config.micro_batch_size,
                            config.micro_batch_max_tokens)

    model.train()
    optimizer.zero_grad(set_to_none=True)
    total: LossTerms | None = None
    for batch in batches:
        rows = [samples[i] for i in batch]
        input_ids = _pad([s.input_ids for s in rows], config.pad_token_id, torch.long, device)
        # position i of the shifted tensors is token i + 1, predicted from position i
        mask = _pad([s.loss_mask for s in rows], 0, torch.bool, device)[:, 1:]
        behaviour = _pad([s.behaviour_logprobs for s in rows], 0.0, torch.float32, device)[:, 1:]
        advantages = torch.tensor([s.advantage for s in rows], dtype=torch.float32,
                                  device=device)[:, None].expand_as(behaviour)
        token_w = torch.tensor([weights[i] for i in batch], dtype=torch.float32,
                               device=device)[:, None].expand_as(behaviour)

        logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1]
        logprobs, entropy = token_logprobs(logits, input_ids[:, 1:])
        terms = policy_loss(logprobs, behaviour, advantages, mask, token_w, config.loss, entropy)
        terms.loss.backward()
        terms.loss = terms.loss.detach()
        total = terms if total is None else total + terms
        del logits, logprobs, entropy, terms

    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm,
                                               error_if_nonfinite=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    assert total is not None
    m = total.metrics()
    return StepMetrics(
        loss=m["loss"], kl=m["kl"], clip_frac=m["clip_frac"], capped_frac=m["capped_frac"],
        entropy=m["entropy"], tokens=total.tokens, input_tokens=sum(len(s) for s in samples),
        samples=len(samples), micro_batches=len(batches), grad_norm=float(grad_norm),
        step_time_s=time.perf_counter() - start,
    )
