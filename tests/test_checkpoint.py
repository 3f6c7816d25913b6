"""Checkpoints, resume and acknowledgement, through the real training loop (`train_sync`) against
a real store process on a real Redis — without vLLM: the step's groups are written into the
store by `StoreRuns` (a test double of the controller: fixed, deterministic recorded calls) and
the weights go to `RecordingSink` (a test double of the engines: it records each push)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.trainer import checkpoint as ckpt
from services.trainer.config import TrainerConfig
from services.trainer.control import TrainerControl
from services.trainer.loop import Trainer, train_sync
from services.trainer.rollouts import step_tasks

GROUP_SIZE = 4
TASKS_PER_STEP = 3


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny model recipe without warm-up (random weights, real tokenizer)."""
    from harnessrl.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", warmup_steps=0)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class RecordingSink:
    """Test double of `EngineWeights` (the engines): records (version, weights digest) of each
    push and can fail a given version's push once, as a crashed engine push would."""

    def __init__(self, fail_version: int | None = None) -> None:
        self.version = 0
        self.pushes: list[tuple[int, str]] = []
        self.fail_version = fail_version

    def push(self, model: torch.nn.Module, version: int) -> None:
        if version == self.fail_version:
            self.fail_version = None
            raise RuntimeError(f"simulated crash while pushing version {version}")
        self.pushes.append((version, digest(model)))
        self.version = version

    def close(self) -> None:
        pass


class StoreRuns:
    """Test double of `ControllerRuns`: "runs" a step by writing its groups into the real store
    the way the controller and the gateway would (rollouts, attempts, two recorded calls per
    rollout of which the second extends the first, rewards). The data depend only on (task,
    index in group), never on the run id, so two trainers get identical batches. Idempotent on
    the run id, as CreateRun is."""

    def __init__(self, store: StoreClient, sink: RecordingSink, vocab: int) -> None:
        self.store, self.sink, self.vocab = store, sink, vocab
        self.launched: list[str] = []

    def run(self, run_id: str, spec: c.RunSpec) -> c.Run:
        self.launched.append(run_id)
        try:
            return self.store.get_run(run_id)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        rollouts = []
        for task in spec.tasks:
            gid = f"{run_id}.{task.task_id}"
            rollouts += [c.Rollout(rollout_id=f"{gid}.{i}", run_id=run_id, task_id=task.task_id,
                                   group_id=gid, index_in_group=i, group_size=spec.group_size,
                                   max_attempts=1, task_json=task.data_json, stream=spec.stream)
                         for i in range(spec.group_size)]
        self.store.create_rollouts(rollouts)
        for ro in rollouts:
            rng = random.Random(f"{ro.task_id}:{ro.index_in_group}")
            self.store.start_attempt(ro.rollout_id, 1)
            prompt = [rng.randrange(3, self.vocab) for _ in range(10)]
            out1 = [rng.randrange(3, self.vocab) for _ in range(6)]
            tool = [rng.randrange(3, self.vocab) for _ in range(3)]
            out2 = [rng.randrange(3, self.vocab) for _ in range(5)]
            calls = [(prompt, out1), (prompt + out1 + tool, out2)]
            self.store.append_calls([
                c.Call(rollout_id=ro.rollout_id, attempt=1, seq=k, prompt_token_ids=p,
                       completion_token_ids=o, logprobs=[-rng.uniform(5.0, 8.0) for _ in o],
                       policy_version=self.sink.version, engine="e0", api="chat.completions")
                for k, (p, o) in enumerate(calls)])
            self.store.finish_attempt(spb.FinishAttemptRequest(
                rollout_id=ro.rollout_id, attempt=1, status=c.ROLLOUT_STATUS_SUCCEEDED,
                reward=float(rng.random() < 0.5)))
        run = c.Run(run_id=run_id, spec=spec, status=c.RUN_STATUS_SUCCEEDED,
                    num_rollouts=len(rollouts), num_succeeded=len(rollouts))
        return self.store.put_run(run)


class CrashOnAck(StoreClient):
    """The real store client, except that its `n`-th non-empty acknowledgement raises before
    reaching the store (a trainer crashing between its checkpoint and the ack)."""

    def __init__(self, inner: StoreClient, n: int) -> None:
        super().__init__(inner.channel, inner.timeout)
        self.n = n

    def ack_groups(self, entry_ids: Any, stream: str = "train",
                   consumer_group: str = "trainer") -> spb.AckGroupsResponse:
        ids = list(entry_ids)
        if ids:
            self.n -= 1
            if self.n == 0:
                raise RuntimeError("simulated crash before the acknowledgement")
        return super().ack_groups(ids, stream, consumer_group)


