"""`harnessrl` command line.

- `harnessrl up`: the main job. Starts everything on this machine (Redis if none answers,
  the tiny model, vLLM, store, gateway, controller) and runs the bundled example
  (`examples/calc`): with `--rollouts-only`, one run of tasks x n rollouts through the real
  harness; otherwise RL training (the trainer service) with live progress and a summary.
- `harnessrl build-model`: builds the tiny local model (cached).
- `harnessrl run`: creates a run on a running controller and follows it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harnessrl import log as hlog
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import controller_pb2 as cpb

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "calc"
console = Console()

TERMINAL = (c.ROLLOUT_STATUS_SUCCEEDED, c.ROLLOUT_STATUS_FAILED, c.ROLLOUT_STATUS_CANCELLED)


def example_spec(tasks: int, group_size: int, concurrency: int, model: str) -> c.RunSpec:
    lines = (EXAMPLE / "tasks.jsonl").read_text().splitlines()[:tasks]
    return c.RunSpec(
        name="calc-example",
        tasks=[c.Task(task_id=json.loads(line)["id"], data_json=line) for line in lines],
        group_size=group_size,
        harness_command=[sys.executable, str(EXAMPLE / "harness.py")],
        grader_command=[sys.executable, str(EXAMPLE / "grader.py")],
        reward_source=c.REWARD_SOURCE_GRADER_JSON, concurrency=concurrency, timeout_s=120,
        max_attempts=2, model=model)


def follow_run(controller_address: str, run_id: str) -> c.Run:
    """Shows a progress bar fed by WatchRun until the run ends; returns the final run."""
    from harnessrl.clients import ControllerClient

    ctl = ControllerClient.connect(controller_address)
    total = ctl.get_run(run_id).num_rollouts or None
    states: dict[str, int] = {}
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task("rollouts", total=total, detail="")
        for event in ctl.watch_run(run_id):
            if event.kind == cpb.RunEvent.KIND_RUN_DONE:
                break
            states[event.rollout.rollout_id] = event.rollout.status
            counts = Counter(states.values())
            progress.update(bar, completed=sum(counts[s] for s in TERMINAL),
                            detail=f"running {counts[c.ROLLOUT_STATUS_RUNNING]}  "
                                   f"failed {counts[c.ROLLOUT_STATUS_FAILED]}")
    run = ctl.get_run(run_id)
    ctl.close()
    return run


def summarize_rollouts(store_address: str, run: c.Run) -> None:
    from harnessrl.clients import StoreClient

    store = StoreClient.connect(store_address)
    rollouts = store.list_rollouts(run.run_id, include_calls=True).rollouts
    store.close()
    table = Table(title=f"run {run.run_id}: {c.RunStatus.Name(run.status)}")
    for col in ("task", "rollouts", "mean reward", "calls", "completion tokens", "failed"):
        table.add_column(col, justify="right" if col != "task" else "left")
    by_task: dict[str, list[c.Rollout]] = {}
    for ro in rollouts:
        by_task.setdefault(ro.task_id, []).append(ro)
    for task, ros in by_task.items():
        rewards = [r.reward for r in ros if r.has_reward]
        table.add_row(task, str(len(ros)),
                      f"{sum(rewards) / len(rewards):.2f}" if rewards else "-",
                      str(sum(len(r.calls) for r in ros)),
                      str(sum(len(x.completion_token_ids) for r in ros for x in r.calls)),
                      str(sum(r.status == c.ROLLOUT_STATUS_FAILED for r in ros)))
    console.print(table)


def cmd_up(args: argparse.Namespace) -> int:
    from harnessrl.model.build import build_tiny_model, default_model_dir
    from harnessrl.stack import Stack, StackConfig

    state = Path(args.state_dir).resolve()
    with console.status("building the tiny model (cached after the first time)"):
        t0 = time.monotonic()
        model_dir = build_tiny_model(args.model_dir or default_model_dir())
    console.print(f"model: {model_dir} ({time.monotonic() - t0:.0f}s)")
    cfg = StackConfig(state_dir=state, redis_url=args.redis_url, model_dir=model_dir,
                      served_model_name="tiny")
    with console.status("starting Redis, vLLM (about a minute), store, gateway, controller"):
        stack = Stack(cfg).start()
    try:
        console.print(f"gateway {stack.gateway_url}  store {stack.store_address}  "
                      f"controller {stack.controller_address}  logs {stack.logs}")
        if args.rollouts_only:
            return _rollouts(stack, args)
        from harnessrl.train_job import run_training
        return run_training(stack, model_dir, args, console)
    finally:
        with console.status("stopping services"):
            stack.stop()


def _rollouts(stack: "object", args: argparse.Namespace) -> int:
    from harnessrl.clients import ControllerClient

    ctl = ControllerClient.connect(stack.controller_address)  # type: ignore[attr-defined]
    run = ctl.create_run(example_spec(args.tasks, args.group_size, args.concurrency, "tiny"))
    ctl.close()
    run = follow_run(stack.controller_address, run.run_id)  # type: ignore[attr-defined]
    summarize_rollouts(stack.store_address, run)  # type: ignore[attr-defined]
    console.print(f"rollout workdirs (harness stdout/stderr, transcripts): "
                  f"{stack.state / 'rollouts' / run.run_id}")  # type: ignore[attr-defined]
    return 0 if run.status == c.RUN_STATUS_SUCCEEDED else 1


def cmd_build_model(args: argparse.Namespace) -> int:
    from harnessrl.model.build import build_tiny_model, default_model_dir

    out = build_tiny_model(args.out or default_model_dir(not args.untied),
                           tie_word_embeddings=not args.untied)
    print(out)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from harnessrl.clients import ControllerClient

    spec = c.RunSpec(name=args.name, tasks_file=str(Path(args.tasks).resolve()),
                     group_size=args.group_size, harness_command=args.harness.split(),
                     grader_command=args.grader.split() if args.grader else [],
                     reward_source=(c.REWARD_SOURCE_HARNESS if not args.grader
                                    else c.REWARD_SOURCE_GRADER_JSON),
                     concurrency=args.concurrency, timeout_s=args.timeout,
                     max_attempts=args.attempts, model=args.model)
    ctl = ControllerClient.connect(args.controller)
    run = ctl.create_run(spec)
    ctl.close()
    console.print(f"run {run.run_id}")
    run = follow_run(args.controller, run.run_id)
    console.print(f"{c.RunStatus.Name(run.status)}: {run.num_succeeded} succeeded, "
                  f"{run.num_failed} failed, mean reward {run.mean_reward:.3f}")
    return 0 if run.status == c.RUN_STATUS_SUCCEEDED else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="harnessrl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="run the main job on this machine (see README)")
    up.add_argument("--state-dir", default=".harnessrl", help="logs, secret, rollouts, Redis data")
    up.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                    help="Redis to use; one is started (AOF on) there when none answers")
    up.add_argument("--model-dir", default=None, help="model to serve and train (default: the "
                    "tiny model, built on first use)")
    up.add_argument("--rollouts-only", action="store_true",
                    help="one run of the example through the harness, no training")
    up.add_argument("--tasks", type=int, default=4, help="tasks (--rollouts-only)")
    up.add_argument("--group-size", type=int, default=4, help="rollouts per task")
    up.add_argument("--concurrency", type=int, default=8, help="harness runs at once")
    up.add_argument("--steps", type=int, default=None, help="training steps")
    up.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    up.add_argument("--mode", choices=("sync", "async", "collocated"), default="sync",
                    help="training mode (docs/modes.md)")
    up.add_argument("--output-dir", default=None, help="checkpoints, metrics, reward curve")
    up.set_defaults(fn=cmd_up)

    bm = sub.add_parser("build-model", help="build the tiny local model (cached)")
    bm.add_argument("--out", default=None)
    bm.add_argument("--untied", action="store_true")
    bm.set_defaults(fn=cmd_build_model)

    run = sub.add_parser("run", help="create a run on a running controller and follow it")
    run.add_argument("--controller", default="127.0.0.1:50053")
    run.add_argument("--tasks", required=True, help="JSONL file of tasks")
    run.add_argument("--harness", required=True, help="harness command line")
    run.add_argument("--grader", default="", help="grader command line (default: the harness "
                     "reports its reward through the gateway)")
    run.add_argument("--group-size", type=int, default=4)
    run.add_argument("--concurrency", type=int, default=4)
    run.add_argument("--timeout", type=float, default=300)
    run.add_argument("--attempts", type=int, default=1)
    run.add_argument("--model", default="tiny")
    run.add_argument("--name", default="run")
    run.set_defaults(fn=cmd_run)

    args = ap.parse_args(argv)
    hlog.setup("cli", "WARNING")
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
