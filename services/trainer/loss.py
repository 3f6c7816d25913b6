"""Token-level clipped policy-gradient loss against the behaviour policy, with truncated IS.

Notation, per loss token t (loss mask 1): pi the policy being trained (logprobs with gradient),
mu the behaviour policy — the engine that sampled the token, whose logprob the gateway recorded —
A the token's advantage, and the one ratio this loss uses

    r = pi(t) / mu(t) = exp(logprob - behaviour_logprob).

Per-token objective (maximised; the loss is its negative):

    J_t = (1 + eps_high) * A   if A > 0 and r > 1 + eps_high      (clipped: a constant)
    J_t = (1 - eps_low) * A    if A < 0 and r < 1 - eps_low       (clipped: a constant)
    J_t = rc * A               otherwise, where rc = r * sg(min(1, C / r)):
                               rc = min(r, C) in value, d rc = min(r, C) * d log pi

with sg() stopping gradients. Wherever r <= C this is exactly PPO's clipped surrogate
min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A). Its gradient, per token:

    dJ_t = min(r, C) * A * grad log pi(t)   inside the trust region,
    dJ_t = 0                                where PPO clips (the two first cases).

So: the importance weight pi/mu that corrects for the tokens having been sampled by mu is
applied to each token's gradient *truncated at C* (`is_cap`); that is the quantity capped — the
per-token ratio to the behaviour policy, detached (truncated importance sampling). The cap
matters where PPO's clip does not bound the ratio: A < 0 with r large (for A > 0 the clip
already stops the gradient at r > 1 + eps_high, so a cap C >= 1 + eps_high never binds there).
In value, an unclipped token with r > C (A < 0 when C >= 1 + eps_high) gives C * A.

Why the ratio is taken to mu, and how this covers every mode unchanged. PPO's ratio is
pi / pi_old, pi_old the policy at the start of the update. With one optimizer step per batch
(every mode of this trainer) and a trainer exactly on-policy (sync mode: the engine serves the
trainer's current weights), mu = pi_old, so r = pi / mu *is* PPO's ratio: it equals 1 at the
start of the step (up to engine-vs-trainer numerics, which the cap and clip also absorb) and the
loss is the plain policy gradient A * grad log pi. When the data are stale (async mode: tokens
sampled by an older policy, possibly several versions within one merged sample — each token
carries its own recorded logprob), r = pi / mu differs from 1 and the same formula does the
off-policy work: the clip is a trust region around the policy that actually sampled the data
(tokens already pushed past it in their advantage's direction give no gradient), and the
truncated weight bounds the variance of the correction. No separate proximal policy (an extra
forward pass) is needed; with one update per batch it would equal pi in value and make PPO's
own ratio identically 1.

Defaults: eps_low = 0.2, eps_high = 0.28 (DAPO's "clip-higher": more room for raising the
probability of rare good tokens than PPO's symmetric 0.2), is_cap = 2.0 (as in the truncated
importance sampling of Yao et al., "Your efficient RL framework secretly brings you off-policy
RL training").

Normalisation (the weight w_t of each token in the batch loss L = -sum_t w_t * J_t); the weights
are computed once over the whole optimizer step's batch, so gradient accumulation over
micro-batches adds up to exactly the same loss:

- ``token_mean``:   w_t = 1 / (loss tokens in the batch)
- ``seq_mean``:     w_t = 1 / (loss tokens of t's sample * samples in the batch)
- ``rollout_mean``: w_t = 1 / (loss tokens of t's rollout * rollouts in the batch), for
  rollouts whose calls were split over several samples.

Metrics, over loss tokens: `kl` — KL(mu || pi) estimated on mu's samples with Schulman's k3,
(r - 1) - log r (unbiased, always >= 0); `clip_frac` — fraction of tokens in PPO's clipped
region; `capped_frac` — fraction whose weight the IS cap truncated; `entropy` — mean entropy of
pi's next-token distribution; `tokens` — number of loss tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class Normalization(StrEnum):
    TOKEN_MEAN = "token_mean"
    SEQ_MEAN = "seq_mean"
    ROLLOUT_MEAN = "rollout_mean"


class LossConfig(BaseModel):
    """The policy loss's hyper-parameters (see the module docstring for the formula)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    eps_low: float = Field(0.2, description="lower clip: tokens with A < 0 and r < 1 - eps_low "
                                            "give no gradient (PPO eps_low)")
    eps_high: float = Field(0.28, description="upper clip: tokens with A > 0 and "
                                              "r > 1 + eps_high give no gradient (clip-higher)")
    is_cap: float = Field(2.0, description="C: the importance weight pi/mu applied to a token's "
                                           "gradient is min(pi/mu, C) (truncated IS)")
    normalization: Normalization = Field(Normalization.TOKEN_MEAN,
                                         description="how token losses are averaged: "
                                                     "token_mean, seq_mean or rollout_mean")
    max_sample_len: int | None = Field(None, ge=2, description="longest training sample in "
                                                               "tokens (None: no limit)")

    @model_validator(mode="after")
    def _check(self) -> "LossConfig":
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got "
                             f"{self.eps_low}, {self.eps_high}")
        if not (math.isfinite(self.is_cap) and self.is_cap >= 1.0):
            raise ValueError(f"is_cap must be finite and >= 1, got {self.is_cap}")
        return self


