"""What a training run leaves to look at: a short run of the real training loop (`train_sync`,
against a real store process on a real Redis, its steps' groups written by the `StoreRuns`
test double of test_checkpoint.py) with TensorBoard and W&B (offline) switched on and the
trainer's Prometheus endpoint served; then the event files, the W&B run file, the scraped
/metrics, rollouts.jsonl and the `harnessrl report` page (rendered in headless Chromium) are
read back. The controller's double marks each group's rollouts 0 and 1 tampered (as the
controller does under the run settings ZERO and DROP): the rows count them, rollouts.jsonl
and the report mark them, and the DROP one is not trained on."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl.clients import StoreClient
from harnessrl.metrics import serve_metrics
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.trainer.loop import train_sync
from test_checkpoint import (  # noqa: F401 - fixtures
    TASKS_PER_STEP, RecordingSink, make_config, small_model, store, trainer, vocab)

STEPS = 2
EVIDENCE = "must-fail canary passed"


class TamperingStore(StoreClient):
    """The real store client; the finishes the controller's double sends for rollouts 0 and 1
    of each group are those of tampered rollouts, as the controller sends them: reward 0
    (TAMPERED_REWARDS_ZERO) and no reward (TAMPERED_REWARDS_DROP)."""

    def __init__(self, inner: StoreClient) -> None:
        super().__init__(inner.channel, inner.timeout)

    def finish_attempt(self, request: spb.FinishAttemptRequest) -> c.Rollout:
        index = request.rollout_id.rsplit(".", 1)[1]
        if index in ("0", "1"):
            request.reward, request.tampered, request.tamper_evidence = 0.0, True, EVIDENCE
            request.reward_dropped = index == "1"
        return super().finish_attempt(request)


def scrape(port: int) -> dict[str, float]:
    """{series with labels: value} of a /metrics page."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, small_model: Path,  # noqa: F811
        redis_url: str) -> Iterator[dict[str, Any]]:
    """One short training run with every tracker on; its output dir and two scrapes of the
    trainer's /metrics (before and after)."""
    from conftest import StoreService

    tmp = tmp_path_factory.mktemp("tracked")
    svc = StoreService(tmp / "store", redis_url, "track:").start()
    client = StoreClient.connect(svc.address, timeout=10)
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    try:
        import json as _json
        vocab_size = int(_json.loads((small_model / "config.json").read_text())["vocab_size"])
        port = serve_metrics("127.0.0.1:0")
        assert port
        before = scrape(port)
        cfg = make_config(tmp, "out", small_model, STEPS, tensorboard=True,
                          wandb_project="harnessrl-test", sample_rollouts=3)
        t, _ = trainer(cfg, TamperingStore(client), RecordingSink(), vocab_size)
        try:
            train_sync(t)
        finally:
            t.close()
        yield {"out": Path(cfg.output_dir), "before": before, "after": scrape(port),
               "status": t.control.snapshot()}  # the Trainer service's GetStatus
    finally:
        mp.undo()
        client.close()
        svc.stop()


