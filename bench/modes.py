"""sync vs async vs collocated, side by side on this machine, measured as peers measure (AReaL,
verl, ROLL: equal resources, equal steps, several runs; docs/modes.md), with a fourth arm:
sync-first, sync that trains on the first complete groups of an over-sampled step (the pool
modes' rule of leaving the slowest groups behind), so the table separates the gain of overlap
(sync-first against async / collocated) from the gain of dropping slow groups (sync against
sync-first).

One stack (Redis, store, one vLLM engine on the project's tiny model, gateway, controller). Every
arm gets the same resources: the engine and the trainer on --cpus-engine / --cpus-trainer, the
services on --cpus-services, the rollout jobs on --cpus-jobs (the controller's
`local_job_cpus`: on a deployment harnesses run in pods off the engine's and trainer's
devices), and the same K steps of the calc example whose harness has a slow tool step
(bench/_slow_tool_harness.py: lognormal, median L s, sigma --sigma). The tool latencies are
paired across arms (bench/_tool_draws.py): each draw is seeded by the seed, the task id without
the pool modes' `s<step>-` prefix, the rollout's index in its group and the count of draws of
that (task, index) pair so far in the run, so the n-th rollout of a (task, index) sleeps the
same schedule in every arm; each run's results hold the schedules drawn and each latency's
summary checks the arms agree (`pairing`). Runs are interleaved (seed by seed, latency by
latency, the arms' order rotated by seed and latency), not grouped by arm: --seeds seeds per
arm at each of --latencies, --zero-latency-seeds at 0 s.

Reported per run: wall time to K steps, the phase means (generate, train, push, hold; with
sleep, sleep and wake), engine and trainer busy fractions, final reward, staleness, groups
dropped, held calls, where the CPU went (CPU seconds of each process tree: engine, rollout
jobs, trainer, services), the tool-latency draws, and the machine and session it ran in. Per
latency, over all seeds: each arm's wall time and its speed-up over sync and over sync-first of
the same seed, as median, min and max; the phase means per arm; whether the final reward lies
within the spread of the sync seeds; and a modelled bound: the most any arm could save here
given the measured CPU, sync's wall time over max(sync's CPU seconds / the cores it may use,
sync's train + push time) — no schedule can beat the work the CPU has to do, nor the trainer's
own serial part. Ends with a table, one JSON line and a PNG of reward against wall time.

The bench takes hours: each finished (arm, seed, latency) run is appended to the runs file
(OUT/runs.jsonl, one JSON line each) as it ends, and `--resume FILE` skips the runs FILE holds
(refused when FILE's runs were taken with other settings or on another machine).

    python bench/modes.py --out /tmp/modes-bench    # 4 arms x (3 seeds x 2 latencies + 1)
    python bench/modes.py --out /tmp/modes-bench --resume /tmp/modes-bench/runs.jsonl
    python bench/modes.py --steps 2 --latencies 1 --seeds 1 --zero-latency-seeds 0 \
        --tasks-per-step 2 --group-size 4 --concurrency 8      # a smoke run, a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._procstat import children, proc_table  # noqa: E402
from bench._tool_draws import DIR_ENV, SEED_ENV, pairing, read_draws  # noqa: E402
from harnessrl import procs  # noqa: E402
from harnessrl.local.stack import Stack, StackConfig  # noqa: E402
from services.controller.backends.local import parse_cpu_list  # noqa: E402

# the arms: each trainer mode, and sync-first (sync taking the first complete groups)
ARMS = ("sync", "sync-first", "async", "collocated")
TRAINER_MODE = {"sync": "sync", "sync-first": "sync", "async": "async",
                "collocated": "collocated"}
# the trainer's setting sync-first sets (services/trainer/config.py, ModeConfig;
# services/trainer/sync_first.py): the step's run holds tasks_per_step + this many tasks and
# the step trains on the first tasks_per_step groups to complete, the rest cancelled
# (docs/modes.md, "sync-first")
SPARE_FIELD = "sync_spare_groups"
# the draws' keying: runs of another keying (the unpaired draws before it) are not resumed
DRAWS = "paired-1: seed, task id without the pool prefix, index in group, draw count"
Run = tuple[float, str, int]  # (tool latency median s, arm, seed)


def spares(a: argparse.Namespace) -> int:
    """sync-first's spare groups per step: --sync-first-spares, or the pool modes' window less
    the batch, (max_staleness + 1) x tasks_per_step - tasks_per_step (at least one batch)."""
    if a.sync_first_spares is not None:
        return int(a.sync_first_spares)
    return max(1, a.max_staleness) * a.tasks_per_step


def arm_flags(arm: str, a: argparse.Namespace) -> list[str]:
    """The trainer's mode flags of an arm."""
    flags = ["--mode.kind", TRAINER_MODE[arm], "--mode.max-staleness", str(a.max_staleness)]
    if arm == "sync-first":
        flags += [f"--mode.{SPARE_FIELD.replace('_', '-')}", str(spares(a))]
    return flags


