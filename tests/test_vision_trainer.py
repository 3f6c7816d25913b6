"""The trainer learns from images (issue #45 part 3, docs/vision.md "The trainer learns from
images"), with real components: vLLM serving the project's tiny VLM, the real store on the
session's Redis, the real gateway recording calls the official `openai` SDK makes, and the
trainer's own code: `resume.load` (model, processor), `samples.group_samples` with
`pixels.ImagePixels` (images fetched from the store, pixels made by the model's processor),
`step.sample_logprobs` (the loss's logprob recompute), `step.train_step` and
`weights.push_model` into the engine through the gateway.

- The trainer's logprobs of a recorded single-image call and of a two-image multi-turn call
  equal vLLM's recorded ones within the text parity tolerance (1e-3, PARITY_TOL of
  tests/test_weight_transfer.py), each alone and in one padded micro-batch with a text-only
  call (which passes no pixels alone) and a transparent PNG's call (decoded as vLLM does).
- After one optimizer step on those samples and a push, the engine's logprobs have moved, and
  the trainer's recompute of a fresh call matches the engine's again (the vision tower, the
  connector, the text model and the untied lm_head all pushed).
- Refused: other processor settings than the trainer's (or none), and, at start-up, a vision
  model with FSDP2 (nproc > 1) or LoRA. An image the store does not hold drops its rollout with
  the reason; the group trains on the others.

The engine is the session's `vision_engine` (tests/conftest.py: gloo weight transfer on);
`vlm_world` (tests/test_gateway_images.py) puts a store and a gateway in front of it. The push
test pushes the base weights back when it ends, and checks the engine serves them again.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from harnessrl.model.vision import draw_shape
from harnessrl.v1 import common_pb2 as c
from services.trainer.config import TrainerConfig
from services.trainer.pixels import GET_BATCH, GET_BATCH_BYTES, ImagePixels, _batches, \
    pixel_inputs, vision_pixels
from services.trainer.records import StepRecord
from services.trainer.resume import Loaded, load
from services.trainer.samples import GroupSamples, Sample, group_samples
from services.trainer.sharding import Dist
from services.trainer.step import StepConfig, sample_logprobs, train_step
from services.trainer.weights import EngineWeights, push_model
from test_gateway import SIGNER, World
from test_gateway_images import b64, vlm_world  # noqa: F401 - vlm_world: a fixture
from test_weight_transfer import PARITY_TOL

QUESTION = "What colour is the shape?"


def trainer_config(model_dir: Path, out: Path, **kw: Any) -> TrainerConfig:
    return TrainerConfig(model_path=str(model_dir), output_dir=str(out),
                         harness_command=["/bin/true"], grader_command=["/bin/true"], **kw)


@pytest.fixture(scope="module")
def cfg(vision_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerConfig:
    return trainer_config(vision_model_dir, tmp_path_factory.mktemp("trainer"),
                          optimizer={"lr": 1e-2})


@pytest.fixture(scope="module")
def trainer(vlm_world: World, cfg: TrainerConfig) -> Loaded:
    """What the trainer starts from (`resume.load`): the VLM, its processor, the store."""
    return load(cfg, Path(cfg.output_dir), Dist.single(), False, vlm_world.store)


def png(colour: str, shape: str, seed: int, size: int) -> bytes:
    buf = io.BytesIO()
    draw_shape(colour, shape, random.Random(seed), size).save(buf, format="PNG")
    return buf.getvalue()


def transparent_png() -> bytes:
    """An RGBA PNG: a shape on a transparent background whose hidden colour is black (vLLM
    puts transparency on white; a plain RGB conversion would show the black)."""
    drawn = draw_shape("blue", "square", random.Random(4), 64).convert("RGBA")
    grey = drawn.getpixel((0, 0))
    drawn.putdata([(0, 0, 0, 0) if px == grey else px for px in drawn.getdata()])
    buf = io.BytesIO()
    drawn.save(buf, format="PNG")
    return buf.getvalue()


def image(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(data)}"}}


SINGLE = [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                       image(png("red", "triangle", 1, 80))]}]
MULTI = [{"role": "system", "content": "Answer in one word."},
         {"role": "user", "content": [image(png("blue", "circle", 2, 50)),
                                      {"type": "text", "text": QUESTION}]},
         {"role": "assistant", "content": "blue"},
         {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                      image(png("green", "square", 3, 100))]}]
TEXT = [{"role": "user", "content": QUESTION}]
RGBA = [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                     image(transparent_png())]}]


def record(world: World, model: str, messages: list[dict[str, Any]], seed: int) -> c.Rollout:
    """A rollout of one call through the gateway (the `openai` SDK), as the trainer reads it
    from the store. Sampled at temperature 2, so that its tokens are ones the tiny model finds
    unlikely: their logprobs move with the pixels (its likely answers hardly do: it answers a
    two-image question confidently whichever way round the images are)."""
    rid = world.rollout()
    client = world.client(SIGNER.mint(rid, 1, 120), timeout=120)
    client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                   max_tokens=8, temperature=2.0, seed=seed, logprobs=True)
    rollout = world.store.get_rollout(rid, include_calls=True)
    rollout.status, rollout.reward = c.ROLLOUT_STATUS_SUCCEEDED, float(seed % 2)
    rollout.has_reward = True
    return rollout


def samples_of(rollouts: list[c.Rollout], t: Loaded) -> GroupSamples:
    return group_samples(c.Group(group_id="g", rollouts=rollouts), pixels=t.pixels)


def parity(model: torch.nn.Module, samples: list[Sample]) -> float:
    """Largest |trainer - engine| logprob over the samples' loss tokens, the samples in one
    micro-batch (the trainer's recompute, `step.sample_logprobs`)."""
    with torch.no_grad():
        logprobs, _ = sample_logprobs(model, samples, 0, torch.device("cpu"), False)
    worst = 0.0
    for k, s in enumerate(samples):
        mask = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
        engine = torch.tensor(s.behaviour_logprobs[1:])[mask]
        worst = max(worst, float((logprobs[k, :len(mask)][mask] - engine).abs().max()))
    return worst


@pytest.fixture(scope="module")
def recorded(vlm_world: World, vision_engine: Any) -> list[c.Rollout]:
    """A single-image call, a two-image multi-turn call, a text-only call and a call with a
    transparent image, recorded."""
    model = vision_engine.model_name
    return [record(vlm_world, model, m, seed)
            for m, seed in ((SINGLE, 1), (MULTI, 2), (TEXT, 3), (RGBA, 6))]


@pytest.mark.vllm
def test_trainer_logprobs_of_image_calls_equal_the_engines(recorded: list[c.Rollout],
                                                           trainer: Loaded) -> None:
    single = recorded[0]
    assert [len(r.calls[0].images) for r in recorded] == [1, 2, 0, 1]
    got = samples_of(recorded, trainer)
    assert got.skipped is None and not got.dropped_rollouts
    s1, s2, s3, s4 = got.samples
    assert [len(s.images) for s in (s1, s2, s3, s4)] == [1, 2, 0, 1]
    assert s1.pixels is not None and s2.pixels is not None and s3.pixels is None
    assert s2.pixels["pixel_values"].shape[1] == 2
    assert s1.input_ids == list(single.calls[0].prompt_token_ids) + list(
        single.calls[0].completion_token_ids)
    diffs = [parity(trainer.model, [s]) for s in (s1, s2, s3, s4)] + [
        parity(trainer.model, [s1, s2, s3, s4])]  # one micro-batch: images padded, text too
    print(f"VISION-PARITY single, multi, text, transparent, batched: {diffs}")
    assert max(diffs) <= PARITY_TOL, diffs


@pytest.mark.vllm
def test_after_a_step_and_a_push_the_engine_moved_and_parity_holds(
        recorded: list[c.Rollout], trainer: Loaded, cfg: TrainerConfig,
        vlm_world: World, vision_engine: Any) -> None:
    model = trainer.model
    old_model = copy.deepcopy(model)
    train_step(model, trainer.optimizer, samples_of(recorded, trainer).samples,
               StepConfig(micro_batch_size=2))
    moved = {n.split(".")[1] if n.startswith("model.") else n
             for (n, p), q in zip(model.named_parameters(), old_model.parameters(), strict=True)
             if not torch.equal(p, q)}
    assert moved == {"vision_model", "connector", "text_model", "lm_head.weight"}, moved
    try:
        with EngineWeights(vlm_world.admin, cfg.push, attempts=1) as sink:
            report = push_model(model, sink, 1, Dist.single(), cfg, "vt")
        assert report is not None and list(report.engines) == ["vlm"]
        fresh = [record(vlm_world, vision_engine.model_name, m, s)
                 for m, s in ((SINGLE, 4), (MULTI, 5))]
        assert {r.calls[0].policy_version for r in fresh} == {1}
        new = samples_of(fresh, trainer).samples
        after = parity(model, new)
        moved_by = parity(old_model, new)  # the engine's new logprobs against the old weights'
        print(f"VISION-PUSH parity after {after}, engine moved by {moved_by}")
        assert moved_by > 10 * PARITY_TOL, moved_by
        assert after <= PARITY_TOL, after
    finally:  # the base weights again, in the engine (the session's) and in the trainer
        with EngineWeights(vlm_world.admin, cfg.push, attempts=1) as sink:
            push_model(old_model, sink, 2, Dist.single(), cfg, "vt-base")
        model.load_state_dict(old_model.state_dict())
    base = samples_of([record(vlm_world, vision_engine.model_name, m, s)
                       for m, s in ((SINGLE, 7), (MULTI, 8))], trainer).samples
    assert len(base) == 2 and parity(old_model, base) <= PARITY_TOL


@pytest.mark.vllm
def test_other_processor_settings_are_refused(recorded: list[c.Rollout], trainer: Loaded
                                              ) -> None:
    rollout = c.Rollout()
    rollout.CopyFrom(recorded[0])
    settings = json.loads(rollout.calls[0].processor_json)
    settings["files"]["processor_config.json"]["image_processor"]["size"] = {
        "longest_edge": 128}
    rollout.calls[0].processor_json = json.dumps(settings).encode()
    with pytest.raises(ValueError, match="other processor settings than the trainer's"):
        samples_of([rollout, recorded[1]], trainer)
    rollout.calls[0].processor_json = b""
    with pytest.raises(ValueError, match="recorded without processor settings"):
        samples_of([rollout, recorded[1]], trainer)


@pytest.mark.vllm
def test_an_image_the_store_lacks_drops_its_rollout_with_the_reason(
        recorded: list[c.Rollout], trainer: Loaded) -> None:
    lost = c.Rollout()
    lost.CopyFrom(recorded[1])
    lost.rollout_id, lost.reward = "lost/0", 0.5
    never = hashlib.sha256(b"never stored").hexdigest()
    lost.calls[0].images[1].sha256 = never
    group = [*recorded, lost]
    got = samples_of(group, trainer)
    assert got.dropped_rollouts == ["lost/0"]
    assert got.drop_reasons["lost/0"].startswith(f"missing image: call 0's image {never}")
    assert len(got.samples) == 4 and got.rewards == [r.reward for r in recorded]
    step = StepRecord(step=1, behaviour_version=0)
    step.add_samples([c.Group(group_id="g", rollouts=group)], [got], 0, 0)
    assert step.dropped_rollouts == {"lost/0": got.drop_reasons["lost/0"]}


def test_fsdp2_and_lora_with_a_vision_model_are_refused_at_start(
        vision_model_dir: Path, tmp_path: Path) -> None:
    cfg = trainer_config(vision_model_dir, tmp_path / "fsdp", nproc=2)
    with pytest.raises(ValueError, match="a sharded vision model is not implemented"):
        vision_pixels(cfg, vision_model_dir, 2, None)  # as each rank's `load` does
    cfg = trainer_config(vision_model_dir, tmp_path / "lora", lora={"rank": 4})
    with pytest.raises(ValueError, match="LoRA on a vision model is not implemented"):
        load(cfg, tmp_path / "lora", Dist.single(), False, None)


def test_pixel_inputs_pad_images_height_width_and_mask() -> None:
    """A micro-batch's rows: their images padded to the most images, the largest height and
    width, with zeros, the mask false on the padding (the processor's own pixel mask kept);
    a row without images all padding; no row with images: nothing passed."""
    def row(n: int, h: int, w: int, hole: bool = False) -> Sample:
        mask = torch.ones((1, n, h, w), dtype=torch.bool)
        if hole:
            mask[0, 0, 0, 0] = False
        return Sample(input_ids=[1], loss_mask=[0], behaviour_logprobs=[0.0], advantage=0.0,
                      reward=0.0, rollout_id="r", pixels={"pixel_values": torch.full((1, n, 3, h, w), 0.5),
                              "pixel_attention_mask": mask})
    text = Sample(input_ids=[1], loss_mask=[0], behaviour_logprobs=[0.0], advantage=0.0,
                  reward=0.0, rollout_id="t")
    got = pixel_inputs([row(1, 4, 6, hole=True), text, row(2, 5, 3)], torch.device("cpu"))
    values, mask = got["pixel_values"], got["pixel_attention_mask"]
    assert values.shape == (3, 2, 3, 5, 6) and mask.shape == (3, 2, 5, 6)
    assert mask[0, 0, :4, :6].sum() == 4 * 6 - 1 and not mask[0, 0, 4:].any()
    assert not mask[0, 1].any() and not mask[1].any() and not values[1].any()
    assert mask[2, :, :5, :3].all() and not mask[2, :, :, 3:].any()
    assert (values[2, :, :, :5, :3] == 0.5).all() and not values[2, :, :, :, 3:].any()
    assert pixel_inputs([text], torch.device("cpu")) == {}


def test_image_fetches_are_bounded_in_hashes_and_bytes() -> None:
    many = {f"{i:064x}": 1 for i in range(GET_BATCH + 1)}
    assert [len(b) for b in _batches(many)] == [GET_BATCH, 1]
    big = GET_BATCH_BYTES // 3 + 1  # three do not fit one request
    sizes = {"a" * 64: big, "b" * 64: big, "c" * 64: big, "d" * 64: GET_BATCH_BYTES * 2}
    assert _batches(sizes) == [["a" * 64, "b" * 64], ["c" * 64], ["d" * 64]]


def test_image_tokens_in_a_call_naming_no_image_are_refused(vision_model_dir: Path) -> None:
    """A call's prompt is its whole conversation: image tokens with no image named would be
    trained as bare placeholders, without the pixels behind them."""
    pixels = ImagePixels.load(vision_model_dir, None)
    text = c.Call(seq=3, prompt_token_ids=[5, 6, pixels.image_token_id, 7])
    with pytest.raises(ValueError, match="holds image tokens and the call names no image"):
        pixels.pixels("r", text)
    assert pixels.pixels("r", c.Call(seq=4, prompt_token_ids=[5, 6, 7])) is None
