"""The sharded step (FSDP2 over gloo, two CPU processes) against one process on the same global
batch and seed: loss, gradients and updated weights agree (tolerances of issue #13), for the
three loss normalisations, tied and untied heads, micro-batches by count and by token budget,
and ranks with unequal numbers of micro-batches."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from services.trainer.loss import LossConfig
from services.trainer.sharding import split_by_tokens
from services.trainer.step import StepConfig, make_optimizer, train_step

from test_trainer_step import make_samples, tiny_model

# (normalisation, tied, micro_batch_size, micro_batch_max_tokens, samples)
CASES = [
    ("token_mean", True, 2, None, 6),
    ("seq_mean", False, 8, 40, 6),
    ("rollout_mean", True, 1, None, 7),  # 7 samples, one a pass: 4 passes on one rank, 3
]


ADVANTAGES = [1.0, -0.5, 0.7, -0.2, 0.4, -0.9, 0.3]


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps the whole gradient it stepped with (gathered when sharded)."""

    grads: dict[str, torch.Tensor]
    names: dict[int, str]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        from services.trainer.sharding import full_tensor

        self.grads = {self.names[id(p)]: full_tensor(p.grad).detach().clone()
                      for g in self.param_groups for p in g["params"]}
        return super().step(closure)


def recording_optimizer(model: torch.nn.Module) -> RecordingAdamW:
    base = make_optimizer(model, lr=1e-3)
    opt = RecordingAdamW(base.param_groups[0]["params"], lr=1e-3)
    opt.names = {id(p): n for n, p in model.named_parameters()}
    return opt


def run_case(case: tuple, rank_samples: Any = None, dist: Any = None) -> dict[str, Any]:
    normalization, tied, size, max_tokens, n = case
    model = tiny_model(seed=3, tied=tied)
    samples = make_samples(model, seed=4, n=n)
    for s, a in zip(samples, ADVANTAGES):  # unbalanced: the on-policy loss is far from 0
        s.advantage = a
    cfg = StepConfig(loss=LossConfig(normalization=normalization), micro_batch_size=size,
                     micro_batch_max_tokens=max_tokens)
    if dist is not None:
        from services.trainer.sharding import shard_model

        shard_model(model, dist)
        part = split_by_tokens([len(s) for s in samples], dist.world_size)[dist.rank]
        samples = [samples[i] for i in part]
    opt = recording_optimizer(model)
    m = train_step(model, opt, samples, cfg, dist)
    from services.trainer.sharding import full_tensor

    weights = {k: full_tensor(p.detach()).clone() for k, p in model.named_parameters()}
    return {"loss": m.loss, "grad_norm": m.grad_norm, "tokens": m.tokens, "kl": m.kl,
            "entropy": m.entropy, "samples": m.samples, "passes": m.micro_batches,
            "grads": opt.grads, "weights": weights}


def _rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from services.trainer.sharding import close_distributed, init_distributed

    d = init_distributed("cpu", timeout_s=120)
    try:
        results = [run_case(case, dist=d) for case in CASES]
        if d.is_main:
            torch.save(results, Path(out) / "ws2.pt")
    finally:
        close_distributed()


def test_split_by_tokens_balances_and_is_deterministic() -> None:
    lengths = [25, 22, 17, 15, 15, 14, 3]
    parts = split_by_tokens(lengths, 2)
    assert parts == split_by_tokens(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(7))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= max(lengths)
    assert loads == [25 + 15 + 14 + 3, 22 + 17 + 15]  # longest first, to the lighter rank
    assert split_by_tokens([5], 3) == [[0], [], []]


def test_world_size_2_step_equals_one_process(tmp_path: Path) -> None:
    """~15 s on 2 cores (two spawned ranks)."""
    from harnessrl.procs import free_port

    torch.set_num_threads(1)
    ref = [run_case(case) for case in CASES]
    mp.start_processes(_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    got = torch.load(tmp_path / "ws2.pt", weights_only=False)
    for case, r, g in zip(CASES, ref, got):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-6), case
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), case
        assert (g["tokens"], g["samples"]) == (r["tokens"], r["samples"]), case
        assert g["kl"] == pytest.approx(r["kl"], abs=1e-9)
        assert g["entropy"] == pytest.approx(r["entropy"], rel=1e-6)
        assert g["grads"].keys() == r["grads"].keys()
        for k in r["grads"]:
            torch.testing.assert_close(g["grads"][k], r["grads"][k], rtol=1e-4, atol=1e-7,
                                       msg=lambda m, k=k: f"{case} grad {k}: {m}")
        moved = 0
        for k in r["weights"]:
            torch.testing.assert_close(g["weights"][k], r["weights"][k], rtol=0, atol=1e-4,
                                       msg=lambda m, k=k: f"{case} weight {k}: {m}")
            moved += int(not torch.equal(g["weights"][k], tiny_weights(case)[k]))
        assert moved == len(r["weights"]), "the sharded step left weights unchanged"
    assert got[2]["passes"] == 4  # the rank with 3 samples ran an empty pass in step


def tiny_weights(case: tuple) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in
            copy.deepcopy(tiny_model(seed=3, tied=case[1])).named_parameters()}
