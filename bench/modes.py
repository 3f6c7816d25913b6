"""sync vs async vs collocated, side by side on this machine, measured as peers measure (AReaL,
verl, ROLL: equal resources, equal steps, several runs; docs/modes.md).

One stack (Redis, store, one vLLM engine on the project's tiny model, gateway, controller). Every
mode gets the same resources: the engine and the trainer on --cpus-engine / --cpus-trainer, the
services on --cpus-services, the rollout jobs on --cpus-jobs (the controller's
`local_job_cpus`: on a deployment harnesses run in pods off the engine's and trainer's
devices), and the same K steps of the calc example whose harness has a slow tool step
(bench/_slow_tool_harness.py: lognormal, median L s, sigma --sigma). Runs are interleaved (seed
by seed, latency by latency, the order of the modes rotated), not grouped by mode: --seeds
seeds per mode at each of --latencies, --zero-latency-seeds at 0 s.

Reported per run: wall time to K steps, the phase means (generate, train, push, hold; with
sleep, sleep and wake), engine and trainer busy fractions, final reward, staleness, groups
dropped, held calls, and where the CPU went (CPU seconds of each process tree: engine, rollout
jobs, trainer, services). Per latency: each mode's speed-up over sync of the same seed as a
median with its min and max, the phase means per mode, whether the final reward lies within
the spread of the sync seeds, and a modelled bound: the most any mode could save here given
the measured CPU, sync's wall time over max(sync's CPU seconds / the cores it may use,
sync's train + push time) — no schedule can beat the work the CPU has to do, nor the trainer's
own serial part. Ends with one JSON line and a PNG of reward against wall time.

    python bench/modes.py --out /tmp/modes-bench      # 3 modes x (3 seeds x 2 latencies + 1)
    python bench/modes.py --out /tmp/modes-bench --resume   # after a stop: the runs not yet done
    python bench/modes.py --steps 2 --latencies 1 --seeds 1 --zero-latency-seeds 0 \
        --tasks-per-step 2 --group-size 4 --concurrency 8      # a smoke run, a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._procstat import children, proc_table  # noqa: E402
from harnessrl import procs  # noqa: E402
from harnessrl.local.stack import Stack, StackConfig  # noqa: E402
from services.controller.backends.local import parse_cpu_list  # noqa: E402

MODES = ("sync", "async", "collocated")


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


def run_trainer(stack: Stack, out: Path, mode: str, latency: float, a: argparse.Namespace,
                model_dir: Path, seed: int) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)  # what a stopped bench left of this run
    out.mkdir(parents=True)
    name = f"{mode}-{str(latency).replace('.', 'p')}-s{seed}"
    argv = ["taskset", "-c", a.cpus_trainer] + procs.python_module(
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
                                     "PYTHONPATH": str(REPO)}),
        # sandboxed: the harness imports the calc example, which its command does not name
        "--sandbox", json.dumps({"read_only_paths": [str(REPO / "examples" / "calc")]}),
        "--mode.kind", mode, "--mode.max-staleness", str(a.max_staleness),
        "--optimizer.lr", str(a.lr),
        "--rollout-timeout-s", "600", "--checkpoint-every", str(a.steps), "--no-resume")
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
        "mode": mode, "latency_median_s": latency, "seed": seed, "steps": len(rows),
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


def interleaved(a: argparse.Namespace, modes: list[str]) -> list[tuple[float, str, int]]:
    """(latency, mode, seed): seed by seed, latency by latency, the modes' order rotated."""
    runs, k = [], 0
    for seed in range(max(a.seeds, a.zero_latency_seeds)):
        for latency in [x for x in a.latencies if x > 0 and seed < a.seeds] + (
                [0.0] if seed < a.zero_latency_seeds else []):
            order = modes[k % len(modes):] + modes[:k % len(modes)]
            runs += [(latency, mode, seed) for mode in order]
            k += 1
    return runs


