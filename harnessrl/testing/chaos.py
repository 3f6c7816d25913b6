"""Chaos on the real stack: a training run (Redis with AOF, vLLM, store, gateway, controller,
trainer, all local processes under the `Supervisor`) during which each service in turn is
killed with kill -9 at a seeded random point; the supervisor restarts it. At the end every
rollout of the run is accounted for: trained exactly once, or dropped with a recorded reason.

Used by `tests/test_chaos.py` (bounded: three steps, five kills) and `bench/chaos.py` (longer,
the engine too).

Where the accounting comes from (nothing is inferred): "rollouts in" are the rollouts the store
holds for the trainer's runs (`<run prefix>-*`); "trained" are the rollout ids in
`metrics.jsonl`'s `trained_rollouts` of the steps the final model contains (the trainer drops
lines of steps its checkpoint did not keep, so a step redone after a crash appears once, as
it was trained); "dropped" are the rollouts of those steps' `dropped_rollouts` (the trainer's
reason) plus rollouts of the runs that ended FAILED or CANCELLED in the store (their error);
"trained twice" counts ids in `trained_rollouts` of more than one step; "lost" are rollouts in
none of these.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl import procs
from harnessrl.rpc import health_check
from harnessrl.local.stack import Stack, StackConfig
from harnessrl.v1 import common_pb2 as c

GRPC = ("store", "gateway", "controller", "trainer")


@dataclass
class Kill:
    service: str
    at_s: float  # since training started
    recovery_s: float | None = None  # kill -> serving again (None: did not come back)
    trainer_step: int | None = None


@dataclass
class ChaosResult:
    kills: list[Kill] = field(default_factory=list)
    rollouts_in: int = 0
    trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    trained_twice: int = 0
    lost: int = 0
    lost_ids: list[str] = field(default_factory=list)
    steps: int = 0
    trainer_exit: int | None = None
    wall_s: float = 0.0
    events: list[str] = field(default_factory=list)

    def line(self) -> dict[str, Any]:
        return {"kills": len(self.kills), "killed": [k.service for k in self.kills],
                "rollouts_in": self.rollouts_in, "trained": self.trained,
                "dropped": self.dropped, "trained_twice": self.trained_twice,
                "lost": self.lost, "steps": self.steps, "trainer_exit": self.trainer_exit,
                "recovery_s": {f"{k.service}@{k.at_s:.0f}s": None if k.recovery_s is None
                               else round(k.recovery_s, 2) for k in self.kills},
                "wall_s": round(self.wall_s, 1)}


def _serving(stack: Stack, name: str) -> bool:
    proc = stack.procs[name]
    if not proc.alive:
        return False
    if name == "redis":
        return procs.redis_alive(stack.redis_url)
    if name.startswith("engine"):
        return bool(proc.healthy())  # type: ignore[attr-defined]
    addr = {"store": stack.store_address, "gateway": stack.gateway_admin_address,
            "controller": stack.controller_address, "trainer": stack.trainer_address}[name]
    return health_check(addr, timeout=1)


def _reason(error: str) -> str:
    """A dropped rollout's store error, shortened to a category for the summary."""
    e = error.lower()
    for key in ("timed out", "result is lost", "cancel", "exit code", "exited", "grader",
                "credential", "store", "gateway", "503", "502"):
        if key in e:
            return key
    return error[:60] or "unknown"


def account(stack: Stack, metrics_file: Path, run_prefix: str) -> ChaosResult:
    from harnessrl.clients import StoreClient

    res = ChaosResult()
    rows = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()]
    res.steps = len(rows)
    trained: Counter[str] = Counter()
    dropped: dict[str, str] = {}
    for r in rows:
        trained.update(r.get("trained_rollouts", []))
        for rid, why in r.get("dropped_rollouts", {}).items():
            dropped[rid] = why
    store = StoreClient.connect(stack.store_address, timeout=30)
    runs = [r for r in store.list_runs(1000).runs if r.run_id.startswith(run_prefix + "-")]
    all_ids: list[str] = []
    for run in runs:
        for ro in store.list_rollouts(run.run_id).rollouts:
            all_ids.append(ro.rollout_id)
            if ro.rollout_id in trained or ro.rollout_id in dropped:
                if ro.rollout_id in dropped and dropped[ro.rollout_id] == "failed":
                    dropped[ro.rollout_id] = "failed: " + _reason(ro.error or "; ".join(
                        a.error for a in ro.attempts if a.error))
                continue
            if ro.status in (c.ROLLOUT_STATUS_FAILED, c.ROLLOUT_STATUS_CANCELLED):
                dropped[ro.rollout_id] = "failed (step not kept): " + _reason(ro.error)
    store.close()
    res.rollouts_in = len(all_ids)
    res.trained = sum(1 for i in all_ids if i in trained)
    res.trained_twice = sum(1 for i in all_ids if trained[i] > 1)
    res.dropped = dict(Counter(dropped[i] for i in all_ids if i not in trained and i in dropped))
    res.lost_ids = [i for i in all_ids if i not in trained and i not in dropped]
    res.lost = len(res.lost_ids)
    return res


