"""The trainer's line files (`metrics.jsonl`, `rollouts.jsonl`): appended one fsynced line at
a time, and trimmed on resume to the steps the checkpoint holds (lines of later steps were
written before a crash and are redone); the run's identity (`run.json`); a step's row as the
trainer's status reports it (`step_metrics`)."""

from __future__ import annotations

import json
import math
import os
import statistics
import uuid
from pathlib import Path
from typing import Any

from harnessrl.v1 import trainer_pb2 as tpb

RUN_FILE = "run.json"


def run_prefix_of(output: Path, run_name: str) -> str:
    """`<run_name>-<nonce>`, drawn once per output dir and kept in its run.json (a LoRA
    run's adapter is named after it too)."""
    path = output / RUN_FILE
    if path.exists():
        return str(json.loads(path.read_text())["run_prefix"])
    output.mkdir(parents=True, exist_ok=True)
    prefix = f"{run_name}-{uuid.uuid4().hex[:8]}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"run_prefix": prefix}) + "\n")
    tmp.replace(path)
    return prefix


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def trim_metrics(path: Path, step: int) -> None:
    """Drops lines of steps after `step` (written before a crash, redone after the resume)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = [x for x in lines if x.strip() and json.loads(x)["step"] <= step]
    if len(keep) != len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        tmp.replace(path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line of `path` (none when it does not exist)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return rows


def _num(x: float | None) -> float:
    return math.nan if x is None else float(x)


def step_metrics(row: dict[str, Any], staleness: list[int]) -> tpb.StepMetrics:
    """A step's metrics.jsonl row as the trainer's status reports it (TrainerControl)."""
    return tpb.StepMetrics(
        step=row["step"], policy_version=row["policy_version"],
        reward_mean=_num(row["reward_mean"]), reward_std=_num(row["reward_std"]),
        loss=_num(row["loss"]), kl=_num(row["kl"]),
        clip_fraction=_num(row["clip_fraction"]), entropy=_num(row["entropy"]),
        tokens=row["tokens"], step_time_s=row["step_time_s"], groups=row["groups"],
        grad_norm=_num(row["grad_norm"]), groups_dropped=row["groups_dropped"],
        staleness_mean=statistics.fmean(staleness) if staleness else math.nan,
        staleness_max=row["staleness_max"] or 0,
        groups_in_flight=row["groups_in_flight"] or 0,
        engine_busy_fraction=_num(row["engine_busy_fraction"]),
        trainer_busy_fraction=row["trainer_busy_fraction"],
        held_calls=row["held_calls"] or 0, rollouts_tampered=row["rollouts_tampered"])