def check_arms(arms: Sequence[str]) -> None:
    """Refuses, before any run, arms that do not exist."""
    unknown = [x for x in arms if x not in ARMS]
    if unknown or not arms:
        raise SystemExit(f"--modes: unknown arm(s) {unknown or arms}; the arms are "
                         f"{', '.join(ARMS)}")


class CpuMeter:
    """CPU seconds each part of the stack used over a bench run: a service's own, and that of
    its children (live ones read directly, ended ones through its reaped-children counters),
    so the controller's children are the rollout jobs (job wrapper, harness, grader). The
    trainer is this process's child: its CPU comes from RUSAGE_CHILDREN once it has ended."""

    def __init__(self, stack: Stack) -> None:
        self.pids = {name: p.proc.pid for name, p in stack.procs.items() if p.proc is not None}

    def read(self) -> dict[str, float]:
        table = proc_table()
        kids = children(table)

        def tree(pid: int) -> float:  # the live descendants' CPU and what they reaped
            return sum(table[k].cpu_s + table[k].reaped_cpu_s + tree(k)
                       for k in kids.get(pid, []))

        out: dict[str, float] = {}
        for name, pid in self.pids.items():
            if pid not in table:
                continue
            own, reaped = table[pid].cpu_s, table[pid].reaped_cpu_s + tree(pid)
            if name == "controller":
                out["controller"], out["rollout jobs"] = own, reaped
            else:
                out[name] = own + reaped  # vLLM's engine core is a child of its API server
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        out["trainer"] = ru.ru_utime + ru.ru_stime
        return out

    @staticmethod
    def since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {k: round(after[k] - before.get(k, 0.0), 1) for k in after}


PHASES = ("generate_s", "train_s", "push_s", "hold_s", "sleep_s", "wake_s")


def draws_dir(out: Path) -> Path:
    """A run's draws folder: the harnesses' draw counts and schedules (bench/_tool_draws.py);
    absolute, as each harness runs in a work folder of its own."""
    return out.resolve() / "draws"


def trainer_argv(stack: Any, out: Path, name: str, mode: str, latency: float,
                 a: argparse.Namespace, model_dir: Path, seed: int) -> list[str]:
    """The trainer's command line of one run (`stack`: the addresses of a `Stack`)."""
    return ["taskset", "-c", a.cpus_trainer] + procs.python_module(
        "services.trainer", "--bind", "127.0.0.1:0", "--store-address", stack.store_address,
        "--controller-address", stack.controller_address,
        "--gateway-admin-address", stack.gateway_admin_address, "--model-path", str(model_dir),
        "--output-dir", str(out / "trainer"), "--served-model-name", "tiny",
        "--steps", str(a.steps), "--tasks-per-step", str(a.tasks_per_step),
        "--group-size", str(a.group_size), "--concurrency", str(a.concurrency),
        "--run-name", name, "--stream", f"bench-{name}-{int(time.time())}", "--seed", str(seed),
        "--harness-command", json.dumps([sys.executable, str(REPO / "bench" /
                                                             "_slow_tool_harness.py")]),
        "--harness-env", json.dumps({"HARNESSRL_BENCH_TOOL_MEDIAN_S": str(latency),
                                     "HARNESSRL_BENCH_TOOL_SIGMA": str(a.sigma),
                                     DIR_ENV: str(draws_dir(out)), SEED_ENV: str(seed),
                                     "PYTHONPATH": str(REPO)}),
        # unsandboxed: every harness of the run claims its draw count in one shared folder,
        # which a sandbox (writable: its own work folder) forbids; the published figures
        # were measured before the sandbox existed
        "--sandbox", json.dumps({"disabled": True}),
        *arm_flags(mode, a), "--optimizer.lr", str(a.lr),
        "--rollout-timeout-s", "600", "--checkpoint-every", str(a.steps), "--no-resume")


