"""Adapter training (services/trainer/lora.py) on the project's tiny model: the wrapped model
trains its LoRA parameters only; its adapter folder is peft's own format; the zero adapter
serves the base exactly; merged and adapted models agree; checkpoints hold the adapter and
resume it exactly through the real loop (the test doubles of tests/test_checkpoint.py); the
sharded trainer (FSDP2 over gloo, two CPU processes) writes the same adapter and checkpoints
it; and `harnessrl export` writes both kinds of output."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from harnessrl.clients import StoreClient
from harnessrl.lora_adapters import merge_adapter
from services.trainer import checkpoint as ckpt
from services.trainer import lora
from services.trainer.config import TrainerConfig
from services.trainer.lora import LoraConfig
from services.trainer.loop import Trainer, train_sync
from services.trainer.step import StepConfig, make_optimizer, token_logprobs, train_step

from test_checkpoint import make_config, store, trainer  # noqa: F401 - fixtures
from test_trainer_step import make_samples

class RecordingAdapters:
    """Test double of `AdapterWeights` (the LoRA engines): records each version's folder as
    `push_model` hands it over (version, tensors as written)."""

    def __init__(self) -> None:
        self.loads: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.version = 0  # the version the fake runs' calls are recorded with

    def push(self, model: Any, version: int) -> None:
        raise AssertionError("LoRA pushes go through load()")

    def load(self, path: Path, version: int) -> None:
        from safetensors.torch import load_file

        self.loads.append((version, load_file(str(path / "adapter_model.safetensors"))))
        self.version = version

    def close(self) -> None:
        pass


TINY_FRACTION = (47_104, 755_840)  # rank 8 on the 7 projections of 2 layers, of all params


def load(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def adapted(model_dir: Path, seed: int = 0, cfg: LoraConfig | None = None,
            randomise_b: bool = False) -> Any:
    torch.manual_seed(seed)
    model = lora.apply_lora(load(model_dir), cfg or LoraConfig())
    if randomise_b:  # B starts at zero: a nonzero one makes the adapter do something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0.0, 0.02)
    return model


def lora_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids, use_cache=False).logits


IDS = torch.tensor([[5, 17, 300, 42, 8, 99, 1000, 3, 64, 12], [7, 7, 250, 31, 900, 4, 5, 6, 8, 2]])


def test_base_frozen_trainable_fraction_and_a_step_changes_only_lora(
        tiny_model_dir: Path) -> None:
    model = adapted(tiny_model_dir)
    assert lora.trainable_fraction(model) == TINY_FRACTION  # 6.2%
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    assert lora.base_model_path(model) == str(tiny_model_dir.resolve())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_optimizer(model, lr=1e-2)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable)
    train_step(model, opt, make_samples(model, seed=2, n=4), StepConfig())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    assert any("lora_B" in n for n in changed)  # B moved off zero
    assert len(opt.state) == len(trainable)  # AdamW state for the LoRA parameters only


def test_targets_must_be_linear_layers_and_sleep_is_refused(tiny_model_dir: Path) -> None:
    for name in ("lm_head", "embed_tokens", "model.embed_tokens"):
        with pytest.raises(ValueError, match="embedding or the output head"):
            LoraConfig(target_modules=[name])
    with pytest.raises(ValueError, match="modules_to_save is not supported"):
        LoraConfig.model_validate({"modules_to_save": ["lm_head"]})
    with pytest.raises(ValueError, match="not linear layers"):
        lora.apply_lora(load(tiny_model_dir), LoraConfig(target_modules=["mlp"]))
    with pytest.raises(ValueError, match=r"match no module .* its linear layers"):
        lora.apply_lora(load(tiny_model_dir), LoraConfig(target_modules=["q_prj"]))
    common: dict[str, Any] = {"harness_command": ["x"], "grader_command": ["y"]}
    with pytest.raises(ValueError, match="lora with mode.sleep_level > 0 is refused"):
        TrainerConfig(lora={}, mode={"kind": "collocated", "sleep_level": 1}, **common)
    assert TrainerConfig(lora={}, mode="collocated", **common).lora == LoraConfig()
    cfg = TrainerConfig.load(["--lora.rank", "4", "--harness-command", '["x"]',
                              "--grader-command", '["y"]'])
    assert cfg.lora is not None and cfg.lora.rank == 4
    assert cfg.lora.adapter_dirs("/out") == (Path("/out/adapters"), Path("/out/adapters"))


def test_save_adapter_is_peft_format_and_round_trips(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    model = adapted(tiny_model_dir, randomise_b=True)
    lora.save_adapter(model, tmp_path / "v1")
    assert sorted(os.listdir(tmp_path)) == ["v1"]  # no temporary folder left
    files = sorted(os.listdir(tmp_path / "v1"))
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "v1" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == \
        ("LORA", 8, 16, "none")
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    tensors = load_file(str(tmp_path / "v1" / "adapter_model.safetensors"))
    assert len(tensors) == 28
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors)

    loaded = PeftModel.from_pretrained(load(tiny_model_dir), str(tmp_path / "v1"))
    mine, theirs = lora_params(model), lora_params(loaded)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(logits(model, IDS), logits(loaded, IDS))
    lora.save_adapter(model, tmp_path / "v1")  # again at the same path: replaced whole
    assert sorted(os.listdir(tmp_path)) == ["v1"]


def test_zero_adapter_gives_the_base_logits_exactly(tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    out = lora.write_zero_adapter(tiny_model_dir, LoraConfig(), tmp_path / "zero")
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 28 and all(not t.any() for t in tensors.values())
    served = PeftModel.from_pretrained(load(tiny_model_dir), str(out))
    assert torch.equal(logits(served, IDS), logits(load(tiny_model_dir), IDS))


def test_zero_adapter_command_writes_what_the_deploy_files_serve(tmp_path: Path) -> None:
    """`python -m services.trainer.lora zero-adapter` (docker-compose.lora.yml and
    k8s/components/lora run it before the engine): a zero PEFT adapter of the given rank for the
    model's config (no weights needed); a folder without a config is refused, clearly."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file
    from transformers import Qwen3Config

    model = tmp_path / "model"
    Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16).save_pretrained(model)
    cmd = [sys.executable, "-m", "services.trainer.lora", "zero-adapter", "--model", str(model),
           "--rank", "4", "--out", str(tmp_path / "adapters" / "zero")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = Path(json.loads(p.stdout.splitlines()[-1])["zero_adapter"])
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 14 and all(not t.any() for t in tensors.values())  # 7 pairs, 1 layer
    assert sorted(p.name for p in out.parent.iterdir()) == ["zero"]  # no temporary left
    bad = subprocess.run([*cmd[:5], str(tmp_path / "nothing"), *cmd[6:]], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "no config.json" in bad.stderr


def test_merge_parity_and_peft_logprobs_equal_the_merged_models(tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    """The loss's logprobs come from the PeftModel's forward: they must be the merged model's
    (what an engine serving the merged weights, or the adapter, computes)."""
    model = adapted(tiny_model_dir)
    opt = make_optimizer(model, lr=2e-2)
    for seed in (2, 3):  # a trained adapter, not a random one
        train_step(model, opt, make_samples(model, seed=seed, n=4), StepConfig())
    lora.save_adapter(model, tmp_path / "adapter")
    merged_dir = merge_adapter(tiny_model_dir, tmp_path / "adapter", tmp_path / "merged")
    merged = load(merged_dir)
    assert not any("lora" in k for k in merged.state_dict())
    assert merged.config.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(merged_dir).encode("hi") == \
        AutoTokenizer.from_pretrained(tiny_model_dir).encode("hi")
    a, b = logits(model, IDS), logits(merged, IDS)
    assert (a - b).abs().max().item() < 1e-5
    lp_a, _ = token_logprobs(a[:, :-1], IDS[:, 1:], with_entropy=False)
    lp_b, _ = token_logprobs(b[:, :-1], IDS[:, 1:], with_entropy=False)
    assert (lp_a - lp_b).abs().max().item() < 1e-5
    assert (a - logits(load(tiny_model_dir), IDS)).abs().max().item() > 1e-4  # it trained


def lora_config(tmp: Path, name: str, model: Path, steps: int, **kw: Any) -> TrainerConfig:
    return make_config(tmp, name, model, steps, lora={"rank": 4, "alpha": 8}, **kw)


def vocab_of(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def test_checkpoint_holds_the_adapter_and_resume_is_exact(
        tmp_path: Path, tiny_model_dir: Path, store: StoreClient) -> None:
    """Three steps uninterrupted against two, then a new trainer on the same output dir that
    resumes from the step-2 checkpoint: LoRA tensors and optimizer state identical."""
    vocab = vocab_of(tiny_model_dir)
    ref, _ = trainer(lora_config(tmp_path, "ref", tiny_model_dir, 3), store, RecordingAdapters(),
                     vocab)
    train_sync(ref)
    first, _ = trainer(lora_config(tmp_path, "res", tiny_model_dir, 2), store, RecordingAdapters(),
                       vocab)
    train_sync(first)
    saved = ckpt.latest_checkpoint(first.cfg.checkpoints_dir)
    assert saved is not None and saved.name == "step-000002"
    names = set(os.listdir(saved))
    assert {"adapter", "trainer_state.pt", "state.json", "tokenizer.json"} <= names
    assert "model.safetensors" not in names and "config.json" not in names  # no full model
    assert (saved / "adapter" / "adapter_model.safetensors").exists()
    assert ckpt.read_state(saved).step == 2
    state = json.loads((saved / "state.json").read_text())
    assert state["base_model"] == str(tiny_model_dir.resolve())
    blob = torch.load(saved / ckpt.TRAINER_STATE_FILE, weights_only=True)
    assert len(blob["optimizer"]["state"]) == 2 * 7 * 2  # the LoRA parameters' AdamW state

    second, runs = trainer(lora_config(tmp_path, "res", tiny_model_dir, 3), store,
                           RecordingAdapters(), vocab)
    from safetensors.torch import load_file

    sink = second.weights
    second.start()  # resumed: the adapter and optimizer of step 2, pushed again
    assert isinstance(sink, RecordingAdapters) and [v for v, _ in sink.loads] == [2]
    written = load_file(str(saved / "adapter" / "adapter_model.safetensors"))
    assert sink.loads[0][1].keys() == written.keys()
    assert all(torch.equal(sink.loads[0][1][k], written[k]) for k in written)
    resumed = lora_params(second.model)
    assert resumed.keys() == lora_params(first.model).keys()
    assert all(torch.equal(resumed[k], v) for k, v in lora_params(first.model).items())
    assert_same_optimizer(second.optimizer, first.optimizer)
    second.close()
    third, runs = trainer(lora_config(tmp_path, "res", tiny_model_dir, 3), store,
                          RecordingAdapters(), vocab)
    train_sync(third)
    assert third.state.step == 3 and runs.launched == [f"{third.state.run_prefix}-step000003"]
    final, want = lora_params(third.model), lora_params(ref.model)
    assert all(torch.equal(final[k], want[k]) for k in want)  # bit for bit
    assert_same_optimizer(third.optimizer, ref.optimizer)
    base = {n: p for n, p in third.model.named_parameters() if "lora_" not in n}
    initial = dict(lora.apply_lora(load(tiny_model_dir), LoraConfig()).named_parameters())
    assert all(torch.equal(p, initial[n]) for n, p in base.items())  # the base never moved


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        assert all(torch.equal(torch.as_tensor(sa[k][f]), torch.as_tensor(sb[k][f]))
                   for f in sa[k])


def test_resume_refuses_another_base_or_kind(tmp_path: Path, tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = lora_config(tmp_path, "run", tiny_model_dir, 3)
    lora_model = lora.apply_lora(load(tiny_model_dir), cfg.lora)  # type: ignore[arg-type]
    ckpt.save_checkpoint(cfg.checkpoints_dir, lora_model, tok, make_optimizer(lora_model),
                         ckpt.TrainState(step=1))
    other = tmp_path / "other-base"
    shutil.copytree(tiny_model_dir, other)
    with pytest.raises(RuntimeError, match="holds an adapter of the base model"):
        Trainer(lora_config(tmp_path, "run", other, 3), None, None, RecordingAdapters()).start()
    with pytest.raises(RuntimeError, match="is a LoRA adapter checkpoint"):
        Trainer(make_config(tmp_path, "run", tiny_model_dir, 3), None, None,
                RecordingAdapters()).start()
    with pytest.raises(RuntimeError, match=r"its adapter is \(rank, alpha, targets\)"):
        Trainer(make_config(tmp_path, "run", tiny_model_dir, 3, lora={}), None, None,
                RecordingAdapters()).start()
    full = make_config(tmp_path, "full", tiny_model_dir, 3)
    plain = load(tiny_model_dir)
    ckpt.save_checkpoint(full.checkpoints_dir, plain, tok, make_optimizer(plain),
                         ckpt.TrainState(step=1))
    with pytest.raises(RuntimeError, match="full fine-tuning checkpoint"):
        Trainer(lora_config(tmp_path, "full", tiny_model_dir, 3), None, None,
                RecordingAdapters()).start()


def test_export_adapter_and_merged(tmp_path: Path, tiny_model_dir: Path) -> None:
    from peft import PeftModel

    from harnessrl.local.cli import main

    model = adapted(tiny_model_dir, randomise_b=True)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    root = tmp_path / "run" / "checkpoints"
    ckpt.save_checkpoint(root, model, tok, make_optimizer(model), ckpt.TrainState(step=7))
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 0
    assert sorted(os.listdir(tmp_path / "adapter")) == \
        ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    served = PeftModel.from_pretrained(load(tiny_model_dir), str(tmp_path / "adapter"))
    want = logits(model, IDS)
    assert torch.equal(logits(served, IDS), want)

    step = root / "step-000007"
    assert main(["export", str(step), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = load(tmp_path / "merged")
    # float32: merging B @ A into W rounds differently from adding them per call (1.2e-5 seen)
    assert (logits(merged, IDS) - want).abs().max().item() < 3e-5
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").encode("2+2") == tok.encode("2+2")
    assert main(["export", str(step), "--out", str(tmp_path / "merged")]) == 1  # not empty

    plain = load(tiny_model_dir)
    full_root = tmp_path / "full" / "checkpoints"
    ckpt.save_checkpoint(full_root, plain, tok, make_optimizer(plain), ckpt.TrainState(step=2))
    assert main(["export", str(full_root), "--out", str(tmp_path / "hf"), "--merge"]) == 0
    names = set(os.listdir(tmp_path / "hf"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not names & {"state.json", "trainer_state.pt"}
    assert torch.equal(logits(load(tmp_path / "hf"), IDS), logits(plain, IDS))


# -- sharded: FSDP2 over gloo, two CPU processes ---------------------------------------------

def full_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer
                         ) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state by parameter name, full tensors (sharded: a collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from services.trainer.sharding import full_tensor

    state = get_optimizer_state_dict(model, opt)["state"]
    return {k: {f: full_tensor(v).clone() for f, v in sorted(state[k].items())}
            for k in sorted(state)}


def _rank_main(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from services.trainer.sharding import close_distributed, init_distributed, shard_model

    d = init_distributed("cpu", timeout_s=120)
    try:
        out_dir, base = Path(out), Path(model_dir)
        model = shard_model(adapted(base, randomise_b=True), d)
        lora.save_adapter(model, out_dir / "sharded-adapter", d)
        opt = make_optimizer(model, lr=1e-2)
        train_step(model, opt, make_samples(model, seed=2, n=4)[rank::2], StepConfig(), d)
        ckpt.save_sharded_checkpoint(out_dir / "ckpts", model, AutoTokenizer.from_pretrained(
            base), opt, ckpt.TrainState(step=1), d)
        trained = lora.adapter_tensors(model, d)
        # a fresh sharded trainer resumes the sharded checkpoint
        found = ckpt.latest_checkpoint(out_dir / "ckpts")
        assert found is not None
        again = shard_model(lora.apply_lora(load(base), LoraConfig(), found), d)
        opt2 = make_optimizer(again, lr=1e-2)
        ckpt.load_trainer_state(found, opt2, again, d)
        resumed = lora.adapter_tensors(again, d)
        osd = [full_optimizer_state(m, o) for m, o in ((model, opt), (again, opt2))]
        # a world-size-1 checkpoint resumed sharded: the adapter, then the optimizer's state
        one = ckpt.latest_checkpoint(out_dir / "ws1")
        assert one is not None
        grown = shard_model(lora.apply_lora(load(base), LoraConfig(), one), d)
        opt3 = make_optimizer(grown, lr=1e-2)
        ckpt.load_trainer_state(one, opt3, grown, d)
        grown_lora, grown_osd = lora.adapter_tensors(grown, d), full_optimizer_state(grown, opt3)
        if d.is_main:
            torch.save({"trained": trained, "resumed": resumed, "osd": osd,
                        "grown": grown_lora, "grown_osd": grown_osd}, out_dir / "ranks.pt")
    finally:
        close_distributed()


def test_sharded_save_adapter_and_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two ranks: the adapter gathered from the shards is the unsharded one bit for bit; a
    sharded checkpoint (dcp/ of the LoRA parameters, adapter/) resumes at world size 2 and at
    world size 1 with the same adapter and optimizer state."""
    from safetensors.torch import load_file

    from harnessrl.procs import free_port

    torch.set_num_threads(1)
    lora.save_adapter(adapted(tiny_model_dir, randomise_b=True), tmp_path / "plain-adapter")
    one = adapted(tiny_model_dir, randomise_b=True)  # a world-size-1 checkpoint of one step
    one_opt = make_optimizer(one, lr=1e-2)
    train_step(one, one_opt, make_samples(one, seed=2, n=4), StepConfig())
    ckpt.save_checkpoint(tmp_path / "ws1", one, AutoTokenizer.from_pretrained(tiny_model_dir),
                         one_opt, ckpt.TrainState(step=1))
    mp.start_processes(_rank_main, args=(2, free_port(), str(tiny_model_dir), str(tmp_path)),
                       nprocs=2, start_method="spawn", join=True)
    plain = load_file(str(tmp_path / "plain-adapter" / "adapter_model.safetensors"))
    sharded = load_file(str(tmp_path / "sharded-adapter" / "adapter_model.safetensors"))
    assert plain.keys() == sharded.keys() and all(torch.equal(plain[k], sharded[k])
                                                  for k in plain)
    configs = [json.loads((tmp_path / f / "adapter_config.json").read_text())
               for f in ("plain-adapter", "sharded-adapter")]
    for c in configs:  # peft keeps them as a set: written in the process's hash order
        c["target_modules"] = sorted(c["target_modules"])
    assert configs[0] == configs[1]

    got = torch.load(tmp_path / "ranks.pt", weights_only=False)
    assert got["trained"].keys() == got["resumed"].keys() and got["trained"]
    assert all(torch.equal(got["trained"][k], got["resumed"][k]) for k in got["trained"])
    assert_same_state(got["osd"][0], got["osd"][1])
    assert len(got["osd"][0]) == 2 * 7 * 2
    mine = lora_params(one)
    assert got["grown"].keys() == mine.keys()
    assert all(torch.equal(got["grown"][k], mine[k]) for k in mine)
    assert_same_state(got["grown_osd"], full_optimizer_state(one, one_opt))
    found = ckpt.latest_checkpoint(tmp_path / "ckpts")
    assert found is not None and (found / ckpt.DCP_DIR).is_dir()
    assert not (found / "model.safetensors").exists()
    # at world size 1: the adapter from adapter/, the optimizer from dcp/
    model = lora.apply_lora(load(tiny_model_dir), LoraConfig(), found)
    opt = make_optimizer(model, lr=1e-2)
    ckpt.load_trainer_state(found, opt, model)
    mine = lora_params(model)
    assert all(torch.equal(mine[k], got["trained"][k]) for k in got["trained"])
    assert_same_state(full_optimizer_state(model, opt), got["osd"][0])
    assert len(opt.state) == 2 * 7 * 2 and all(float(s["step"]) == 1.0
                                               for s in opt.state.values())


def assert_same_state(a: dict[str, dict[str, torch.Tensor]],
                      b: dict[str, dict[str, torch.Tensor]]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].keys() == b[k].keys()
        assert all(torch.equal(a[k][f], b[k][f]) for f in a[k]), k