def sample_weights(
    loss_tokens: Sequence[int],
    rollout_keys: Sequence[Hashable],
    normalization: Normalization | str,
) -> list[float]:
    """The weight w of every loss token of each sample (the same for all tokens of a sample).

    `loss_tokens[i]` is sample i's number of loss tokens, `rollout_keys[i]` its rollout. The
    weights of all loss tokens of the batch sum to 1 (0.0 for a sample without loss tokens).
    """
    normalization = Normalization(normalization)
    if len(loss_tokens) != len(rollout_keys):
        raise ValueError("loss_tokens and rollout_keys differ in length")
    if normalization is Normalization.TOKEN_MEAN:
        total = sum(loss_tokens)
        return [1.0 / total if n and total else 0.0 for n in loss_tokens]
    if normalization is Normalization.SEQ_MEAN:
        n_seqs = sum(1 for n in loss_tokens if n)
        return [1.0 / (n * n_seqs) if n else 0.0 for n in loss_tokens]
    per_rollout: Counter[Hashable] = Counter()
    for n, key in zip(loss_tokens, rollout_keys, strict=True):
        per_rollout[key] += n
    n_rollouts = sum(1 for n in per_rollout.values() if n)
    return [
        1.0 / (per_rollout[key] * n_rollouts) if n else 0.0
        for n, key in zip(loss_tokens, rollout_keys, strict=True)
    ]


@dataclass
class LossTerms:
    """The loss of a (micro-)batch and metric sums, to be added up over micro-batches."""

    loss: torch.Tensor
    """-sum_t w_t * J_t over the loss tokens given; backpropagate this."""
    kl_sum: float
    clipped: int
    capped: int
    entropy_sum: float
    tokens: int

    def __add__(self, other: LossTerms) -> LossTerms:
        return LossTerms(
            loss=self.loss.detach() + other.loss.detach(),
            kl_sum=self.kl_sum + other.kl_sum, clipped=self.clipped + other.clipped,
            capped=self.capped + other.capped, entropy_sum=self.entropy_sum + other.entropy_sum,
            tokens=self.tokens + other.tokens,
        )

    def metrics(self) -> dict[str, float]:
        """loss, kl, clip_frac, capped_frac, entropy (token means), tokens."""
        n = max(self.tokens, 1)
        return {
            "loss": float(self.loss.detach()),
            "kl": self.kl_sum / n,
            "clip_frac": self.clipped / n,
            "capped_frac": self.capped / n,
            "entropy": self.entropy_sum / n,
            "tokens": float(self.tokens),
        }


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    weights: torch.Tensor,
    config: LossConfig,
    entropy: torch.Tensor | None = None,
) -> LossTerms:
    """The loss over the tokens given (all tensors the same shape, e.g. [batch, time]).

    `logprobs`: the trained policy's logprob of each token (with gradient, float32);
    `behaviour_logprobs`: the recorded ones; `advantages`: per token; `loss_mask`: 1/0 (or bool);
    `weights`: the normalisation weight of each token (`sample_weights`, broadcast); `entropy`:
    optional per-token entropy of the policy, for the metric only. Masked tokens contribute
    nothing, whatever their values (they are selected away, never multiplied by 0, so an inf or
    nan there cannot leak in).
    """
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(mask, logprobs - behaviour_logprobs.to(logprobs.dtype), zero)
    adv = torch.where(mask, advantages.to(logprobs.dtype), zero)
    w = torch.where(mask, weights.to(logprobs.dtype), zero)

    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        clipped = ((adv > 0) & (ratio > 1 + config.eps_high)) | (
            (adv < 0) & (ratio < 1 - config.eps_low)
        )
        clipped &= mask
        log_cap = math.log(config.is_cap)
        capped = mask & ~clipped & (log_ratio > log_cap)
        bound = torch.where(adv > 0, 1 + config.eps_high, 1 - config.eps_low).to(logprobs.dtype)
        # k3 = (r - 1) - log r, with log r clamped so exp cannot overflow for a wild token
        lr = log_ratio.clamp(-20.0, 20.0)
        kl = torch.where(mask, torch.expm1(lr) - lr, zero)

    # min(r, C) in value, d/dtheta = min(r, C) * dlogpi: the truncated, detached IS weight
    # times the policy gradient (the weight from the clamped log ratio: no overflow for any r).
    is_weight = torch.exp(log_ratio.detach().clamp(max=log_cap))
    capped_ratio = is_weight * (1.0 + log_ratio - log_ratio.detach())
    objective = torch.where(clipped, bound * adv, capped_ratio * adv)
    loss = -(w * objective).sum()

    entropy_sum = 0.0
    if entropy is not None:
        entropy_sum = float(torch.where(mask, entropy.detach().float(), 0.0).sum())
    return LossTerms(
        loss=loss, kl_sum=float(kl.sum()), clipped=int(clipped.sum()), capped=int(capped.sum()),
        entropy_sum=entropy_sum, tokens=int(mask.sum()),
    )
