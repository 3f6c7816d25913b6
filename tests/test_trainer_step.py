"""One optimizer step on a tiny random Qwen3 model: invariance, direction, determinism."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.trainer.loss import LossConfig
from services.trainer.samples import Sample
from services.trainer.step import (
    StepConfig, make_optimizer, micro_batches, token_logprobs, train_step,
)

VOCAB = 300


def tiny_model(seed: int = 0, tied: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    return Qwen3ForCausalLM(config).float()


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """Logprob of each token given the ones before it (0.0 for the first), in float32."""
    model.eval()
    x = torch.tensor([ids])
    lp, _ = token_logprobs(model(input_ids=x).logits[:, :-1], x[:, 1:], with_entropy=False)
    return [0.0] + lp[0].tolist()


def make_samples(model: torch.nn.Module, seed: int = 1, n: int = 6) -> list[Sample]:
    """Samples shaped like merged agent rollouts: prompt, completion, inserted tool tokens,
    completion; behaviour logprobs from `model` itself (on-policy), two samples per rollout."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        segs = [(rng.randint(3, 8), 0), (rng.randint(2, 6), 1), (rng.randint(1, 4), 0),
                (rng.randint(2, 7), 1)]
        ids, mask = [], []
        for length, m in segs:
            ids += [rng.randrange(VOCAB) for _ in range(length)]
            mask += [m] * length
        lps = sequence_logprobs(model, ids)
        samples.append(Sample(
            input_ids=ids, loss_mask=mask,
            behaviour_logprobs=[lp if m else 0.0 for lp, m in zip(lps, mask)],
            advantage=(1.0 if i % 3 == 0 else -0.5), reward=float(i % 3 == 0),
            rollout_id=f"r{i // 2}",
        ))
    return samples


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_micro_batches_longest_first_within_limits() -> None:
    # lengths 5 3 9 3 1 -> order by length 9(2) 5(0) 3(1) 3(3) 1(4)
    assert micro_batches([5, 3, 9, 3, 1], size=2) == [[2, 0], [1, 3], [4]]
    # at most 10 padded tokens: [9] alone (2 x 9 > 10), then 5 + 3 (2 x 5), 3 + 3 + 1 (3 x 3)
    assert micro_batches([5, 3, 9, 3, 1], size=8, max_tokens=10) == [[2], [0, 1], [3, 4]]


@pytest.mark.parametrize("normalization", ["token_mean", "seq_mean", "rollout_mean"])
def test_result_does_not_depend_on_micro_batch_size(normalization: str) -> None:
    base = tiny_model()
    samples = make_samples(base)
    results = []
    for size, max_tokens in ((1, None), (3, None), (8, None), (8, 40)):
        model = copy.deepcopy(base)
        # SGD: the update is the (clipped) gradient itself, so float noise stays float noise
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = StepConfig(loss=LossConfig(normalization=normalization), micro_batch_size=size,
                         micro_batch_max_tokens=max_tokens, max_grad_norm=1e9)
        metrics = train_step(model, opt, samples, cfg)
        results.append((metrics, params(model)))
    # lengths 15 14 15 22 25 17: 6 passes of 1; 2 of 3; 1 of 6; with 40 padded tokens at most:
    # [25] [22] [17 15] [15 14]
    assert [m.micro_batches for m, _ in results] == [6, 2, 1, 4]
    ref_m, ref_p = results[0]
    for m, p in results[1:]:
        assert m.loss == pytest.approx(ref_m.loss, rel=1e-5, abs=1e-7)
        assert m.grad_norm == pytest.approx(ref_m.grad_norm, rel=1e-5)
        assert m.tokens == ref_m.tokens and m.entropy == pytest.approx(ref_m.entropy, rel=1e-5)
        for k in ref_p:
            torch.testing.assert_close(p[k], ref_p[k], rtol=0, atol=1e-6)
    changed = sum(not torch.equal(ref_p[k], v) for k, v in params(base).items())
    assert changed == len(ref_p)  # the step did move every parameter tensor


