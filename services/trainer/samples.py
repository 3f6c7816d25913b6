"""From a completed group (store records) to training samples (token ids, loss mask, logprobs).

**Samples from token segments.** The gateway records which calls share one token sequence
(`Call.segment_start`, `segment`, `extends_seq`: token in, token out, see
`services/gateway/tokens.py`): a call that CONTINUES its segment was sent the prompt + completion
ids of the call it extends, unchanged, followed by the new messages' tokens. A rollout's calls
are taken in `seq` order; a continuing call is appended to the sample that ends with the call it
extends: the new prompt tokens in between — the tokens closing the earlier assistant turn, tool
output, a user turn, the chat template's turn markers — go in with loss mask 0, its completion
with loss mask 1. A call that starts a segment (the first, history edited or truncated, tools
changed, ...) starts a new sample with its own prompt as context; so does a continuing call
whose parent's sample has meanwhile been extended by another branch. A continuing call whose
prompt does not begin with its parent's tokens is a corrupt record (ValueError). Calls recorded
without segment information (an older gateway) are merged as before: appended to the current
sample when their prompt extends its tokens token for token, else a new sample. Token ids are
used exactly as the gateway recorded them — a completion ending in an EOS token keeps it (and
is trained on it, so the policy learns to stop); nothing is ever re-tokenized from text.

**Alignment.** `input_ids[i]` is the i-th token; `loss_mask[i]` is 1 when token i was generated
by the policy; `behaviour_logprobs[i]` is the logprob the engine recorded for token i (0.0 where
the mask is 0). The trainer predicts token i from the logits at position i - 1. A completion
token at position 0 (an empty first prompt) has nothing to be predicted from and is masked out.

**Failed rollouts.** Only rollouts with status SUCCEEDED and a reward are used; FAILED and
CANCELLED ones (crashed or timed-out harness, grader failure: mostly infrastructure, and without
a reward to learn from) are dropped, and the advantages are computed over the rest. If fewer
than `AdvantageConfig.min_rollouts` (>= 2) remain, the whole group is skipped. A succeeded
rollout that made no model call still counts in its group's baseline; it yields no sample.

**Truncation (`max_len`).** A sample never exceeds `max_len` tokens. A call that would make the
current sample longer starts a new sample instead (its own prompt is its full context, so every
completion token is still trained in the context it was generated in). A single call longer
than `max_len` keeps its first `max_len` tokens (the prompt and the start of the completion) and
drops the tail: the dropped completion tokens are not trained on. The context is never cut from
the left, which would train tokens on a context they were not generated from. A sample left
with no loss token (the prompt alone reaches `max_len`) is dropped; `GroupSamples` counts the
completion tokens lost this way.

**Images** (issue #45, docs/vision.md). A call with images (`Call.images`) starts a sample of its
own, and nothing is appended to it: its prompt holds every image of the conversation as
placeholder tokens, and the sample carries their hashes (`Sample.images`) and the pixel inputs
the model's processor makes of their bytes (`Sample.pixels`, from a `PixelSource`: pixels.py's
`ImagePixels`). Without a pixel source (a text model) a call with images is refused: training
on its ids without their pixels would be wrong. A rollout an image of which the store does not
hold is dropped, with the reason, before the group's advantages are computed, as a failed one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from harnessrl.v1 import common_pb2

from .advantages import AdvantageConfig, group_advantages, is_zero_variance


@dataclass
class Sample:
    """One training sequence: one or more calls of one rollout, merged."""

    input_ids: list[int]
    loss_mask: list[int]
    """1 on tokens the policy generated (trained on), 0 on prompt / inserted tokens."""
    behaviour_logprobs: list[float]
    """Logprob the engine recorded for each token; 0.0 where `loss_mask` is 0."""
    advantage: float
    """The rollout's advantage, shared by every loss token of the sample."""
    reward: float
    rollout_id: str
    group_id: str = ""
    policy_versions: list[int] = field(default_factory=list)
    """Policy version of each call merged into this sample, in `seq` order."""
    call_seqs: list[int] = field(default_factory=list)
    """`seq` of each call merged into this sample."""
    images: list[str] = field(default_factory=list)
    """sha256 of each image in the prompt, in order (a call with images: a sample of its own)."""
    pixels: dict[str, Any] | None = None
    """The processor's pixel inputs of `images` (`pixel_values`, `pixel_attention_mask`: tensors
    with a batch dimension of 1), passed to the model with `input_ids`; None: no images."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class GroupSamples:
    """What one group gave: its samples, or the reason it was skipped."""

    group_id: str
    samples: list[Sample]
    rewards: list[float]
    """Rewards of the usable rollouts (succeeded, rewarded), in group order."""
    advantages: list[float]
    """Advantage of each usable rollout, aligned with `rewards`."""
    dropped_rollouts: list[str]
    """Ids of rollouts left out: not SUCCEEDED, or without a reward."""
    skipped: str | None = None
    """Why no sample was made: "too_few_rollouts" or "zero_variance"; None when used."""
    truncated_tokens: int = 0
    """Completion tokens not trained on because of `max_len`."""
    drop_reasons: dict[str, str] = field(default_factory=dict)
    """Rollout id -> why a succeeded rollout was left out (an image the store lacks)."""


class PixelSource(Protocol):
    """The pixel inputs of recorded calls' images (pixels.py's `ImagePixels`)."""

    def fetch(self, rollouts: Sequence[common_pb2.Rollout]) -> dict[str, str]:
        """Fetches the images the rollouts' calls name; returns rollout id -> why it cannot be
        trained on (an image the store does not hold)."""
        ...

    def pixels(self, rollout_id: str, call: common_pb2.Call) -> dict[str, Any] | None:
        """The pixel inputs of `call`'s images (fetched by `fetch`; None: it has none);
        ValueError when they cannot be the engine's (other processor settings, image tokens in
        a call that names no image)."""
        ...


def _extends(prompt: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(prompt) >= len(prefix) and list(prompt[: len(prefix)]) == list(prefix)


def _check_call(rollout_id: str, call: common_pb2.Call, with_pixels: bool) -> None:
    n_tok, n_lp = len(call.completion_token_ids), len(call.logprobs)
    if n_tok != n_lp:
        raise ValueError(
            f"rollout {rollout_id} call {call.seq}: {n_tok} completion tokens but {n_lp} logprobs"
        )
    if not all(math.isfinite(lp) and lp <= 0.0 for lp in call.logprobs):
        raise ValueError(f"rollout {rollout_id} call {call.seq}: logprobs must be finite and <= 0")
    if call.images and not with_pixels:  # placeholders only their pixels give meaning
        raise ValueError(f"rollout {rollout_id} call {call.seq}: the call has images, and the "
                         f"trainer's model is not a vision model (docs/vision.md): training on "
                         f"its token ids without their pixels would be wrong")


def rollout_samples(
    rollout: common_pb2.Rollout, advantage: float, max_len: int | None = None,
    pixels: PixelSource | None = None,
) -> tuple[list[Sample], int]:
    """Samples of one rollout (see the module docstring) and the completion tokens truncated;
    `pixels`: the pixel inputs of its calls' images (fetched already)."""
    if max_len is not None and max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    calls = sorted(rollout.calls, key=lambda c: c.seq)
    samples: list[Sample] = []
    truncated = 0
    current: Sample | None = None
    opened: list[Sample] = []  # in the order they were started

    def new_sample() -> Sample:
        return Sample(
            input_ids=[], loss_mask=[], behaviour_logprobs=[], advantage=advantage,
            reward=rollout.reward, rollout_id=rollout.rollout_id, group_id=rollout.group_id,
        )

    def finish(sample: Sample | None) -> None:
        nonlocal truncated
        if sample is None:
            return
        if max_len is not None and len(sample) > max_len:
            truncated += sum(sample.loss_mask[max_len:])
            del sample.input_ids[max_len:], sample.loss_mask[max_len:]
            del sample.behaviour_logprobs[max_len:]
        if sample.loss_mask and sample.loss_mask[0]:  # nothing to predict position 0 from
            sample.loss_mask[0], sample.behaviour_logprobs[0] = 0, 0.0
        if sample.num_loss_tokens > 0:
            samples.append(sample)

    by_last_seq: dict[int, Sample] = {}  # open samples by the seq of their last call
    for call in calls:
        if call.aborted:  # the harness never received this response: not a trajectory step
            continue
        _check_call(rollout.rollout_id, call, pixels is not None)
        prompt, completion = list(call.prompt_token_ids), list(call.completion_token_ids)
        fits = max_len is None or len(prompt) + len(completion) <= max_len
        if call.segment_start == common_pb2.SEGMENT_START_CONTINUED:
            parent = by_last_seq.pop(call.extends_seq, None)
            if parent is not None and not _extends(prompt, parent.input_ids):
                raise ValueError(
                    f"rollout {rollout.rollout_id} call {call.seq}: recorded as extending call "
                    f"{call.extends_seq}, but its prompt does not begin with that call's tokens")
        elif call.segment_start == common_pb2.SEGMENT_START_UNSPECIFIED:
            parent = current if current is not None and _extends(prompt, current.input_ids) \
                else None
        else:
            parent = None
        if call.images or (parent is not None and parent.images):
            parent = None  # an image call's sample is its own (its pixels are the prompt's)
        if parent is not None and fits:
            current, inserted = parent, prompt[len(parent.input_ids):]
        else:
            current, inserted = new_sample(), prompt
            opened.append(current)
        if current.call_seqs:
            by_last_seq.pop(current.call_seqs[-1], None)
        current.input_ids += inserted + completion
        current.loss_mask += [0] * len(inserted) + [1] * len(completion)
        current.behaviour_logprobs += [0.0] * len(inserted) + [float(x) for x in call.logprobs]
        current.policy_versions.append(call.policy_version)
        current.call_seqs.append(call.seq)
        by_last_seq[call.seq] = current
        if pixels is not None and (inputs := pixels.pixels(rollout.rollout_id, call)):
            current.images, current.pixels = [i.sha256 for i in call.images], inputs
    for sample in opened:
        finish(sample)
    return samples, truncated