def make_config(tmp: Path, name: str, model: Path, steps: int, **kw: Any) -> TrainerConfig:
    tasks = tmp / "tasks.jsonl"
    if not tasks.exists():
        tasks.write_text("".join(json.dumps({"id": f"task-{i}", "q": i}) + "\n"
                                 for i in range(6)))
    return TrainerConfig(
        model_path=str(model), output_dir=str(tmp / name), steps=steps, seed=3,
        tasks_file=str(tasks), tasks_per_step=TASKS_PER_STEP, group_size=GROUP_SIZE,
        harness_command=["/bin/true"], grader_command=["/bin/true"], stream=f"s-{name}",
        optimizer={"lr": 3e-3, "micro_batch_size": 5}, **kw)


def trainer(cfg: TrainerConfig, store: StoreClient, sink: RecordingSink, vocab: int,
            control: TrainerControl | None = None) -> tuple[Trainer, StoreRuns]:
    runs = StoreRuns(store, sink, vocab)
    return Trainer(cfg, runs, store, sink, control), runs


def pending(redis_url: str, key_prefix: str, stream: str) -> set[str]:
    r = redis.Redis.from_url(redis_url)
    rows = r.xpending_range(f"{key_prefix}stream:{stream}", "trainer", min="-", max="+",
                            count=1000)
    return {row["message_id"].decode() for row in rows}


@pytest.fixture
def store(store_service) -> StoreClient:  # type: ignore[no-untyped-def]
    client = StoreClient.connect(store_service.address, timeout=10)
    yield client
    client.close()


@pytest.fixture
def vocab(small_model: Path) -> int:
    return int(json.loads((small_model / "config.json").read_text())["vocab_size"])


def reference(tmp_path: Path, small_model: Path, store: StoreClient, vocab: int,
              steps: int) -> Trainer:
    """An uninterrupted run of `steps` steps."""
    t, _ = trainer(make_config(tmp_path, "ref", small_model, steps), store, RecordingSink(),
                   vocab)
    train_sync(t)
    return t


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"parameters differ: {different[:5]}"


def test_resume_after_stop_equals_uninterrupted_run_bit_for_bit(
        tmp_path: Path, small_model: Path, store: StoreClient, vocab: int, redis_url: str,
        key_prefix: str) -> None:
    ref = reference(tmp_path, small_model, store, vocab, steps=3)
    initial = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32)
    assert digest(ref.model) != digest(initial), "training did not change the weights"
    assert ref.state.policy_version == 3

    # Stop (as the gRPC Stop does) while step 2 runs: the loop stops after step 2, checkpointed.
    cfg = make_config(tmp_path, "resumed", small_model, steps=3)
    control = TrainerControl()
    sink = RecordingSink()
    first, runs = trainer(cfg, store, sink, vocab, control)
    launch = runs.run

    def stop_during_step_2(run_id: str, spec: c.RunSpec) -> c.Run:
        if run_id.endswith("step000002"):
            control.request_stop()
        return launch(run_id, spec)

    runs.run = stop_during_step_2  # type: ignore[method-assign]
    train_sync(first)
    assert first.state.step == 2 and first.state.policy_version == 2
    saved = ckpt.latest_checkpoint(cfg.checkpoints_dir)
    assert saved is not None and saved.name == "step-000002"
    assert pending(redis_url, key_prefix, cfg.stream) == set(), "checkpointed groups not acked"

    second, runs2 = trainer(cfg, store, sink, vocab)  # a new process's trainer, same output
    train_sync(second)
    assert second.state.step == 3
    assert runs2.launched == [f"{second.state.run_prefix}-step000003"]
    assert_same_params(second.model, ref.model)
    # on resume the engines got the checkpoint's weights as its version, then version 3
    assert [v for v, _ in sink.pushes] == [0, 1, 2, 2, 3]
    assert sink.pushes[3] == sink.pushes[2]
    rows = [json.loads(x) for x in cfg.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["trained"] and r["tokens"] > 0 and r["reward_mean"] is not None for r in rows)
    assert [r["policy_version"] for r in rows] == [1, 2, 3]


