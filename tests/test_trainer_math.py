"""The trainer's math against hand-computed values: advantages, samples, the policy loss.

Every expected number below is worked out by hand in the comment next to it.
"""

from __future__ import annotations

import math

import pytest
import torch

from harnessrl.v1 import common_pb2
from services.trainer.advantages import AdvantageConfig, group_advantages
from services.trainer.loss import LossConfig, Normalization, policy_loss, sample_weights
from services.trainer.samples import group_samples, rollout_samples

SUCCEEDED = common_pb2.ROLLOUT_STATUS_SUCCEEDED
FAILED = common_pb2.ROLLOUT_STATUS_FAILED


# ---------------------------------------------------------------------------- advantages


def test_grpo_uses_group_mean_and_sample_std() -> None:
    # r = [1, 0, 0, 0]: mean 0.25; deviations .75, -.25 x3; squares .5625 + 3 * .0625 = .75;
    # sample variance .75 / 3 = .25, std .5  ->  A = .75 / .5 = 1.5 and -.25 / .5 = -.5
    assert group_advantages([1, 0, 0, 0], "grpo", eps=0.0) == pytest.approx(
        [1.5, -0.5, -0.5, -0.5], abs=1e-12)
    # with eps 1e-6: .75 / .500001 = 1.49999700000600, -.25 / .500001 = -0.49999900000200
    assert group_advantages([1, 0, 0, 0], "grpo") == pytest.approx(
        [1.499997000006, -0.499999000002, -0.499999000002, -0.499999000002], abs=1e-12)
    # r = [1, .5, 0]: mean .5; deviations .5, 0, -.5; variance .5 / 2 = .25, std .5 -> 1, 0, -1
    assert group_advantages([1.0, 0.5, 0.0], "grpo", eps=0.0) == pytest.approx(
        [1.0, 0.0, -1.0], abs=1e-12)


def test_dr_grpo_subtracts_the_mean_only() -> None:
    # r = [1, 0, 0, 0], mean .25 -> .75, -.25
    assert group_advantages([1, 0, 0, 0], "dr_grpo") == pytest.approx(
        [0.75, -0.25, -0.25, -0.25], abs=1e-12)
    # r = [1, .5, 0], mean .5 -> .5, 0, -.5
    assert group_advantages([1.0, 0.5, 0.0], "dr_grpo") == pytest.approx(
        [0.5, 0.0, -0.5], abs=1e-12)


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    # r = [1, 0, 0, 0]: 1 - mean(0,0,0) = 1;  0 - mean(1,0,0) = -1/3
    assert group_advantages([1, 0, 0, 0], "rloo") == pytest.approx(
        [1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-12)
    # r = [1, .5, 0]: 1 - .25 = .75;  .5 - .5 = 0;  0 - .75 = -.75
    assert group_advantages([1.0, 0.5, 0.0], "rloo") == pytest.approx(
        [0.75, 0.0, -0.75], abs=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_zero_variance_group_gives_exactly_zero(estimator: str) -> None:
    # 0.1 * 3 / 3 is not exactly 0.1 in floats; grpo would turn the residue into 1e-11 or so
    assert group_advantages([0.1, 0.1, 0.1], estimator) == [0.0, 0.0, 0.0]


def test_advantages_reject_a_lone_rollout_and_bad_rewards() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages([1.0], "grpo")
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, math.nan], "grpo")
    with pytest.raises(ValueError):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValueError):
        AdvantageConfig(min_rollouts=1)


# ---------------------------------------------------------------------------- samples


def call(seq: int, prompt: list[int], completion: list[int], logprobs: list[float],
         version: int = 0) -> common_pb2.Call:
    return common_pb2.Call(seq=seq, prompt_token_ids=prompt, completion_token_ids=completion,
                           logprobs=logprobs, policy_version=version)


def rollout(rid: str, calls: list[common_pb2.Call], reward: float = 1.0,
            status: int = SUCCEEDED) -> common_pb2.Rollout:
    return common_pb2.Rollout(rollout_id=rid, group_id="g", status=status,
                              has_reward=status == SUCCEEDED, reward=reward, calls=calls)


def test_extending_prompts_merge_with_inserted_tokens_masked() -> None:
    # given out of order: samples follow seq
    r = rollout("r", [
        call(1, [1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.3, -0.4], version=8),  # +6 7 (tool output)
        call(0, [1, 2, 3], [4, 5], [-0.1, -0.2], version=7),
    ])
    samples, truncated = rollout_samples(r, advantage=0.5)
    assert truncated == 0 and len(samples) == 1
    s = samples[0]
    assert s.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert s.behaviour_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4])
    assert s.advantage == 0.5 and s.reward == 1.0 and s.rollout_id == "r"
    assert s.policy_versions == [7, 8] and s.call_seqs == [0, 1]
    assert s.num_loss_tokens == 4


