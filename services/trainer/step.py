"""One optimizer step of a causal LM (or a vision-language model: samples with images pass
their pixels, pixels.py) on a list of samples.

`train_step` reads top to bottom: normalisation weights over the whole batch → micro-batches
(samples sorted longest first, right-padded) → per micro-batch: forward, float32 logprobs of the
sampled tokens, loss, backward (gradients accumulate) → gradient clipping → AdamW step.

Because every token's normalisation weight is computed over the whole batch before any
micro-batch runs (`loss.sample_weights`), the accumulated gradient is the gradient of the one
batch loss, whatever the micro-batch size: results differ only by float rounding.

Sharded (world size N > 1, `sharding.py`): `samples` are this rank's share of the global batch
(`sharding.split_by_tokens`). The ranks all-gather their samples' loss-token counts and rollout
ids, so every token gets exactly the weight one process would give it over the global batch;
each rank backpropagates its own part of the batch loss and FSDP2 sums the gradients over ranks.
Every rank runs the same number of micro-batches (a rank with fewer runs empty passes that
contribute zero: FSDP's collectives need every rank in every forward/backward). Loss and
metric sums are all-reduced, the gradient norm is taken over the whole (sharded) gradient.

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
from .pixels import pixel_inputs
from .samples import Sample
from .sharding import Dist


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


def sample_logprobs(model: torch.nn.Module, rows: Sequence[Sample], pad_token_id: int,
                    device: torch.device, with_entropy: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's float32 logprob of each token of `rows` given the ones before it ([B, T-1]:
    position i is token i + 1), right-padded, with the rows' images' pixels (pixels.py), and
    the next-token entropies (`token_logprobs`)."""
    input_ids = _pad([s.input_ids for s in rows], pad_token_id, torch.long, device)
    logits = model(input_ids=input_ids, use_cache=False,
                   **pixel_inputs(rows, device)).logits[:, :-1]
    return token_logprobs(logits, input_ids[:, 1:], with_entropy)


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
    dist: Dist | None = None,
) -> StepMetrics:
    """One optimizer step of `model` on `samples` (this rank's share when `dist` is sharded;
    see the module docstring)."""
    config = config or StepConfig()
    d = dist or Dist.single()
    start = time.perf_counter()
    weights = _token_weights(samples, config, d)
    device = next(model.parameters()).device
    batches = micro_batches([len(s) for s in samples], config.micro_batch_size,
                            config.micro_batch_max_tokens)
    passes = d.max(len(batches))  # every rank runs as many (sharded: empty passes pad)

    model.train()
    optimizer.zero_grad(set_to_none=True)
    total: LossTerms | None = None
    for k in range(passes):
        if k >= len(batches):
            _empty_pass(model, config.pad_token_id, device)
            continue
        batch = batches[k]
        rows = [samples[i] for i in batch]
        # position i of the shifted tensors is token i + 1, predicted from position i
        mask = _pad([s.loss_mask for s in rows], 0, torch.bool, device)[:, 1:]
        behaviour = _pad([s.behaviour_logprobs for s in rows], 0.0, torch.float32, device)[:, 1:]
        advantages = torch.tensor([s.advantage for s in rows], dtype=torch.float32,
                                  device=device)[:, None].expand_as(behaviour)
        token_w = torch.tensor([weights[i] for i in batch], dtype=torch.float32,
                               device=device)[:, None].expand_as(behaviour)

        logprobs, entropy = sample_logprobs(model, rows, config.pad_token_id, device)
        terms = policy_loss(logprobs, behaviour, advantages, mask, token_w, config.loss, entropy)
        terms.loss.backward()
        terms.loss = terms.loss.detach()
        total = terms if total is None else total + terms
        del logprobs, entropy, terms

    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = _clip_gradients(params, config.max_grad_norm, d)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    if total is None:  # a rank without samples (sharded only)
        total = LossTerms(loss=torch.zeros(()), kl_sum=0.0, clipped=0, capped=0,
                          entropy_sum=0.0, tokens=0)
    if d.sharded:
        loss, kl, clipped, capped, ent, tokens, input_tokens, n = d.sum([
            float(total.loss), total.kl_sum, total.clipped, total.capped, total.entropy_sum,
            total.tokens, sum(len(s) for s in samples), len(samples)])
        total = LossTerms(loss=torch.tensor(loss), kl_sum=kl, clipped=int(clipped),
                          capped=int(capped), entropy_sum=ent, tokens=int(tokens))
        n_input, n_samples = int(input_tokens), int(n)
    else:
        n_input, n_samples = sum(len(s) for s in samples), len(samples)
    m = total.metrics()
    return StepMetrics(
        loss=m["loss"], kl=m["kl"], clip_frac=m["clip_frac"], capped_frac=m["capped_frac"],
        entropy=m["entropy"], tokens=total.tokens, input_tokens=n_input,
        samples=n_samples, micro_batches=passes, grad_norm=float(grad_norm),
        step_time_s=time.perf_counter() - start,
    )


def _token_weights(samples: Sequence[Sample], config: StepConfig, d: Dist) -> list[float]:
    """The normalisation weight of each of `samples`, over the global batch: the ranks'
    loss-token counts and rollout ids are all-gathered, so the weights are exactly those one
    process computes over all samples."""
    mine = [(s.num_loss_tokens, s.rollout_id) for s in samples]
    parts = d.all_gather(mine)
    everything = [x for part in parts for x in part]
    if not everything or sum(n for n, _ in everything) == 0:
        raise ValueError("train_step needs samples with at least one loss token")
    weights = sample_weights([n for n, _ in everything], [k for _, k in everything],
                             config.loss.normalization)
    offset = sum(len(part) for part in parts[:d.rank])
    return weights[offset:offset + len(samples)]


def _empty_pass(model: torch.nn.Module, pad_token_id: int, device: torch.device) -> None:
    """A forward and backward that changes no gradient: keeps a rank with fewer micro-batches
    in step with FSDP's collectives."""
    x = torch.full((1, 2), pad_token_id, dtype=torch.long, device=device)
    (model(input_ids=x, use_cache=False).logits.sum() * 0.0).backward()


def _clip_gradients(params: list[torch.Tensor], max_norm: float, d: Dist) -> torch.Tensor:
    """Clips the total gradient L2 norm to `max_norm`; returns the norm before clipping (over
    the whole model: sharded gradients' norms are reduced over ranks)."""
    if not d.sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=True)
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of the gradients is {float(norm)}: a non-finite "
                           "loss or gradient (lower the learning rate, or check the samples)")
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