def test_crash_before_checkpoint_redelivers_and_trains_once(
        tmp_path: Path, small_model: Path, store: StoreClient, vocab: int, redis_url: str,
        key_prefix: str) -> None:
    ref = reference(tmp_path, small_model, store, vocab, steps=3)
    cfg = make_config(tmp_path, "crash", small_model, steps=3)
    crashing = RecordingSink(fail_version=3)  # step 3 trains, then the push "crashes"
    first, _ = trainer(cfg, store, crashing, vocab)
    with pytest.raises(RuntimeError, match="simulated crash while pushing version 3"):
        train_sync(first)
    assert ckpt.read_state(ckpt.latest_checkpoint(cfg.checkpoints_dir)).step == 2
    in_flight = pending(redis_url, key_prefix, cfg.stream)
    assert len(in_flight) == TASKS_PER_STEP, "step 3's groups should be pending, unacked"

    second, runs2 = trainer(cfg, store, RecordingSink(), vocab)
    train_sync(second)
    assert runs2.launched == [f"{second.state.run_prefix}-step000003"]  # re-attached
    assert_same_params(second.model, ref.model)  # trained once: twice would differ
    final = json.loads((ckpt.latest_checkpoint(cfg.checkpoints_dir) / "state.json").read_text())
    assert final["step"] == 3 and set(final["consumed_entries"]) == in_flight
    assert pending(redis_url, key_prefix, cfg.stream) == set()
    rows = [json.loads(x) for x in cfg.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_crash_after_checkpoint_before_ack_acks_on_resume_without_training(
        tmp_path: Path, small_model: Path, store: StoreClient, vocab: int, redis_url: str,
        key_prefix: str) -> None:
    ref = reference(tmp_path, small_model, store, vocab, steps=3)
    cfg = make_config(tmp_path, "ackcrash", small_model, steps=3)
    sink = RecordingSink()
    first, _ = trainer(cfg, CrashOnAck(store, n=2), sink, vocab)  # step 2's ack "crashes"
    with pytest.raises(RuntimeError, match="simulated crash before the acknowledgement"):
        train_sync(first)
    saved = ckpt.latest_checkpoint(cfg.checkpoints_dir)
    state = ckpt.read_state(saved)
    assert state.step == 2 and len(state.consumed_entries) == TASKS_PER_STEP
    assert pending(redis_url, key_prefix, cfg.stream) == set(state.consumed_entries)

    second, runs2 = trainer(cfg, store, sink, vocab)
    train_sync(second)
    # step 2 was not run or trained again: only step 3 was launched, and the result is exact
    assert runs2.launched == [f"{second.state.run_prefix}-step000003"]
    assert_same_params(second.model, ref.model)
    assert pending(redis_url, key_prefix, cfg.stream) == set()
    rows = [json.loads(x) for x in cfg.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_checkpoint_loads_in_transformers_keeps_last_k_and_is_atomic(
        tmp_path: Path, small_model: Path, store: StoreClient, vocab: int) -> None:
    cfg = make_config(tmp_path, "keep", small_model, steps=4, keep_checkpoints=2)
    root = cfg.checkpoints_dir
    root.mkdir(parents=True)
    stray = root / ".tmp-step-000009-999999"  # a writer that crashed half-way
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"partial")
    t, _ = trainer(cfg, store, RecordingSink(), vocab)
    train_sync(t)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000003", "step-000004"]
    latest = ckpt.latest_checkpoint(root)
    assert latest == root / "step-000004"
    loaded = AutoModelForCausalLM.from_pretrained(latest, dtype=torch.float32)
    assert_same_params(loaded, t.model)
    tok = AutoTokenizer.from_pretrained(latest)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert loaded.config.tie_word_embeddings
    blob = torch.load(latest / ckpt.TRAINER_STATE_FILE, weights_only=True)
    assert blob["optimizer"]["state"], "optimizer state missing"
    assert {"python", "numpy", "torch"} <= blob["rng"].keys()
    state = json.loads((latest / ckpt.STATE_FILE).read_text())
    assert (state["step"], state["policy_version"]) == (4, 4)


def test_step_tasks_are_deterministic_and_config_sections(tmp_path: Path) -> None:
    tasks = [{"id": f"t{i}"} for i in range(20)]
    a = step_tasks(tasks, seed=1, step=5, k=4)
    assert a == step_tasks(tasks, seed=1, step=5, k=4)
    assert a != step_tasks(tasks, seed=1, step=6, k=4)
    assert len({t["id"] for t in a}) == 4
    for mode in ("sync", "async", "collocated"):
        assert TrainerConfig(mode=mode).mode.kind == mode
    with pytest.raises(ValueError):
        TrainerConfig(mode="bogus")
    # sections from flags, the environment and a file, flags winning
    (tmp_path / "t.yaml").write_text("optimizer: {lr: 0.5, beta1: 0.8}\nmode: {max_staleness: 4}\n")
    cfg = TrainerConfig.load(["--config", str(tmp_path / "t.yaml"), "--optimizer.lr", "0.25",
                              "--mode.kind", "async", "--no-advantage.filter-zero-variance",
                              "--push.attempts", "5"])
    assert (cfg.optimizer.lr, cfg.optimizer.beta1, cfg.mode.kind, cfg.mode.max_staleness,
            cfg.advantage.filter_zero_variance, cfg.push.attempts) == \
        (0.25, 0.8, "async", 4, False, 5)
    with pytest.raises(ValueError):
        TrainerConfig(loss={"is_cap": 0.5})