def test_a_prompt_that_does_not_extend_starts_a_new_sample() -> None:
    r = rollout("r", [
        call(0, [1, 2, 3], [4, 5], [-0.1, -0.2]),
        call(1, [1, 2, 3, 4, 5, 6], [7], [-0.3]),  # extends: merged
        call(2, [1, 2, 99, 4, 5, 6, 7], [10], [-0.5]),  # token 3 rewritten: new sample
        call(3, [1, 2, 99], [11], [-0.6]),  # shorter than the sample so far: new sample
    ])
    samples, _ = rollout_samples(r, advantage=1.0)
    assert [s.input_ids for s in samples] == [
        [1, 2, 3, 4, 5, 6, 7], [1, 2, 99, 4, 5, 6, 7, 10], [1, 2, 99, 11]]
    assert [s.loss_mask for s in samples] == [
        [0, 0, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 1]]
    assert [s.behaviour_logprobs[-1] for s in samples] == pytest.approx([-0.3, -0.5, -0.6])
    assert [s.call_seqs for s in samples] == [[0, 1], [2], [3]]


def test_recorded_eos_is_kept_and_trained_an_inserted_one_is_not() -> None:
    eos, nl = 2, 13
    r = rollout("r", [
        call(0, [1, 5], [6, eos], [-0.1, -0.01]),  # stopped on EOS: recorded with the EOS
        call(1, [1, 5, 6, eos, nl, 7], [8], [-0.2]),  # finish_reason "length": no EOS
        call(2, [1, 5, 6, eos, nl, 7, 8, eos, nl, 9], [10, eos], [-0.3, -0.02]),
    ])
    (s,), _ = rollout_samples(r, advantage=1.0)
    assert s.input_ids == [1, 5, 6, eos, nl, 7, 8, eos, nl, 9, 10, eos]
    # the first EOS was generated (loss 1, its logprob); the second was added by the template
    assert s.loss_mask == [0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1]
    assert s.behaviour_logprobs == pytest.approx(
        [0, 0, -0.1, -0.01, 0, 0, -0.2, 0, 0, 0, -0.3, -0.02])


def test_a_rollout_with_one_call() -> None:
    (s,), _ = rollout_samples(rollout("r", [call(0, [1, 2], [3, 4, 5], [-1, -2, -3])]), -0.25)
    assert s.input_ids == [1, 2, 3, 4, 5] and s.loss_mask == [0, 0, 1, 1, 1]
    assert s.behaviour_logprobs == [0.0, 0.0, -1.0, -2.0, -3.0] and s.advantage == -0.25


def test_max_len_starts_a_new_sample_then_truncates_the_tail() -> None:
    r = rollout("r", [
        call(0, [1, 2, 3], [4, 5], [-0.1, -0.2]),
        call(1, [1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.3, -0.4]),
    ])
    # merged length 9 > 8: call 1 starts its own sample [1..9] (len 9), cut to its first 8
    # tokens, so completion token 9 is not trained: truncated = 1
    samples, truncated = rollout_samples(r, 1.0, max_len=8)
    assert [s.input_ids for s in samples] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8]]
    assert [s.loss_mask for s in samples] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1]]
    assert samples[1].behaviour_logprobs[-1] == pytest.approx(-0.3) and truncated == 1
    # max_len 3: call 0 keeps only its prompt, call 1 only its prompt's first 3 tokens: both
    # samples are left without loss tokens and dropped; all 4 completion tokens are lost
    samples, truncated = rollout_samples(r, 1.0, max_len=3)
    assert samples == [] and truncated == 4


def segment_call(seq: int, prompt: list[int], completion: list[int], logprobs: list[float],
                 start: int, extends: int | None = None) -> common_pb2.Call:
    out = call(seq, prompt, completion, logprobs)
    out.segment_start = start  # type: ignore[assignment]
    if extends is not None:
        out.extends_seq = extends
    return out