def summary(results: list[dict[str, Any]], latency: float, cores: int) -> dict[str, Any]:
    at = [r for r in results if r["latency_median_s"] == latency]
    sync = {r["seed"]: r for r in at if r["mode"] == "sync"}
    out: dict[str, Any] = {"runs": len(at)}
    for mode in sorted({r["mode"] for r in at}):
        mine = [r for r in at if r["mode"] == mode]
        ups = [sync[r["seed"]]["wall_s"] / r["wall_s"] for r in mine if r["seed"] in sync]
        out[mode] = {
            "speedup_vs_sync": {"median": statistics.median(ups), "min": min(ups),
                                "max": max(ups), "n": len(ups)} if ups else None,
            "wall_s": [round(r["wall_s"], 1) for r in mine],
            "phase_mean_s": {k: round(statistics.fmean(r["phase_mean_s"][k] for r in mine), 3)
                             for k in PHASES},
            "final_reward": [r["final_reward"] for r in mine],
            "cpu_busy_fraction": round(statistics.fmean(r["cpu_busy_fraction"] for r in mine),
                                       3)}
    bounds = [r["wall_s"] / max(sum(r["cpu_s"].values()) / cores, r["train_push_s"])
              for r in sync.values()]
    out["modelled_bound_speedup"] = round(statistics.median(bounds), 3) if bounds else None
    rewards = [r["final_reward"] for r in sync.values() if r["final_reward"] is not None]
    if rewards:
        lo, hi = min(rewards), max(rewards)
        out["sync_final_reward_spread"] = [lo, hi]
        out["final_reward_within_sync_spread"] = {
            m: all(lo <= x <= hi for x in out[m]["final_reward"] if x is not None)
            for m in out if isinstance(out.get(m), dict) and m != "sync"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="K: trainer steps per run")
    ap.add_argument("--tasks-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16, help="harness runs at once")
    ap.add_argument("--latencies", type=lambda v: [float(x) for x in v.split(",")],
                    default=[2.0, 8.0], help="tool step medians (s), comma-separated")
    ap.add_argument("--sigma", type=float, default=1.2, help="tool step lognormal sigma")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per mode at each latency")
    ap.add_argument("--zero-latency-seeds", type=int, default=1, help="seeds per mode at 0 s")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--lr", type=float, default=4e-4,
                    help="the trainer's learning rate, below its 6e-4 default: the tiny model "
                         "tends to stop ending its answers under async/collocated training, "
                         "at 6e-4 from step 6, at 4e-4 later (docs/modes.md)")
    ap.add_argument("--modes", default=",".join(MODES))
    cores = sorted(os.sched_getaffinity(0))
    last = str(cores[-1])
    ap.add_argument("--cpus-engine", default=str(cores[0]), help="CPU list of the engine")
    ap.add_argument("--cpus-trainer", default=str(cores[0]), help="CPU list of the trainer")
    ap.add_argument("--cpus-jobs", default=last, help="CPU list of the rollout jobs")
    ap.add_argument("--cpus-services", default=last,
                    help="CPU list of Redis, store, gateway and controller")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=Path(".harnessrl/bench-modes"))
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in OUT/results.json (same settings) and do the rest")
    a = ap.parse_args()
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
    results: list[dict[str, Any]] = []
    if a.resume and (a.out / "results.json").exists():
        results = json.loads((a.out / "results.json").read_text())
        print(f"resuming: {len(results)} runs kept from {a.out / 'results.json'}", flush=True)
    done = {(r["latency_median_s"], r["mode"], r["seed"]) for r in results}
    runs = [run for run in interleaved(a, a.modes.split(",")) if run not in done]
    used = {int(c) for cpus in (a.cpus_engine, a.cpus_trainer, a.cpus_jobs, a.cpus_services)
            for c in parse_cpu_list(cpus)}
    with Stack(cfg) as stack:
        for name, p in stack.procs.items():
            if p.proc is not None:
                pin(p.proc.pid, a.cpus_engine if name.startswith("engine") else a.cpus_services)
        for latency, mode, seed in runs:
            r = run_trainer(stack, a.out / f"{mode}-lat{latency}-seed{seed}", mode, latency,
                            a, model_dir, seed)
            results.append(r)
            (a.out / "results.json").write_text(json.dumps(results, indent=1))  # so far
            print(f"[{len(results)}/{len(runs) + len(done)}] latency {latency:>4} s  "
                  f"{mode:<10} seed {seed}  "
                  f"{r['steps']} steps in {r['wall_s']:7.1f} s  phases {r['phase_mean_s']}  "
                  f"reward {r['final_reward']}  dropped {r['groups_dropped']}  held "
                  f"{r['held_calls']}\n    CPU s over {r['process_s']:.0f} s "
                  f"(busy {r['cpu_busy_fraction']:.2f}): {r['cpu_s']}", flush=True)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    latencies = sorted({r["latency_median_s"] for r in results})
    per_latency = {str(lat): summary(results, lat, len(used)) for lat in latencies}
    png = a.out / "reward_vs_wall.png"
    plot(results, max(latencies), png)
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"load average before {load_before}, after {load_after}; figure {png}")
    print(json.dumps({
        "per_latency": per_latency, "steps": a.steps, "tasks_per_step": a.tasks_per_step,
        "group_size": a.group_size, "concurrency": a.concurrency, "sigma": a.sigma, "lr": a.lr,
        "cpus": {"engine": a.cpus_engine, "trainer": a.cpus_trainer, "jobs": a.cpus_jobs,
                 "services": a.cpus_services},
        "load_before": load_before, "load_after": load_after}))


if __name__ == "__main__":
    main()