def _usable(rollout: common_pb2.Rollout) -> bool:
    return rollout.status == common_pb2.ROLLOUT_STATUS_SUCCEEDED and rollout.has_reward


def group_samples(
    group: common_pb2.Group,
    config: AdvantageConfig | None = None,
    max_len: int | None = None,
    pixels: PixelSource | None = None,
) -> GroupSamples:
    """Training samples of one completed group, each carrying its rollout's advantage;
    `pixels`: where the pixel inputs of its calls' images come from (a vision model)."""
    config = config or AdvantageConfig()
    usable = [r for r in group.rollouts if _usable(r)]
    reasons = pixels.fetch(usable) if pixels is not None else {}  # an image not stored
    usable = [r for r in usable if r.rollout_id not in reasons]
    kept = {r.rollout_id for r in usable}
    dropped = [r.rollout_id for r in group.rollouts if r.rollout_id not in kept]
    rewards = [r.reward for r in usable]
    result = GroupSamples(
        group_id=group.group_id, samples=[], rewards=rewards, advantages=[],
        dropped_rollouts=dropped, drop_reasons=reasons,
    )
    if len(usable) < config.min_rollouts:
        result.skipped = "too_few_rollouts"
        return result
    result.advantages = group_advantages(rewards, config.estimator, config.eps)
    if config.filter_zero_variance and is_zero_variance(rewards):
        result.skipped = "zero_variance"
        return result
    for rollout, advantage in zip(usable, result.advantages, strict=True):
        samples, truncated = rollout_samples(rollout, advantage, max_len, pixels)
        result.samples += samples
        result.truncated_tokens += truncated
    return result