def test_samples_follow_the_recorded_segments() -> None:
    CONT, FIRST, EDITED = (common_pb2.SEGMENT_START_CONTINUED, common_pb2.SEGMENT_START_FIRST,
                           common_pb2.SEGMENT_START_EDITED)
    r = rollout("r", [
        segment_call(0, [1, 2], [3, 4], [-0.1, -0.2], FIRST),
        segment_call(1, [9], [8], [-0.9], EDITED),  # a side conversation between two turns
        # the main conversation goes on from call 0: tokens 5 6 closing + new, completion 7
        segment_call(2, [1, 2, 3, 4, 5, 6], [7], [-0.3], CONT, extends=0),
        # a second branch from call 0 (its sample now ends with call 2): a sample of its own
        segment_call(3, [1, 2, 3, 4, 50], [51], [-0.5], CONT, extends=0),
        # the side conversation continues: merged with call 1 although call 3 came between
        segment_call(4, [9, 8, 10], [11], [-0.4], CONT, extends=1),
        # a prompt that would also extend call 2's tokens but starts a segment: new sample
        segment_call(5, [1, 2, 3, 4, 5, 6, 7, 12], [13], [-0.6], EDITED),
    ])
    samples, truncated = rollout_samples(r, advantage=1.0)
    assert truncated == 0
    assert [s.call_seqs for s in samples] == [[0, 2], [1, 4], [3], [5]]
    assert [s.input_ids for s in samples] == [
        [1, 2, 3, 4, 5, 6, 7], [9, 8, 10, 11], [1, 2, 3, 4, 50, 51], [1, 2, 3, 4, 5, 6, 7, 12, 13]]
    assert [s.loss_mask for s in samples] == [
        [0, 0, 1, 1, 0, 0, 1], [0, 1, 0, 1], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0, 0, 1]]
    assert samples[0].behaviour_logprobs == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.3])
    assert samples[1].behaviour_logprobs == pytest.approx([0, -0.9, 0, -0.4])


def test_a_continued_call_whose_prompt_does_not_extend_its_parent_is_an_error() -> None:
    r = rollout("r", [
        segment_call(0, [1, 2], [3], [-0.1], common_pb2.SEGMENT_START_FIRST),
        segment_call(1, [1, 2, 30, 4], [5], [-0.2], common_pb2.SEGMENT_START_CONTINUED, 0),
    ])
    with pytest.raises(ValueError, match="does not begin with that call's tokens"):
        rollout_samples(r, 1.0)


def test_mismatched_logprobs_are_an_error() -> None:
    with pytest.raises(ValueError, match="2 completion tokens but 1 logprobs"):
        rollout_samples(rollout("r", [call(0, [1], [2, 3], [-0.1])]), 1.0)


def test_a_call_with_images_is_refused_without_a_vision_model() -> None:
    """Its prompt ids hold image placeholders: trained without the pixels behind them (a text
    model's trainer has none: no pixel source), the loss would be computed on a prompt the
    engine never saw. The group fails to build (the stream reader reports it, and dead-letters
    it after max_deliveries), loudly. With a vision model: tests/test_vision_trainer.py."""
    with_image = call(0, [1, 5, 5, 2], [3], [-0.5])
    with_image.images.add(sha256="ab" * 32, media_type="image/png", size_bytes=10)
    with pytest.raises(ValueError, match="is not a vision model"):
        rollout_samples(rollout("r", [with_image]), 1.0)


def group(rollouts: list[common_pb2.Rollout]) -> common_pb2.Group:
    return common_pb2.Group(group_id="g", rollouts=rollouts)


def one_call(rid: str, reward: float, status: int = SUCCEEDED) -> common_pb2.Rollout:
    return rollout(rid, [call(0, [1, 2], [3], [-0.5])], reward=reward, status=status)


def test_failed_rollouts_are_dropped_before_the_advantages() -> None:
    g = group([one_call("a", 1.0), one_call("b", 0.0), one_call("x", 0.0, FAILED),
               one_call("c", 0.0)])
    out = group_samples(g, AdvantageConfig(estimator="grpo", eps=0.0))
    # over a, b, c: r = [1, 0, 0], mean 1/3; deviations 2/3, -1/3, -1/3; squares sum 6/9;
    # sample variance 6/9 / 2 = 1/3, std 1/sqrt(3) -> A = 2/sqrt(3) = 1.1547005, -1/sqrt(3)
    assert out.dropped_rollouts == ["x"] and out.skipped is None
    assert out.rewards == [1.0, 0.0, 0.0]
    assert [s.rollout_id for s in out.samples] == ["a", "b", "c"]
    assert [s.advantage for s in out.samples] == pytest.approx(
        [1.1547005383792515, -0.5773502691896258, -0.5773502691896258], abs=1e-12)