def run_trainer(stack: Stack, out: Path, mode: str, latency: float, a: argparse.Namespace,
                model_dir: Path, seed: int) -> dict[str, Any]:
    """One run of arm `mode` (ARMS) at tool latency `latency` and `seed`, in folder `out`."""
    shutil.rmtree(out, ignore_errors=True)  # what a stopped bench left of this run
    out.mkdir(parents=True)
    draws = draws_dir(out)
    draws.mkdir()
    name = f"{mode}-{str(latency).replace('.', 'p')}-s{seed}"
    argv = trainer_argv(stack, out, name, mode, latency, a, model_dir, seed)
    meter = CpuMeter(stack)
    cpu_before = meter.read()
    t0 = time.time()
    proc = procs.ServiceProcess(f"trainer-{name}", argv, out, tls_root=stack.tls,
                                env=stack.engine_env("trainer")).start()
    assert proc.proc is not None
    try:
        rc = proc.proc.wait(a.timeout_s)
    finally:  # a bench stopped (Ctrl-C) or timed out leaves no trainer behind
        proc.stop()
    wall_process = time.time() - t0
    cpu = CpuMeter.since(cpu_before, meter.read())
    if rc != 0:
        raise RuntimeError(f"trainer {name} exited {rc}:\n{proc.log_tail(60)}")
    rows = [json.loads(x) for x in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]
    start = rows[0]["time"] - rows[0]["step_time_s"]
    wall = rows[-1]["time"] - start
    hist: dict[str, int] = {}
    for r in rows:
        for k, n in (r.get("staleness_hist") or {}).items():
            hist[k] = hist.get(k, 0) + n
    busy = [(r["engine_busy_fraction"], r["step_time_s"]) for r in rows
            if r.get("engine_busy_fraction") is not None]
    last = rows[-max(1, len(rows) // 3):]
    rewards = [r["reward_mean"] for r in last if r["reward_mean"] is not None]
    return {
        "mode": mode, "trainer_mode": TRAINER_MODE[mode], "trainer_mode_flags":
        arm_flags(mode, a), "latency_median_s": latency, "seed": seed, "steps": len(rows),
        "wall_s": wall,
        "phase_mean_s": {k: round(sum(r.get(k) or 0.0 for r in rows) / len(rows), 3)
                         for k in PHASES},
        "train_push_s": sum(r["train_s"] + r["push_s"] for r in rows),
        "process_s": wall_process,
        "engine_busy_fraction": sum(b * t for b, t in busy) / sum(t for _, t in busy)
        if busy else None,
        "trainer_busy_fraction": sum(r["train_s"] + r["push_s"] for r in rows) / wall,
        "final_reward": sum(rewards) / len(rewards) if rewards else None,
        "staleness_hist": hist,
        "groups_dropped": sum(r.get("groups_dropped", 0) for r in rows),
        "held_calls": sum(r.get("held_calls") or 0 for r in rows),
        "curve": [(r["time"] - start, r["reward_mean"]) for r in rows],
        # where the machine's CPU went over the trainer process's life (start to exit)
        "cpu_s": cpu,
        "cpu_busy_fraction": sum(cpu.values()) / (wall_process * (os.cpu_count() or 1)),
        # every draw's tool-step sleeps: {task, raw_id, index, draw, sleeps_s}
        "draws": read_draws(draws),
    }


def plot(results: list[dict[str, Any]], latency: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if r["latency_median_s"] == latency and r["seed"] == 0:
            xs = [x for x, y in r["curve"] if y is not None]
            ys = [y for _, y in r["curve"] if y is not None]
            ax.plot(xs, ys, marker="o", label=f"{r['mode']} ({r['wall_s']:.0f} s)")
    ax.set_xlabel("wall time since step 1 (s)")
    ax.set_ylabel("mean reward of the step")
    ax.set_title(f"calc example, tool step lognormal median {latency} s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def pin(pid: int, cpus: str) -> None:
    """Every thread of `pid` and of its descendants onto `cpus` (they keep it for new ones)."""
    table = proc_table()
    kids = children(table)
    todo = [pid]
    while todo:
        p = todo.pop()
        subprocess.run(["taskset", "-a", "-c", "-p", cpus, str(p)], check=True,
                       capture_output=True)
        todo += kids.get(p, [])


def levels(a: argparse.Namespace) -> list[float]:
    """The tool latencies of the bench, in the order each seed runs them (0 s last)."""
    return [x for x in a.latencies if x > 0] + ([0.0] if a.zero_latency_seeds > 0 else [])


def plan(a: argparse.Namespace, arms: Sequence[str]) -> list[Run]:
    """Every run, in the order they run: seed by seed, latency by latency; at the latency of
    position j the arms' order rotated by seed + j, so at each latency each seed starts with
    another arm (and no arm always runs on a machine the previous arm left warm)."""
    runs: list[Run] = []
    for seed in range(max(a.seeds, a.zero_latency_seeds)):
        for j, latency in enumerate(levels(a)):
            if seed >= (a.seeds if latency > 0 else a.zero_latency_seeds):
                continue
            k = (seed + j) % len(arms)
            runs += [(latency, arm, seed) for arm in [*arms[k:], *arms[:k]]]
    return runs


def settings_of(a: argparse.Namespace) -> dict[str, Any]:
    """What a run's figures depend on besides its (latency, arm, seed): runs of other settings
    are not resumed into the same results."""
    return {"steps": a.steps, "tasks_per_step": a.tasks_per_step, "group_size": a.group_size,
            "concurrency": a.concurrency, "sigma": a.sigma, "max_staleness": a.max_staleness,
            "lr": a.lr, "sync_first_spares": spares(a), "draws": DRAWS,
            "cpus": {"engine": a.cpus_engine, "trainer": a.cpus_trainer, "jobs": a.cpus_jobs,
                     "services": a.cpus_services}}


def machine() -> dict[str, Any]:
    """The machine a run was taken on; a resumed bench must be on the same one."""
    return {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0))}


SAME_MACHINE = ("hostname", "cpu_count")


def session() -> dict[str, Any]:
    """This bench process: an id, when it started, the checkout's commit."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    started = time.time()
    return {"id": f"{utc(started)}-{os.getpid()}", "started_at": utc(started),
            "commit": commit or None}


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def run_key(r: dict[str, Any]) -> Run:
    return (float(r["latency_median_s"]), str(r["mode"]), int(r["seed"]))


def load_runs(path: Path) -> list[dict[str, Any]]:
    """The runs of a runs file (JSON lines). A last line cut short (the bench stopped while
    writing it) is left out; any other bad line is an error."""
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    runs = []
    for n, line in enumerate(lines):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                print(f"{path}: its last line is cut short; that run is done again",
                      flush=True)
                break
            raise SystemExit(f"{path}: line {n + 1} is not a run (JSON lines expected; the "
                             f"results.json of the bench before paired draws is not "
                             f"resumable)") from None
        if not isinstance(r, dict) or r.get("kind") != "run":
            raise SystemExit(f"{path}: line {n + 1} is not a run of this bench")
        runs.append(r)
    return runs


def resume_runs(path: Path, settings: dict[str, Any], here: dict[str, Any]
                ) -> list[dict[str, Any]]:
    """The runs `path` holds, to be kept: each must have this bench's settings and this
    machine (a run from another machine or setting would not compare); none when `path` does
    not exist yet. A run found twice is kept once (the first)."""
    if not path.exists():
        print(f"resume: {path} does not exist yet; every run is to do", flush=True)
        return []
    kept: dict[Run, dict[str, Any]] = {}
    for r in load_runs(path):
        if r.get("settings") != settings:
            theirs = r.get("settings") or {}
            diff = sorted(k for k in {*settings, *theirs} if settings.get(k) != theirs.get(k))
            raise SystemExit(f"{path}: run {run_key(r)} was taken with other settings "
                             f"({', '.join(diff)}: {[theirs.get(k) for k in diff]} there, "
                             f"{[settings.get(k) for k in diff]} now); resume with the same "
                             f"flags, or start another --out")
        theirs = r.get("machine") or {}
        if any(theirs.get(k) != here[k] for k in SAME_MACHINE):
            raise SystemExit(f"{path}: run {run_key(r)} was taken on another machine "
                             f"({theirs}; this one {here}): its times would not compare")
        kept.setdefault(run_key(r), r)
    return list(kept.values())


def fresh_runs(path: Path) -> list[dict[str, Any]]:
    """A bench without --resume: refuses to append to a runs file that holds runs already."""
    if path.exists() and path.read_text().strip():
        raise SystemExit(f"{path} holds runs already: --resume {path} goes on with them; "
                         f"another --out starts afresh")
    return []


def pending(runs: Sequence[Run], done: Sequence[dict[str, Any]]) -> list[Run]:
    """The planned runs not done yet."""
    have = {run_key(r) for r in done}
    return [run for run in runs if run not in have]


def append_run(path: Path, r: dict[str, Any]) -> None:
    """One finished run onto the runs file, on disk before the next run starts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


def stats(xs: Sequence[float]) -> dict[str, Any] | None:
    """Median, min and max (over the seeds), or None with no value."""
    if not xs:
        return None
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3), "n": len(xs)}