def test_on_policy_step_is_the_plain_policy_gradient() -> None:
    # on-policy (behaviour = the model's own logprobs): r = 1, the loss's gradient must equal
    # that of -sum_t w_t * A_t * log pi(t), token mean, computed here directly with autograd
    model = tiny_model()
    samples = make_samples(model)
    ref = copy.deepcopy(model)
    ref.train()
    n_tokens = sum(s.num_loss_tokens for s in samples)
    objective = 0.0
    for s in samples:
        x = torch.tensor([s.input_ids])
        lp, _ = token_logprobs(ref(input_ids=x).logits[:, :-1], x[:, 1:], with_entropy=False)
        m = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
        objective = objective + s.advantage * (lp[0] * m).sum() / n_tokens
    (-objective).backward()
    expected = {k: p.grad.clone() for k, p in ref.named_parameters()}

    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # update = -gradient exactly
    metrics = train_step(model, opt, samples, StepConfig(micro_batch_size=4, max_grad_norm=1e9))
    for k, p in model.named_parameters():
        torch.testing.assert_close(before[k] - p.detach(), expected[k], rtol=1e-4, atol=1e-6)
    assert metrics.kl == pytest.approx(0.0, abs=1e-6) and metrics.clip_frac == 0.0
    assert metrics.tokens == n_tokens and metrics.samples == 6
    assert metrics.input_tokens == sum(len(s) for s in samples)
    assert metrics.entropy > 0 and metrics.step_time_s > 0


def test_gradient_clipping_bounds_the_update() -> None:
    model = tiny_model()
    samples = make_samples(model)
    before = params(model)
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), samples,
                         StepConfig(max_grad_norm=1e-3))
    update = torch.sqrt(sum(((before[k] - p.detach()) ** 2).sum()
                            for k, p in model.named_parameters()))
    assert metrics.grad_norm > 1e-2  # the raw gradient was much larger than the limit
    assert float(update) == pytest.approx(1e-3, rel=1e-4)


def test_a_step_raises_the_logprob_of_positive_advantage_tokens() -> None:
    model = tiny_model()
    samples = make_samples(model)
    opt = make_optimizer(model, lr=1e-2)
    first = train_step(model, opt, samples, StepConfig(micro_batch_size=4))

    def completion_logprob(s: Sample) -> float:
        return sum(lp for lp, m in zip(sequence_logprobs(model, s.input_ids), s.loss_mask) if m)

    after = [completion_logprob(s) for s in samples]
    before = [sum(s.behaviour_logprobs) for s in samples]
    for s, b, a in zip(samples, before, after):
        if s.advantage > 0:
            assert a > b + 0.1, (b, a)
        else:
            assert a < b - 0.1, (b, a)
    # the same batch again, now slightly off-policy: the loss went down
    second = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), samples)
    assert second.loss < first.loss - 0.05
    assert second.kl > 0


def test_masked_behaviour_logprobs_change_nothing() -> None:
    model = tiny_model()
    samples = make_samples(model)
    garbage = [copy.deepcopy(s) for s in samples]
    for s in garbage:
        s.behaviour_logprobs = [lp if m else -123.0 for lp, m in zip(s.behaviour_logprobs,
                                                                      s.loss_mask)]
    out = []
    for batch in (samples, garbage):
        m = copy.deepcopy(model)
        metrics = train_step(m, make_optimizer(m, lr=1e-3), batch)
        out.append((metrics, params(m)))
    assert out[0][0].loss == out[1][0].loss and out[0][0].kl == out[1][0].kl
    assert all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])


@pytest.mark.parametrize("tied", [True, False])
def test_same_seed_same_result_bit_for_bit(tied: bool) -> None:
    runs = []
    for _ in range(2):
        model = tiny_model(seed=3, tied=tied)
        samples = make_samples(model, seed=4)
        opt = make_optimizer(model, lr=1e-3)
        m1 = train_step(model, opt, samples, StepConfig(micro_batch_size=2))
        m2 = train_step(model, opt, samples, StepConfig(micro_batch_size=2))
        runs.append(((m1.loss, m1.grad_norm, m2.loss, m2.grad_norm), params(model)))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_a_batch_without_loss_tokens_is_an_error() -> None:
    model = tiny_model()
    empty = Sample(input_ids=[1, 2, 3], loss_mask=[0, 0, 0], behaviour_logprobs=[0.0] * 3,
                   advantage=1.0, reward=1.0, rollout_id="r")
    with pytest.raises(ValueError, match="at least one loss token"):
        train_step(model, make_optimizer(model), [empty])