def test_groups_with_too_few_rollouts_or_no_variance_are_skipped() -> None:
    out = group_samples(group([one_call("a", 1.0), one_call("b", 0.0, FAILED)]))
    assert out.skipped == "too_few_rollouts" and out.samples == []
    flat = group([one_call("a", 1.0), one_call("b", 1.0)])
    out = group_samples(flat)
    assert out.skipped == "zero_variance" and out.samples == []
    kept = group_samples(flat, AdvantageConfig(filter_zero_variance=False))
    assert kept.skipped is None and [s.advantage for s in kept.samples] == [0.0, 0.0]


# ---------------------------------------------------------------------------- loss

CFG = LossConfig(eps_low=0.2, eps_high=0.28, is_cap=2.0)


def run_loss(log_ratios: list[float], advantages: list[float], mask: list[int] | None = None,
             weights: list[float] | None = None, cfg: LossConfig = CFG,
             logprobs: list[float] | None = None, entropy: list[float] | None = None):
    n = len(advantages)
    behaviour = torch.full((n,), -1.0)
    lp = torch.tensor(logprobs) if logprobs is not None else behaviour + torch.tensor(log_ratios)
    lp.requires_grad_(True)
    mask_t = torch.tensor(mask if mask is not None else [1] * n)
    w = torch.tensor(weights) if weights is not None else torch.ones(n)
    terms = policy_loss(lp, behaviour, torch.tensor(advantages, dtype=torch.float32), mask_t, w,
                        cfg, torch.tensor(entropy) if entropy is not None else None)
    terms.loss.backward()
    return terms, lp.grad


def test_clipping_and_truncation_token_by_token() -> None:
    # (r, A) -> objective J and dJ/dlogpi = min(r, C) * A, or 0 where PPO clips
    #  r=1.1, A=+1: inside              J = 1.1             grad 1.1
    #  r=1.5, A=+1: above 1 + .28       J = 1.28 (clipped)  grad 0
    #  r=0.5, A=+1: below, but A > 0    J = 0.5             grad 0.5
    #  r=0.5, A=-1: below 1 - .2        J = -0.8 (clipped)  grad 0
    #  r=1.5, A=-1: above, but A < 0    J = -1.5            grad -1.5
    #  r=3.0, A=-1: beyond the cap 2    J = -2.0            grad -2.0 (weight capped at 2)
    #  r=0.9, A=-2: inside              J = -1.8            grad -1.8
    ratios = [1.1, 1.5, 0.5, 0.5, 1.5, 3.0, 0.9]
    advs = [1, 1, 1, -1, -1, -1, -2]
    terms, grad = run_loss([math.log(r) for r in ratios], advs)
    # loss = -sum J = -(1.1 + 1.28 + 0.5 - 0.8 - 1.5 - 2.0 - 1.8) = 3.22; d loss = -grad J
    assert float(terms.loss.detach()) == pytest.approx(3.22, abs=1e-5)
    assert grad.tolist() == pytest.approx([-1.1, 0, -0.5, 0, 1.5, 2.0, 1.8], abs=1e-5)
    m = terms.metrics()
    assert m["clip_frac"] == pytest.approx(2 / 7) and m["capped_frac"] == pytest.approx(1 / 7)
    assert m["tokens"] == 7


def test_on_policy_ratio_one_is_the_plain_policy_gradient() -> None:
    # r = 1 everywhere: J = A, grad = A; nothing clipped or capped, KL 0
    terms, grad = run_loss([0.0, 0.0, 0.0], [0.5, -1.5, 2.0])
    assert float(terms.loss.detach()) == pytest.approx(-(0.5 - 1.5 + 2.0))
    assert grad.tolist() == pytest.approx([-0.5, 1.5, -2.0])
    assert terms.metrics()["clip_frac"] == 0 and terms.metrics()["kl"] == 0


def test_is_cap_binds_below_the_upper_clip_when_set_low() -> None:
    # cap 1.1 < 1 + eps_high: r = 1.2, A = +1 is inside the clip range; weight min(1.2, 1.1)
    terms, grad = run_loss([math.log(1.2)], [1.0], cfg=LossConfig(is_cap=1.1))
    assert float(terms.loss.detach()) == pytest.approx(-1.1)
    assert grad.tolist() == pytest.approx([-1.1])
    assert terms.capped == 1 and terms.clipped == 0


def test_symmetric_clip_range() -> None:
    # eps 0.2 / 0.2: r = 1.25, A = +1 is now clipped at 1.2 (it was inside with 0.28)
    terms, grad = run_loss([math.log(1.25)], [1.0], cfg=LossConfig(eps_low=0.2, eps_high=0.2))
    assert float(terms.loss.detach()) == pytest.approx(-1.2) and grad.tolist() == [0.0]