def summary(results: list[dict[str, Any]], latency: float, cores: int) -> dict[str, Any]:
    """One latency's figures over all its seeds (module docstring)."""
    at = sorted((r for r in results if r["latency_median_s"] == latency),
                key=lambda r: r["seed"])
    sync = {r["seed"]: r for r in at if r["mode"] == "sync"}
    first = {r["seed"]: r for r in at if r["mode"] == "sync-first"}
    out: dict[str, Any] = {"runs": len(at)}
    arms = [m for m in ARMS if any(r["mode"] == m for r in at)]
    for mode in arms:
        mine = [r for r in at if r["mode"] == mode]
        out[mode] = {
            "seeds": [r["seed"] for r in mine],
            "wall_s": [round(r["wall_s"], 1) for r in mine],
            "wall_s_stats": stats([r["wall_s"] for r in mine]),
            "speedup_vs_sync": stats([sync[r["seed"]]["wall_s"] / r["wall_s"] for r in mine
                                      if r["seed"] in sync]),
            "speedup_vs_sync_first": stats([first[r["seed"]]["wall_s"] / r["wall_s"]
                                            for r in mine if r["seed"] in first]),
            "phase_mean_s": {k: round(statistics.fmean(r["phase_mean_s"][k] for r in mine), 3)
                             for k in PHASES},
            "final_reward": [r["final_reward"] for r in mine],
            "groups_dropped": [r["groups_dropped"] for r in mine],
            "cpu_busy_fraction": round(statistics.fmean(r["cpu_busy_fraction"] for r in mine),
                                       3)}
    # the arms of a seed slept the same schedules (0 mismatched), over how many shared draws
    out["pairing"] = {str(seed): pairing({r["mode"]: r.get("draws") or [] for r in at
                                          if r["seed"] == seed})
                      for seed in sorted({r["seed"] for r in at})}
    bounds = [r["wall_s"] / max(sum(r["cpu_s"].values()) / cores, r["train_push_s"])
              for r in sync.values()]
    out["modelled_bound_speedup"] = round(statistics.median(bounds), 3) if bounds else None
    rewards = [r["final_reward"] for r in sync.values() if r["final_reward"] is not None]
    if rewards:
        lo, hi = min(rewards), max(rewards)
        out["sync_final_reward_spread"] = [lo, hi]
        out["final_reward_within_sync_spread"] = {
            m: all(lo <= x <= hi for x in out[m]["final_reward"] if x is not None)
            for m in arms if m != "sync"}
    return out