def metrics_rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_event_files_hold_every_metrics_field_and_the_rollouts(
        run: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = metrics_rows(run["out"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    acc = EventAccumulator(str(run["out"] / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    numeric = {k for k, v in rows[0].items() if isinstance(v, (int, float)) and k != "step"}
    assert {f"train/{k}" for k in numeric} <= scalars, numeric - {s[6:] for s in scalars}
    for key in ("reward_mean", "kl", "loss", "tokens_per_s", "push_s"):
        events = acc.Scalars(f"train/{key}")
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([r[key] for r in rows], rel=1e-5)
    texts = acc.Tags()["tensors"]  # text summaries are stored as tensors
    assert "rollouts/text_summary" in texts and "train/run_id/text_summary" in texts
    rendered = acc.Tensors("rollouts/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert f"{rows[-1]['run_id']}." in rendered and "reward" in rendered


def read_wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file (`run-<id>.wandb`): a 7-byte header (b":W&B", 0xBEE1,
    version 0), then LevelDB-log blocks of 32 KiB, each chunk with a 7-byte header (CRC-32C,
    length, type: 1 full, 2 first, 3 middle, 4 last), each record a `Record` protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, records, partial = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(partial + chunk)
            records.append(rec)
            partial = b""
        else:
            partial += chunk
    return records


def test_wandb_offline_run_holds_every_metrics_field_per_step(run: dict[str, Any]) -> None:
    rows = metrics_rows(run["out"])
    (run_file,) = (run["out"] / "wandb").glob("offline-run-*/run-*.wandb")
    history = []
    for rec in read_wandb_records(run_file):
        if rec.WhichOneof("record_type") == "history":
            h: dict[str, Any] = {}
            for item in rec.history.item:
                *parents, leaf = [item.key] if item.key else list(item.nested_key)
                node = h
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = json.loads(item.value_json)
            history.append(h)
    assert [h["_step"] for h in history] == [1, 2], history
    rendered = [json.loads(x) for x in (run["out"] / "rollouts.jsonl").read_text().splitlines()]
    for h, row in zip(history, rows):
        for k, v in row.items():
            if k == "step" or v is None or v == {}:  # W&B keeps no key for an empty mapping
                continue
            assert h[f"train/{k}"] == (pytest.approx(v) if isinstance(v, float) else v), k
        table = h["rollouts"]
        assert table["_type"] == "table-file" and table["nrows"] == 3
        saved = json.loads((run_file.parent / "files" / table["path"]).read_text())
        texts = [r["text"] for r in rendered if r["step"] == row["step"]]
        assert [r[saved["columns"].index("text")] for r in saved["data"]] == texts


def test_rollouts_jsonl_renders_the_recorded_tokens(run: dict[str, Any]) -> None:
    rendered = [json.loads(x) for x in (run["out"] / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rendered] == [1, 1, 1, 2, 2, 2]
    for r in rendered:
        assert r["calls"] == 2 and r["status"] == "SUCCEEDED" and r["reward"] in (0.0, 1.0)
        assert len(r["text"]) > 10


def test_step_rows_rollouts_and_report_mark_tampered_rollouts(run: dict[str, Any]) -> None:
    from harnessrl.local.report import render

    rows = metrics_rows(run["out"])
    for row in rows:
        assert row["rollouts_tampered"] == 2 * TASKS_PER_STEP, row
        dropped = [rid for rid in row["dropped_rollouts"] if rid.endswith(".1")]
        assert len(dropped) == TASKS_PER_STEP  # DROP: no reward, not trained on
        assert all(row["dropped_rollouts"][rid] == "tampered" for rid in dropped)
        assert not set(dropped) & set(row["trained_rollouts"])
    assert [m.rollouts_tampered for m in run["status"].recent] == [2 * TASKS_PER_STEP] * STEPS
    rendered = [json.loads(x) for x in (run["out"] / "rollouts.jsonl").read_text().splitlines()]
    assert all(r["tampered"] and r["tamper_evidence"] == EVIDENCE for r in rendered)
    page = render(run["out"])
    assert f"<th>tampered rollouts</th><td>{2 * TASKS_PER_STEP * STEPS} (their" in page
    shown = page.split("<h2>Rollouts</h2>")[1]
    assert shown.count('<strong class="tampered">TAMPERED</strong>') == shown.count("<details")
    assert f"Evidence: {EVIDENCE}" in shown


def test_trainer_metrics_endpoint_moves_with_the_steps(run: dict[str, Any]) -> None:
    before, after = run["before"], run["after"]
    rows = metrics_rows(run["out"])
    steps = "harnessrl_trainer_steps_total"
    assert after[steps] - before.get(steps, 0.0) == STEPS
    for phase in ("generate", "train", "push", "step"):
        name = f'harnessrl_trainer_step_phase_seconds_count{{phase="{phase}"}}'
        assert after[name] - before.get(name, 0.0) == STEPS, name
    assert after["harnessrl_trainer_push_seconds_count"] - \
        before.get("harnessrl_trainer_push_seconds_count", 0.0) == STEPS
    assert after["harnessrl_trainer_reward_mean"] == pytest.approx(rows[-1]["reward_mean"])
    assert after["harnessrl_trainer_kl"] == pytest.approx(rows[-1]["kl"])
    assert after["harnessrl_trainer_tokens_per_second"] == pytest.approx(rows[-1]["tokens_per_s"])
    assert after["harnessrl_trainer_tokens_per_second"] > 0
    assert after["harnessrl_trainer_staleness"] == 0
    assert after["harnessrl_trainer_policy_version"] == STEPS


def _near(pixel: tuple[int, ...], color: str, tol: int = 40) -> bool:
    want = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return all(abs(p - w) <= tol for p, w in zip(pixel[:3], want))


def _runs(flags: list[bool], max_gap: int = 4) -> list[tuple[int, int]]:
    """[start, end) of each run of True, gaps of up to `max_gap` (grid lines) bridged."""
    out: list[tuple[int, int]] = []
    start = None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            if out and start - out[-1][1] <= max_gap:
                start = out.pop()[0]
            out.append((start, i))
            start = None
    return out


def test_report_page_shows_the_reward_curve_in_its_plot_area_in_headless_chromium(
        run: dict[str, Any], tmp_path: Path) -> None:
    """`harnessrl report` as a command; the page loads nothing from elsewhere; Chromium's
    screenshot has the reward colour inside the first chart's plot area (its background colour
    is `PLOT_BG`), spread over most of its width (a curve, not a legend swatch)."""
    from PIL import Image

    from harnessrl.local.report import COLORS, PLOT_BG

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is missing: scripts/setup.sh installs it (apt-get install chromium)"
    page = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "harnessrl.local.cli", "report", str(run["out"]),
                           "--out", str(page)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    # self-contained: no script, stylesheet link or reference to anything but itself
    assert "<script" not in text and "<link" not in text and "<img" not in text
    assert not re.search(r'(?:src|href)\s*=\s*"(?!#)', text), \
        re.search(r'(?:src|href)\s*=\s*"(?!#)[^"]*"', text)
    assert text.count("<svg") == 5 and "Rollouts" in text
    first = json.loads((run["out"] / "rollouts.jsonl").read_text().splitlines()[-1])
    assert first["rollout_id"] in text

    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--force-device-scale-factor=1", "--window-size=1400,1200",
                    f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    img = Image.open(shot).convert("RGB")
    width, height = img.size
    px = img.load()
    bg_rows = [any(_near(px[x, y], PLOT_BG, 2) for x in range(0, width, 3))
               for y in range(height)]
    top, bottom = _runs(bg_rows)[0]  # the first row of charts: reward (left) and KL
    left, right = _runs([any(_near(px[x, y], PLOT_BG, 2) for y in range(top, bottom, 3))
                         for x in range(width)])[0]  # the reward chart's plot area
    red = [(x, y) for y in range(top, bottom) for x in range(left, right)
           if _near(px[x, y], COLORS["reward"])]
    assert len(red) > 100, (top, bottom, left, right, len(red))
    xs = [x for x, _ in red]
    assert max(xs) - min(xs) > 0.6 * (right - left), (min(xs), max(xs), left, right)
    outside = [(x, y) for y in range(height) for x in range(0, width, 2)
               if not (top <= y < bottom and left <= x < right) and _near(px[x, y],
                                                                          COLORS["reward"])]
    assert not outside, outside[:5]