def test_a_huge_ratio_stays_finite() -> None:
    # log r = 200 (r overflows float32); A = -1: weight capped at 2 -> J = -2, grad -2
    terms, grad = run_loss([200.0], [-1.0])
    assert float(terms.loss.detach()) == pytest.approx(2.0)
    assert grad.tolist() == pytest.approx([2.0])
    # k3 with log r clamped to 20: e^20 - 1 - 20 = 485165174.4
    assert terms.metrics()["kl"] == pytest.approx(math.exp(20) - 21, rel=1e-5)


def test_kl_k3_and_entropy_metrics() -> None:
    # k3 = (r - 1) - log r:  log r = .5 -> e^.5 - 1.5 = 0.1487212707
    #                        log r = -.5 -> e^-.5 - .5 = 0.1065306597;  mean 0.1276259652
    # entropy: mean over the two loss tokens of (0.5, 1.5) = 1.0; the masked 99 is ignored
    terms, _ = run_loss([0.5, -0.5, 3.0], [1.0, 1.0, 1.0], mask=[1, 1, 0],
                        entropy=[0.5, 1.5, 99.0])
    m = terms.metrics()
    assert m["kl"] == pytest.approx(0.1276259652, abs=1e-7)
    assert m["entropy"] == pytest.approx(1.0) and m["tokens"] == 2


def test_masked_tokens_contribute_nothing() -> None:
    # token 2 is masked: whatever its logprob (even inf or nan), loss and grads are unchanged
    base, base_grad = run_loss([], [0.5, -1.0, 2.0], mask=[1, 0, 1],
                               logprobs=[-1.1, -0.3, -0.8])
    for masked_value in (-7.0, 0.0, math.inf, math.nan):
        terms, grad = run_loss([], [0.5, -1.0, 2.0], mask=[1, 0, 1],
                               logprobs=[-1.1, masked_value, -0.8])
        assert float(terms.loss.detach()) == float(base.loss.detach())
        assert torch.equal(grad, base_grad) and grad[1] == 0
        assert terms.metrics() == base.metrics()


def test_sample_weights_for_each_normalisation() -> None:
    # samples: A (2 loss tokens, rollout r1), B (1 token, r1), C (4 tokens, r2), D (0 tokens)
    tokens, keys = [2, 1, 4, 0], ["r1", "r1", "r2", "r1"]
    # token mean: 7 tokens -> 1/7 each
    assert sample_weights(tokens, keys, "token_mean") == pytest.approx([1 / 7] * 3 + [0])
    # seq mean over the 3 samples with tokens: 1/(2*3), 1/(1*3), 1/(4*3)
    assert sample_weights(tokens, keys, "seq_mean") == pytest.approx([1 / 6, 1 / 3, 1 / 12, 0])
    # rollout mean over 2 rollouts: r1 has 3 tokens -> 1/(3*2); r2 has 4 -> 1/(4*2)
    assert sample_weights(tokens, keys, "rollout_mean") == pytest.approx(
        [1 / 6, 1 / 6, 1 / 8, 0])


@pytest.mark.parametrize("normalization, expected", [
    # on-policy (r = 1) so J = A per token; A = +1 for samples A, B and -0.5 for C.
    # token mean:   -(3 * 1/7 - 4 * .5/7)          = -(3/7 - 2/7)   = -1/7
    ("token_mean", -1 / 7),
    # seq mean:     -(2/6 + 1/3 - 4 * .5/12)       = -(2/3 - 1/6)   = -1/2
    ("seq_mean", -0.5),
    # rollout mean: -(3 * 1/6 - 4 * .5/8)          = -(1/2 - 1/4)   = -1/4
    ("rollout_mean", -0.25),
])
def test_each_normalisation_in_the_loss(normalization: str, expected: float) -> None:
    tokens, keys, advs = [2, 1, 4], ["r1", "r1", "r2"], [1.0, 1.0, -0.5]
    per_sample = sample_weights(tokens, keys, Normalization(normalization))
    w = [per_sample[i] for i, n in enumerate(tokens) for _ in range(n)]
    a = [advs[i] for i, n in enumerate(tokens) for _ in range(n)]
    terms, _ = run_loss([0.0] * 7, a, weights=w)
    assert float(terms.loss.detach()) == pytest.approx(expected, abs=1e-6)


def test_loss_config_validation() -> None:
    with pytest.raises(ValueError):
        LossConfig(is_cap=0.5)
    with pytest.raises(ValueError):
        LossConfig(eps_low=1.0)
    with pytest.raises(ValueError):
        LossConfig(normalization="mean")