def table(per_latency: dict[str, dict[str, Any]]) -> str:
    """The summary as a text table: per latency and arm, wall time and speed-ups over the
    seeds, median [min, max]."""
    def cell(st: dict[str, Any] | None, digits: int) -> str:
        return "-" if st is None else (f"{st['median']:.{digits}f} "
                                       f"[{st['min']:.{digits}f}, {st['max']:.{digits}f}]")

    lines = [f"{'latency':>7}  {'arm':<10} {'seeds':>5}  {'wall s: median [min, max]':<26} "
             f"{'vs sync':<20} {'vs sync-first':<20} dropped"]
    for lat, s in per_latency.items():
        for arm in ARMS:
            if arm in s:
                x = s[arm]
                lines.append(f"{lat:>7}  {arm:<10} {len(x['seeds']):>5}  "
                             f"{cell(x['wall_s_stats'], 0):<26} "
                             f"{cell(x['speedup_vs_sync'], 2):<20} "
                             f"{cell(x['speedup_vs_sync_first'], 2):<20} "
                             f"{x['groups_dropped']}")
    return "\n".join(lines)


def target(per_latency: dict[str, dict[str, Any]], latency: float = 8.0,
           mode: str = "collocated", ratio: float = 2.0) -> dict[str, Any] | None:
    """Whether `mode` is >= `ratio` x sync at `latency`: by the median over the seeds, and in
    every seed (its min)."""
    up = (per_latency.get(str(latency)) or {}).get(mode, {}).get("speedup_vs_sync")
    if up is None:
        return None
    return {"latency_median_s": latency, "mode": mode, "ratio": ratio, **up,
            "median_holds": up["median"] >= ratio, "every_seed_holds": up["min"] >= ratio}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="K: trainer steps per run")
    ap.add_argument("--tasks-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16, help="harness runs at once")
    ap.add_argument("--latencies", type=lambda v: [float(x) for x in v.split(",")],
                    default=[2.0, 8.0], help="tool step medians (s), comma-separated")
    ap.add_argument("--sigma", type=float, default=1.2, help="tool step lognormal sigma")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per arm at each latency")
    ap.add_argument("--zero-latency-seeds", type=int, default=1, help="seeds per arm at 0 s")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--sync-first-spares", type=int, default=None,
                    help="sync-first: spare groups per step (default: max(1, max-staleness) "
                         "x tasks-per-step, the pool modes' admission window less the batch)")
    ap.add_argument("--lr", type=float, default=4e-4,
                    help="the trainer's learning rate, below its 6e-4 default: the tiny model "
                         "tends to stop ending its answers under async/collocated training, "
                         "at 6e-4 from step 6, at 4e-4 later (docs/modes.md)")
    ap.add_argument("--modes", default=",".join(ARMS),
                    help=f"the arms, comma-separated, of {', '.join(ARMS)}")
    cores = sorted(os.sched_getaffinity(0))
    last = str(cores[-1])
    ap.add_argument("--cpus-engine", default=str(cores[0]), help="CPU list of the engine")
    ap.add_argument("--cpus-trainer", default=str(cores[0]), help="CPU list of the trainer")
    ap.add_argument("--cpus-jobs", default=last, help="CPU list of the rollout jobs")
    ap.add_argument("--cpus-services", default=last,
                    help="CPU list of Redis, store, gateway and controller")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=Path(".harnessrl/bench-modes"),
                    help="the runs' folders, the runs file (OUT/runs.jsonl), results.json and "
                         "the figure")
    ap.add_argument("--resume", type=Path, default=None, metavar="FILE",
                    help="a runs file of an earlier session on this machine (OUT/runs.jsonl): "
                         "its runs are kept, the others run and are appended to it")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    arms = [x for x in a.modes.split(",") if x]
    check_arms(arms)  # before hours of runs
    settings, here, me = settings_of(a), machine(), session()
    runs_file = a.resume or a.out / "runs.jsonl"
    done = resume_runs(runs_file, settings, here) if a.resume else fresh_runs(runs_file)
    planned = plan(a, arms)
    runs = pending(planned, done)
    print(f"session {me['id']} on {here}: {len(done)} runs done ({runs_file}), {len(runs)} of "
          f"{len(planned)} planned to do", flush=True)
    from harnessrl.model import build_tiny_model, default_model_dir

    model_dir = build_tiny_model(default_model_dir())
    a.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.out / "stack", ignore_errors=True)  # a fresh stack: no runs of a stopped one
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    cfg = StackConfig(state_dir=a.out / "stack", redis_url=f"redis://127.0.0.1:"
                      f"{procs.free_port()}/0", key_prefix="bench-modes:", model_dir=model_dir,
                      served_model_name="tiny", weight_transfer_backend="gloo",
                      gateway_flags=("--hold-timeout-s", "600"),
                      controller_flags=("--local-job-cpus", a.cpus_jobs))
    results = list(done)
    used = {int(c) for cpus in (a.cpus_engine, a.cpus_trainer, a.cpus_jobs, a.cpus_services)
            for c in parse_cpu_list(cpus)}
    if runs:
        with Stack(cfg) as stack:
            for name, p in stack.procs.items():
                if p.proc is not None:
                    pin(p.proc.pid, a.cpus_engine if name.startswith("engine")
                        else a.cpus_services)
            for latency, mode, seed in runs:
                with open("/proc/loadavg") as f:
                    run_load = f.read().split()[:3]
                started = time.time()
                r = run_trainer(stack, a.out / f"{mode}-lat{latency}-seed{seed}", mode,
                                latency, a, model_dir, seed)
                r.update(kind="run", machine=here, session=me, started_at=utc(started),
                         finished_at=utc(time.time()), load_before=run_load,
                         plan_position=planned.index((latency, mode, seed)),
                         settings=settings)
                append_run(runs_file, r)  # so far: a stop loses only the run in flight
                results.append(r)
                print(f"[{len(results)}/{len(planned)}] latency {latency:>4} s  "
                      f"{mode:<10} seed {seed}  "
                      f"{r['steps']} steps in {r['wall_s']:7.1f} s  phases {r['phase_mean_s']}  "
                      f"reward {r['final_reward']}  dropped {r['groups_dropped']}  held "
                      f"{r['held_calls']}  draws {len(r['draws'])}\n    CPU s over "
                      f"{r['process_s']:.0f} s (busy {r['cpu_busy_fraction']:.2f}): "
                      f"{r['cpu_s']}", flush=True)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    latencies = sorted({r["latency_median_s"] for r in results})
    per_latency = {str(lat): summary(results, lat, len(used)) for lat in latencies}
    sessions: dict[str, dict[str, Any]] = {}
    for r in results:  # which machine and session each run came from
        sid = r["session"]["id"]
        sessions.setdefault(sid, {**r["session"], "machine": r["machine"], "runs": []})
        sessions[sid]["runs"].append(list(run_key(r)))
    line = {
        "per_latency": per_latency, "collocated_vs_sync_8s": target(per_latency),
        "settings": settings, "sessions": list(sessions.values()),
        "missing_runs": [list(x) for x in pending(planned, results)],
        "load_before": load_before, "load_after": load_after}
    (a.out / "results.json").write_text(json.dumps({**line, "runs": results}, indent=1))
    if latencies:
        png = a.out / "reward_vs_wall.png"
        plot(results, max(latencies), png)
        print(f"figure {png}")
    print(f"load average before {load_before}, after {load_after}; runs {runs_file}, "
          f"results {a.out / 'results.json'}\n{table(per_latency)}")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
