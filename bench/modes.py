"""sync vs async vs collocated, side by side on this machine (docs/modes.md).

One stack (Redis, store, one vLLM engine on the project's tiny model, gateway, controller); for
each tool latency (the --latency median, then 0) and each mode, a fresh trainer on a fresh
output dir trains K steps of the bundled calc example whose harness has a slow tool step
(bench/_slow_tool_harness.py: lognormal, median --latency s, sigma --sigma). Same model, same
K x tasks_per_step x group_size trained rollouts, same harness concurrency in every mode.

Reported per run: wall time to K steps (from the start of step 1 to the end of step K),
speed-up over sync at the same latency, engine busy fraction (gateway: an engine had a call in
flight, sampled every 0.5 s), trainer busy fraction (train + push time over wall time), reward
of the last steps, staleness histogram over trained samples, groups dropped, and where the CPU
went (CPU seconds of each process tree: engine, rollout jobs, trainer, services). Then sync again
with --sync-seeds - 1 more seeds, for the spread its final reward has. Ends with one JSON line
and writes a PNG of reward against wall time (the --latency runs). Figures: docs/modes.md.

    python bench/modes.py --out /tmp/modes-bench     # 8 steps a run: ~50 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._procstat import children, proc_table  # noqa: E402
from harnessrl import procs  # noqa: E402
from harnessrl.local.stack import Stack, StackConfig  # noqa: E402

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


def run_trainer(stack: Stack, out: Path, mode: str, latency: float, a: argparse.Namespace,
                model_dir: Path, seed: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    name = f"{mode}-{str(latency).replace('.', 'p')}-s{seed}"
    argv = procs.python_module(
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
        "--mode.kind", mode, "--mode.max-staleness", str(a.max_staleness),
        "--rollout-timeout-s", "600", "--checkpoint-every", str(a.steps), "--no-resume")
    meter = CpuMeter(stack)
    cpu_before = meter.read()
    t0 = time.time()
    proc = procs.ServiceProcess(f"trainer-{name}", argv, out).start()
    assert proc.proc is not None
    rc = proc.proc.wait(a.timeout_s)
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
        if r["latency_median_s"] == latency and r["seed"] == results[0]["seed"]:
            xs = [x for x, y in r["curve"] if y is not None]
            ys = [y for _, y in r["curve"] if y is not None]
            ax.plot(xs, ys, marker="o", label=f"{r['mode']} ({r['wall_s']:.0f} s)")
    ax.set_xlabel("wall time since step 1 (s)")
    ax.set_ylabel("mean reward of the step")
    ax.set_title(f"calc example, tool step lognormal median {latency} s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="K: trainer steps per run")
    ap.add_argument("--tasks-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16, help="harness runs at once")
    ap.add_argument("--latency", type=float, default=2.0, help="tool step median (s)")
    ap.add_argument("--sigma", type=float, default=1.2, help="tool step lognormal sigma")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync-seeds", type=int, default=3,
                    help="sync runs at --latency with seeds seed, seed+1, ...: the spread of the "
                         "reward that the other modes' final reward is compared with")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--skip-zero-latency", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=Path(".harnessrl/bench-modes"))
    a = ap.parse_args()
    from harnessrl.model import build_tiny_model, default_model_dir

    model_dir = build_tiny_model(default_model_dir())
    a.out.mkdir(parents=True, exist_ok=True)
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    cfg = StackConfig(state_dir=a.out / "stack", redis_url=f"redis://127.0.0.1:"
                      f"{procs.free_port()}/0", key_prefix="bench-modes:", model_dir=model_dir,
                      served_model_name="tiny", weight_transfer_backend="gloo",
                      gateway_flags=("--hold-timeout-s", "600"))
    latencies = [a.latency] + ([] if a.skip_zero_latency or a.latency == 0 else [0.0])
    results: list[dict[str, Any]] = []
    runs = [(latency, mode, a.seed) for latency in latencies for mode in a.modes.split(",")]
    runs += [(a.latency, "sync", a.seed + k) for k in range(1, a.sync_seeds)]
    with Stack(cfg) as stack:
        for latency, mode, seed in runs:
            r = run_trainer(stack, a.out / f"{mode}-lat{latency}-seed{seed}", mode, latency,
                            a, model_dir, seed)
            results.append(r)
            (a.out / "results.json").write_text(json.dumps(results, indent=1))  # so far
            print(f"latency {latency:>4} s  {mode:<10} seed {seed}  {r['steps']} steps in "
                  f"{r['wall_s']:7.1f} s  engine busy {r['engine_busy_fraction'] or 0:.2f}  "
                  f"trainer busy {r['trainer_busy_fraction']:.2f}  reward "
                  f"{r['final_reward']}  staleness {r['staleness_hist']}  dropped "
                  f"{r['groups_dropped']}  held calls {r['held_calls']}\n"
                  f"    CPU s over {r['process_s']:.0f} s x {os.cpu_count()} cores "
                  f"(busy {r['cpu_busy_fraction']:.2f}): {r['cpu_s']}", flush=True)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]

    def wall(mode: str, latency: float) -> float | None:
        m = [r["wall_s"] for r in results if r["mode"] == mode and r["latency_median_s"] == latency
             and r["seed"] == a.seed]
        return m[0] if m else None

    def speedup(mode: str, latency: float) -> float | None:
        s, m = wall("sync", latency), wall(mode, latency)
        return s / m if s and m else None

    for latency in latencies:
        print(f"latency {latency} s: speed-up vs sync: async {speedup('async', latency)}, "
              f"collocated {speedup('collocated', latency)}")
    png = a.out / "reward_vs_wall.png"
    plot(results, a.latency, png)
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"load average before {load_before}, after {load_after}; figure {png}")
    sync_rewards = [r["final_reward"] for r in results if r["mode"] == "sync"
                    and r["latency_median_s"] == a.latency and r["final_reward"] is not None]
    spread = [min(sync_rewards), max(sync_rewards)] if sync_rewards else None

    def within(mode: str) -> bool | None:
        got = [r["final_reward"] for r in results if r["mode"] == mode and r["seed"] == a.seed
               and r["latency_median_s"] == a.latency]
        if not got or got[0] is None or spread is None:
            return None
        return spread[0] <= got[0] <= spread[1]

    print(f"sync final reward over {len(sync_rewards)} seeds: {spread}; within it: async "
          f"{within('async')}, collocated {within('collocated')}")
    print(json.dumps({
        "speedup_collocated_vs_sync": speedup("collocated", a.latency),
        "speedup_async_vs_sync": speedup("async", a.latency),
        "speedup_collocated_vs_sync_zero_latency": speedup("collocated", 0.0),
        "speedup_async_vs_sync_zero_latency": speedup("async", 0.0),
        "final_reward": {f"{r['mode']}@{r['latency_median_s']}"
                         + (f"/seed{r['seed']}" if r["seed"] != a.seed else ""): r["final_reward"]
                         for r in results},
        "sync_final_reward_spread": spread,
        "final_reward_within_sync_spread": {"async": within("async"),
                                            "collocated": within("collocated")},
        "steps": a.steps, "tasks_per_step": a.tasks_per_step, "group_size": a.group_size,
        "concurrency": a.concurrency, "load_before": load_before, "load_after": load_after}))


if __name__ == "__main__":
    main()