def run_chaos(workdir: Path, model_dir: Path, *, seed: int = 0, steps: int = 3,
              tasks_per_step: int = 2, group_size: int = 4,
              kill_order: tuple[str, ...] = ("store", "gateway", "controller", "redis",
                                             "trainer"),
              gap_s: tuple[float, float] = (3.0, 10.0), timeout_s: float = 900.0,
              trainer_flags: tuple[str, ...] = (), log: Any = print) -> ChaosResult:
    """Trains `steps` steps on the example while killing each service of `kill_order` in turn,
    `gap_s` (seeded uniform) after the previous one is back; then accounts for every rollout."""
    from harnessrl.local.train_job import start_trainer

    rng = random.Random(seed)
    workdir = Path(workdir)
    redis_port = procs.free_port()  # nothing there: the stack starts Redis (AOF) and owns it
    cfg = StackConfig(state_dir=workdir / "state", redis_url=f"redis://127.0.0.1:{redis_port}/0",
                      key_prefix="chaos:", model_dir=model_dir, served_model_name="tiny",
                      weight_transfer_backend="gloo", max_model_len=1024)
    res = ChaosResult()
    t_start = time.monotonic()
    with Stack(cfg) as stack:
        stack.supervise(on_event=lambda ev: res.events.append(ev.line()))
        out = workdir / "train"
        args = argparse.Namespace(
            output_dir=str(out), resume=False, steps=steps, harness=None,
            tasks_per_step=tasks_per_step, trainer_flags=[
                "--group-size", str(group_size), "--concurrency", str(group_size),
                "--max-attempts", "2", "--rollout-timeout-s", "60", "--seed", str(seed),
                *trainer_flags])
        import io

        from rich.console import Console
        start_trainer(stack, model_dir, args, Console(file=io.StringIO()))
        # a small, fast configuration: restart_argv keeps it (with --resume)
        t0 = time.monotonic()
        log(f"chaos: stack up in {t0 - t_start:.0f}s; training {steps} steps")
        sup = stack.supervisor
        assert sup is not None
        done = threading.Event()

        def finished() -> bool:
            return "trainer" in sup._done

        for name in kill_order:
            if finished():
                break
            time.sleep(rng.uniform(*gap_s))
            if finished():
                break
            metrics = out / "metrics.jsonl"
            step = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            k = Kill(name, time.monotonic() - t0, trainer_step=step)
            log(f"chaos: kill -9 {name} at {k.at_s:.1f}s (trainer at step {step})")
            with stack.lock:
                victim = stack.procs[name]
            victim.kill()
            killed = time.monotonic()
            deadline = killed + 600
            while time.monotonic() < deadline:
                if stack.procs[name] is not victim and _serving(stack, name):
                    k.recovery_s = time.monotonic() - killed
                    break
                if name == "trainer" and finished():
                    break
                time.sleep(0.1)
            log(f"chaos: {name} back after {k.recovery_s}s")
            res.kills.append(k)
        deadline = t0 + timeout_s
        while not finished() and time.monotonic() < deadline:
            time.sleep(1.0)
        done.set()
        trainer = stack.procs["trainer"]
        res.trainer_exit = trainer.proc.returncode if trainer.proc else None
        prefix = json.loads((out / "run.json").read_text())["run_prefix"]
        acc = account(stack, out / "metrics.jsonl", prefix)
        for f in ("rollouts_in", "trained", "dropped", "trained_twice", "lost", "lost_ids",
                  "steps"):
            setattr(res, f, getattr(acc, f))
    res.wall_s = time.monotonic() - t_start
    return res
