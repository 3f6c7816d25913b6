"""Chaos on the real stack: a training run (Redis with AOF, vLLM, store, gateway, controller,
trainer, all local processes under the `Supervisor`) during which each service of a planned
list is killed with kill -9 once, in order; the supervisor restarts it. Then every rollout the
run should have made is accounted for (`chaos_accounting`: expected from outside, trained
checked against Redis's acknowledgements, each drop tied to a kill).

Used by `tests/test_chaos.py` (bounded: store, gateway, controller, Redis, trainer) and
`bench/chaos.py` (longer, the engine too, rounds, sync or async).

Each kill waits for the phase it is meant to hit, then a seeded random 0-`jitter_s` more:
- store, gateway, controller, engine: a harness attempt is in flight (the chaos harness's log
  has a start without an end), so calls and attempt records are being written;
- Redis, the trainer: the trainer's consumer group has entries pending (delivered to the
  trainer, not yet acknowledged: between reading a step's groups and its checkpoint), so the
  kill exercises acknowledgement and the checkpoint (a trainer killed there redoes the step).
The next kill is looked for `gap_s` (seeded) after the previous service serves again. A kill
whose phase does not come before training ends does not happen: the result lists the kills
done, and the caller checks that all planned ones were.

"gateways" in the list is not a kill but a rolling restart, as a Deployment's rollout does it:
with `gateway_replicas` >= 2 behind the stack's balancer, each replica in turn gets SIGTERM
(it drains: not ready, no new connections, its calls in flight finish) and the next one only
once it serves again. It excuses no drop: a rollout lost to it fails the accounting.

The harness is `chaos_harness.py` around the example's own harness; it logs each attempt's
start and end (wall clock) to `<workdir>/harness.jsonl`, outside the stack's state. Kill times
are wall clock too. The trainer runs with `--no-trim-stream` (every acknowledgement stays
readable in Redis; trimming has its own tests) and with zero-variance groups trained (the
accounting, not learning, is under test: a drop then has no reason but a failure).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from harnessrl import procs
from harnessrl.local.stack import Stack, StackConfig
from harnessrl.rpc import health_check
from harnessrl.checkpoint_folders import latest_checkpoint
from harnessrl.engine_guard import API_KEY_ENV, ClientKey
from harnessrl.testing import chaos_accounting as ca
from harnessrl.testing.trained_probe import Probe, probe_engine

KILL_ORDER = ("store", "gateway", "controller", "redis", "trainer")
PENDING_PHASE = ("redis", "trainer")
KEY_PREFIX = "chaos:"
ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "examples" / "calc"


@dataclass
class Kill:
    service: str
    at: float  # time.time() of the kill
    at_s: float  # since training started
    phase: str  # what was going on: "harness in flight", "groups pending"
    back: float | None = None  # time.time() serving again (None: did not come back)
    trainer_step: int | None = None
    excuses: bool = True  # a drop it covers is explained (False: the rolling restart)

    @property
    def recovery_s(self) -> float | None:
        return None if self.back is None else self.back - self.at

    @property
    def label(self) -> str:
        return f"{self.service}@{self.at_s:.1f}s"


@dataclass
class ChaosInputs:
    """What the accounting reads, kept so it can be run again (tests inject faults)."""

    redis_dir: Path
    redis_port: int
    run_prefix: str
    expected: dict[str, int]
    harness_log: Path
    metrics_file: Path
    windows: list[ca.KillWindow]
    run_end: float
    mode: str
    trainer_deaths: int
    max_staleness: int | None = None  # async: the run's bound (stale drops must name it)

    def save(self, path: Path) -> None:
        d = {k: str(v) if isinstance(v, Path) else v for k, v in vars(self).items()}
        d["windows"] = [vars(w) for w in self.windows]
        Path(path).write_text(json.dumps(d) + "\n")

    @classmethod
    def load(cls, path: Path) -> "ChaosInputs":
        d = json.loads(Path(path).read_text())
        for k in ("redis_dir", "harness_log", "metrics_file"):
            d[k] = Path(d[k])
        d["windows"] = [ca.KillWindow(**w) for w in d["windows"]]
        return cls(**d)

    def account(self, redis_url: str) -> ca.Accounting:
        view = ca.read_redis(redis_url, KEY_PREFIX, self.run_prefix, set(self.expected))
        return ca.account(self.expected, view, ca.read_claims(self.metrics_file),
                          ca.read_harness_log(self.harness_log), self.windows, self.run_end,
                          self.mode, self.trainer_deaths, self.max_staleness)


@dataclass
class ChaosResult:
    planned: list[str] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    acc: ca.Accounting = field(default_factory=ca.Accounting)
    inputs: ChaosInputs | None = None
    steps: int = 0  # kept steps (the final checkpoint's)
    trainer_exit: int | None = None
    wall_s: float = 0.0
    events: list[str] = field(default_factory=list)
    # the engine's probe logprobs at the end, with the last checkpoint (trained_probe.py)
    probe: Probe | None = None

    def line(self) -> dict[str, Any]:
        a = self.acc
        return {"mode": self.inputs.mode if self.inputs else None,
                "kills": len(self.kills), "planned": len(self.planned),
                "killed": [k.label for k in self.kills],
                "recovery_s": {k.label: None if k.recovery_s is None else round(k.recovery_s, 2)
                               for k in self.kills},
                "expected": a.expected, "rollouts_in": a.rollouts_in, "trained": a.trained,
                "dropped": a.dropped_by_reason(), "by_design": a.by_design,
                "drops": [{"rollout": d["rollout"], "reason": d["reason"][:80],
                           "kills": d["kills"]} for d in a.drops],
                "trained_twice": len(a.trained_twice), "lost": len(a.lost),
                "problems": len(a.problems), "steps": self.steps,
                "trainer_exit": self.trainer_exit, "wall_s": round(self.wall_s, 1)}


def _serving(stack: Stack, name: str) -> bool:
    proc = stack.procs[name]
    if not proc.alive:
        return False
    if name == "redis":
        return procs.redis_alive(stack.redis_url)
    if name.startswith("engine"):
        return bool(proc.healthy())  # type: ignore[attr-defined]
    if name.startswith("gateway"):  # this replica itself, not the balancer
        addr = proc.argv[proc.argv.index("--grpc-bind") + 1]
    else:
        addr = {"store": stack.store_address, "controller": stack.controller_address,
                "trainer": stack.trainer_address}[name]
    return health_check(addr, timeout=1, peer="gateway" if name.startswith("gateway") else name)


def _in_flight(log: Path) -> bool:
    if not log.exists():
        return False
    text = log.read_text()
    return text.count('"event": "start"') > text.count('"event": "end"')


def _pending(redis_url: str) -> int:
    try:
        r = redis.Redis.from_url(redis_url, socket_timeout=1)
        try:
            return int(r.xpending(f"{KEY_PREFIX}stream:{ca.STREAM}",
                                  ca.CONSUMER_GROUP)["pending"])
        finally:
            r.close()
    except redis.RedisError:
        return 0


def _rolling_restart(stack: Stack, name: str, wait_until: Any) -> bool:
    """SIGTERM one gateway replica (the supervisor starts it again); True once it serves."""
    with stack.lock:
        victim = stack.procs[name]
    victim.signal(signal.SIGTERM)
    return bool(wait_until(lambda: stack.procs[name] is not victim and _serving(stack, name),
                           600))


def run_chaos(workdir: Path, model_dir: Path, *, seed: int = 0, steps: int = 3,
              tasks_per_step: int = 2, group_size: int = 4,
              kill_order: tuple[str, ...] = KILL_ORDER, mode: str = "sync",
              gateway_replicas: int = 1,
              gap_s: tuple[float, float] = (0.5, 2.0), jitter_s: float = 0.5,
              timeout_s: float = 900.0, log: Any = print) -> ChaosResult:
    """Trains `steps` steps of the example while killing each service of `kill_order` in turn
    in its phase (module docstring); then accounts for every rollout."""
    from harnessrl.local.train_job import start_trainer

    rng = random.Random(seed)
    workdir = Path(workdir).resolve()
    redis_port = procs.free_port()  # nothing there: the stack starts Redis (AOF) and owns it
    cfg = StackConfig(state_dir=workdir / "state", redis_url=f"redis://127.0.0.1:{redis_port}/0",
                      key_prefix=KEY_PREFIX, model_dir=model_dir, served_model_name="tiny",
                      weight_transfer_backend="gloo", max_model_len=1024,
                      gateway_replicas=gateway_replicas)
    if "gateways" in kill_order and gateway_replicas < 2:
        raise ValueError("a rolling restart of the gateways needs gateway_replicas >= 2")
    harness_log = workdir / "harness.jsonl"
    tasks_file = EXAMPLE / "tasks.jsonl"
    harness = [sys.executable, str(Path(__file__).with_name("chaos_harness.py")),
               str(harness_log), sys.executable, str(EXAMPLE / "harness.py")]
    pool_factor, max_staleness = 2.0, 1
    res = ChaosResult(planned=list(kill_order))
    t_start = time.monotonic()
    with Stack(cfg) as stack:
        stack.supervise(on_event=lambda ev: res.events.append(ev.line()))
        out = workdir / "train"
        args = argparse.Namespace(
            output_dir=str(out), resume=False, steps=steps, harness=None, mode=mode,
            tasks_per_step=tasks_per_step, trainer_flags=[
                "--group-size", str(group_size), "--concurrency", str(group_size),
                "--max-attempts", "2", "--rollout-timeout-s", "60", "--seed", str(seed),
                "--tasks-file", str(tasks_file), "--harness-command", json.dumps(harness),
                "--no-trim-stream", "--no-advantage.filter-zero-variance",
                "--mode.pool-factor", str(pool_factor),
                "--mode.max-staleness", str(max_staleness),
                # the chaos harness logs every rollout's start and end into one shared file
                # (the instrument the accounting reads), which a sandbox rightly forbids
                "--sandbox", json.dumps({"disabled": True})])
        from rich.console import Console
        start_trainer(stack, model_dir, args, Console(file=io.StringIO()))
        t0 = time.monotonic()
        log(f"chaos: stack up in {t0 - t_start:.0f}s; training {steps} steps ({mode})")
        sup = stack.supervisor
        assert sup is not None

        def finished() -> bool:
            return "trainer" in sup._done

        def wait_until(cond: Any, limit: float) -> bool:
            deadline = time.monotonic() + limit
            while not finished() and time.monotonic() < deadline:
                if cond():
                    return True
                time.sleep(0.1)
            return False

        for name in kill_order:
            time.sleep(rng.uniform(*gap_s))
            pending_phase = name in PENDING_PHASE
            phase = "groups pending" if pending_phase else "harness in flight"
            if not wait_until((lambda: _pending(stack.redis_url) > 0) if pending_phase
                              else (lambda: _in_flight(harness_log)), timeout_s):
                log(f"chaos: training ended before the phase of the {name} kill ({phase})")
                break
            time.sleep(rng.uniform(0, jitter_s))
            if finished():
                break
            metrics = out / "metrics.jsonl"
            k = Kill(name, time.time(), time.monotonic() - t0, phase, trainer_step=len(
                metrics.read_text().splitlines()) if metrics.exists() else 0)
            if name == "gateways":
                k.excuses = False
                log(f"chaos: rolling restart of the gateways at {k.at_s:.1f}s ({phase})")
                if all(_rolling_restart(stack, f"gateway{i or ''}", wait_until)
                       for i in range(gateway_replicas)):
                    k.back = time.time()
                log(f"chaos: gateways restarted in {k.recovery_s}s")
                res.kills.append(k)
                continue
            log(f"chaos: kill -9 {name} at {k.at_s:.1f}s ({phase}; trainer at step "
                f"{k.trainer_step})")
            with stack.lock:
                victim = stack.procs[name]
                trainer_before = stack.procs["trainer"]
            victim.kill()
            if wait_until(lambda: stack.procs[name] is not victim and _serving(stack, name),
                          600):
                k.back = time.time()
                # an engine is back in use once the restarted trainer pushed into it
                if name.startswith("engine") and not wait_until(
                        lambda: stack.procs["trainer"] is not trainer_before
                        and _serving(stack, "trainer"), 600) and not finished():
                    k.back = None
                elif name.startswith("engine"):
                    k.back = time.time()
            elif name == "trainer" and finished():
                k.back = time.time()  # it finished its steps: nothing left to serve
            log(f"chaos: {name} back after {k.recovery_s}s")
            res.kills.append(k)
        wait_until(lambda: False, max(0.0, timeout_s - (time.monotonic() - t0)))
        run_end = time.time()
        trainer = stack.procs["trainer"]
        res.trainer_exit = trainer.proc.returncode if trainer.proc else None
        prefix = json.loads((out / "run.json").read_text())["run_prefix"]
        res.steps = ca.kept_steps(out)
        expected = ca.expected_sync(tasks_file, seed, res.steps, tasks_per_step, group_size,
                                    prefix) if mode == "sync" else \
            ca.expected_async(tasks_file, seed, steps, tasks_per_step, group_size, prefix,
                              pool_factor, max_staleness)
        deaths = sum(1 for e in sup.events if e.service == "trainer" and e.kind == "died")
        res.inputs = ChaosInputs(
            redis_dir=stack.state / "redis", redis_port=redis_port, run_prefix=prefix,
            expected=expected, harness_log=harness_log, metrics_file=out / "metrics.jsonl",
            windows=[ca.KillWindow(k.service, k.at, k.back, k.label) for k in res.kills
                     if k.excuses],
            run_end=run_end, mode=mode, trainer_deaths=deaths, max_staleness=max_staleness)
        res.inputs.save(workdir / "chaos.json")  # to account again later: ChaosInputs.load
        res.acc = res.inputs.account(stack.redis_url)
        key = ClientKey(path=stack.engine_env("trainer")[f"{API_KEY_ENV}_FILE"])
        res.probe = probe_engine(stack.engines[0].base_url, model_dir, "tiny", key,
                                 latest_checkpoint(out / "checkpoints"))
    res.wall_s = time.monotonic() - t_start
    return res
