"""`harnessrl` command line.

- `harnessrl up`: the main job. Starts everything on this machine (Redis if none answers,
  the tiny model, vLLM, store, gateway, controller) and runs the bundled example
  (`examples/calc`): with `--rollouts-only`, one run of tasks x n rollouts through the real
  harness; otherwise RL training (the trainer service) with live progress and a summary.
- `harnessrl build-model`: builds the tiny local model (cached).
- `harnessrl up --harness CMD [--grader CMD] --tasks FILE`: the same with your own harness.
- `harnessrl up --detach`: leaves the stack running in the background under its supervisor
  (which restarts what dies); `status`, `runs`, `rollouts RUN`, `show ROLLOUT`,
  `logs SERVICE`, `run` and `down` find it through `--state-dir` (default `.harnessrl`).
- `harnessrl run`: creates a run of your harness on a running stack and follows it.
- `harnessrl report RUN_DIR`: an HTML page of a training run (`harnessrl/local/report.py`).
- `harnessrl export CHECKPOINT --out DIR [--merge]`: a checkpoint as a LoRA adapter or a
  (merged) Hugging Face model (`harnessrl/local/export.py`).
- `harnessrl eval`: pass@k of a model (the tiny model, a checkpoint, a running engine) on a task
  file through the same harness, grader and controller (`harnessrl/local/evaluate.py`);
  `harnessrl eval --compare A.json B.json` puts two results side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from rich.table import Table

from harnessrl import identity
from harnessrl import log as hlog
from harnessrl.local import (evaluate, export, operate, progress, report, sandbox_flags,
                             tampered_flags)
from harnessrl.local.follow import follow_run
from harnessrl.v1 import common_pb2 as c

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "calc"
console = progress.cli_console()


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


def summarize_rollouts(store_address: str, run: c.Run) -> None:
    from harnessrl.clients import StoreClient

    store = StoreClient.connect(store_address)
    rollouts = store.list_rollouts(run.run_id, include_calls=True).rollouts
    store.close()
    table = Table(title=f"run {run.run_id}: {c.RunStatus.Name(run.status)}")
    for col in ("task", "rollouts", "mean reward", "calls", "completion tokens", "failed",
                "tampered"):
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
                      str(sum(r.status == c.ROLLOUT_STATUS_FAILED for r in ros)),
                      str(sum(r.tampered for r in ros)))
    console.print(table)


def user_spec(args: argparse.Namespace, name: str) -> c.RunSpec:
    """The run of the user's own harness (`--harness`, `--grader`, `--tasks FILE`)."""
    spec = c.RunSpec(name=name, tasks_file=str(Path(args.tasks).resolve()),
                     group_size=args.group_size, harness_command=shlex.split(args.harness),
                     grader_command=shlex.split(args.grader) if args.grader else [],
                     group_grader_command=shlex.split(args.group_grader or ""),
                     reward_source=(c.REWARD_SOURCE_GRADER_JSON if args.grader else
                                    c.REWARD_SOURCE_GROUP_GRADER if args.group_grader
                                    else c.REWARD_SOURCE_HARNESS),
                     concurrency=args.concurrency, timeout_s=args.timeout,
                     max_attempts=args.attempts, model=args.model_name)
    return tampered_flags.apply(sandbox_flags.apply(spec, args, hide=[args.tasks]), args)


def _load_config(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """`--config FILE` (YAML, TOML or JSON; keys are the flag names, `-` or `_`): its values
    apply where no flag was given."""
    if not getattr(args, "config", None):
        return
    from harnessrl.config import read_config_file

    for key, value in read_config_file(args.config).items():
        dest = key.replace("-", "_")
        if not hasattr(args, dest):
            raise SystemExit(f"{args.config}: unknown key {key!r}")
        if getattr(args, dest) == ap.get_default(dest):
            setattr(args, dest, value)


def cmd_up(args: argparse.Namespace) -> int:
    try:
        sandbox_flags.fields(args)
        tampered_flags.setting(args)
    except ValueError as exc:
        console.print(f"[red]{exc}")
        return 2
    if (args.harness is None) != (args.tasks is None):
        console.print("[red]--harness and --tasks go together (your harness command and a JSONL "
                      "file of its tasks); --grader is optional")
        return 2
    if args.harness and not (args.grader or args.group_grader or args.judge) and \
            not args.rollouts_only:
        console.print("[red]training your harness needs --grader (a command whose last stdout "
                      "line is {\"reward\": x}), --group-grader or --judge; --rollouts-only "
                      "runs it without one")
        return 2
    if args.judge and (args.group_grader or args.mode == "collocated" or args.rollouts_only):
        console.print("[red]--judge is the group grader (not with --group-grader); in "
                      "collocated mode the judge's calls to the training engine would wait "
                      "behind the hold they must end: use --mode sync or async, or a judge "
                      "engine of its own with --group-grader (--judge trains; with "
                      "--rollouts-only give --group-grader)")
        return 2
    if args.eval_tasks and not args.grader and (args.judge or args.group_grader):
        console.print("[red]--eval-tasks grades with the per-attempt --grader (evaluation runs "
                      "no group grader); give one, or evaluate with harnessrl eval --grader")
        return 2
    if args.lora_rank and (args.lora_rank < 0 or args.engine_url or args.rollouts_only):
        console.print("[red]--lora-rank N > 0 trains an adapter on engines harnessrl starts "
                      "with LoRA on (not with --engine-url or --rollouts-only)")
        return 2
    if args.eval_tasks and args.rollouts_only:
        console.print("[red]--eval-tasks evaluates during training; for an evaluation alone "
                      "use harnessrl eval")
        return 2
    if args.eval_tasks and not Path(args.eval_tasks).is_file():
        console.print(f"[red]--eval-tasks {args.eval_tasks}: no such file")
        return 2
    if args.eval_k < 1 or args.eval_every < 0:
        console.print("[red]--eval-k must be >= 1 and --eval-every >= 0")
        return 2
    if args.engine_url and not args.rollouts_only:
        console.print("[red]--engine-url is for --rollouts-only: the trainer pushes weights only "
                      "into engines harnessrl starts (with its weight-transfer backend)")
        return 2
    state = Path(args.state_dir).resolve()
    try:
        st = operate.load_state(state)
        console.print(f"[red]a stack is running in {state} already (supervisor pid "
                      f"{st['supervisor_pid']}); stop it with harnessrl down, or use another "
                      "--state-dir")
        return 1
    except operate.NoStack:
        pass
    if args.detach and not args.daemon:
        return operate.detach(args, state, console)
    return _up(args, state)


def _up(args: argparse.Namespace, state: Path) -> int:
    from harnessrl.model.build import build_tiny_model, default_model_dir
    from harnessrl.local.stack import Stack, StackConfig, default_weight_backend
    from harnessrl.local.train_job import lora_engine

    daemon = args.daemon
    # SIGTERM (`harnessrl down`, `kill`, `timeout`) stops everything on the way out, like Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0 if daemon else 128 + signal.SIGTERM))
    engines = tuple(args.engine_url or ())
    t0 = time.monotonic()
    if args.model_dir:  # the user's model, served and trained as it is (never rebuilt)
        given = Path(args.model_dir).resolve()
        if not engines and not (given / "config.json").is_file():
            console.print(f"[red]--model-dir {given} is not a model folder (no config.json)")
            return 2
        model_dir: Path | None = given
    else:
        with progress.phase(console, "building the tiny model (cached after the first time)",
                            240):
            model_dir = build_tiny_model(default_model_dir())
        console.print(f"model: {model_dir} ({time.monotonic() - t0:.0f}s)")
    cfg = StackConfig(state_dir=state, redis_url=args.redis_url,
                      model_dir=None if engines else model_dir,
                      served_model_name=args.model_name, external_engines=engines,
                      key_prefix=args.key_prefix, lora=lora_engine(args, model_dir, state),
                      weight_transfer_backend=default_weight_backend(getattr(args, "mode", "sync")))
    what = "starting Redis, store, gateway, controller" + (
        "" if engines else " and vLLM (about a minute)")
    stack = Stack(cfg)
    stack.cfg.model_dir = None if engines else model_dir
    try:
        with progress.phase(console, what, None if engines else 90):
            stack.start()
        stack.supervise(on_event=lambda ev: console.print(f"[harnessrl] supervisor: {ev.line()}",
                                                          markup=False, highlight=False))
        console.print(f"gateway {stack.gateway_url}  store {stack.store_address}  "
                      f"controller {stack.controller_address}  logs {stack.logs}")
        if args.rollouts_only:
            return _rollouts(stack, args, state, model_dir)
        from harnessrl.local.train_job import run_training, start_trainer
        assert model_dir is not None  # training starts its own engines (cmd_up checks)
        if daemon:
            start_trainer(stack, model_dir, args, console)
            _write_state(stack, args, state, model_dir)
            return _serve_until_down(stack)
        return run_training(stack, model_dir, args, console)
    finally:
        with progress.phase(console, "stopping services"):
            stack.stop()
        if daemon:
            (state / operate.STATE_FILE).unlink(missing_ok=True)


def _write_state(stack: object, args: argparse.Namespace, state: Path,
                 model_dir: Path | None, runs: tuple[str, ...] = ()) -> None:
    st = stack.addresses()  # type: ignore[attr-defined]
    st.update(state_dir=str(state), supervisor_pid=os.getpid(), started_at=time.time(),
              steps=args.steps, runs=list(runs), model_dir=str(model_dir or ""),
              procs={n: {"pid": p.proc.pid if p.proc else None, "log": str(p.log_path)}
                     for n, p in stack.procs.items()})  # type: ignore[attr-defined]
    operate.write_state(state, st)


def _serve_until_down(stack: object) -> int:
    """The detached supervisor's life after start-up: keeps stack.json's pids current until
    `harnessrl down` (SIGTERM)."""
    state = stack.state  # type: ignore[attr-defined]
    path = state / operate.STATE_FILE
    while True:
        time.sleep(1.0)
        st = json.loads(path.read_text())
        for n, p in list(stack.procs.items()):  # type: ignore[attr-defined]
            info = st["procs"].setdefault(n, {"log": str(p.log_path)})
            info["pid"] = p.proc.pid if p.proc else None
            sup = stack.supervisor  # type: ignore[attr-defined]
            if sup is not None and n in sup._done:
                info["exited"] = p.proc.returncode if p.proc else "?"
        operate.write_state(state, st)


def _rollouts(stack: object, args: argparse.Namespace, state: Path,
              model_dir: Path | None) -> int:
    from harnessrl.clients import ControllerClient

    ctl = ControllerClient.connect(stack.controller_address)  # type: ignore[attr-defined]
    spec = user_spec(args, "rollouts") if args.harness else tampered_flags.apply(
        sandbox_flags.apply(example_spec(args.num_tasks, args.group_size, args.concurrency,
                                         args.model_name), args,
                            hide=[str(EXAMPLE / "tasks.jsonl")]), args)
    run = ctl.create_run(spec)
    ctl.close()
    if args.daemon:
        _write_state(stack, args, state, model_dir, runs=(run.run_id,))
        return _serve_until_down(stack)
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

    if not args.harness or not args.tasks:
        console.print("[red]--harness and --tasks are required")
        return 2
    controller = args.controller
    if not controller:
        try:
            st = operate.load_state(Path(args.state_dir))
        except operate.NoStack as exc:
            console.print(f"[red]{exc} (or pass --controller HOST:PORT)")
            return 1
        controller = st["controller"]
        if args.model_name == "tiny":  # the default: the stack's own model name
            args.model_name = st.get("served_model_name", "tiny")
    try:
        spec = user_spec(args, args.name)
    except ValueError as exc:
        console.print(f"[red]{exc}")
        return 2
    ctl = ControllerClient.connect(controller)
    run = ctl.create_run(spec)
    ctl.close()
    console.print(f"run {run.run_id}")
    run = follow_run(controller, run.run_id)
    console.print(f"{c.RunStatus.Name(run.status)}: {run.num_succeeded} succeeded, "
                  f"{run.num_failed} failed, mean reward {run.mean_reward:.3f}"
                  + (f"; {run.num_tampered} TAMPERED (harnessrl rollouts {run.run_id})"
                     if run.num_tampered else ""))
    return 0 if run.status == c.RUN_STATUS_SUCCEEDED else 1


def _on_stack(fn):  # type: ignore[no-untyped-def]
    """A verb that needs the detached stack of --state-dir."""
    def run(args: argparse.Namespace) -> int:
        try:
            st = operate.load_state(Path(args.state_dir))
        except operate.NoStack as exc:
            console.print(f"[red]{exc}", markup=True)
            return 1
        return int(fn(st, args))
    return run


def cmd_down(args: argparse.Namespace) -> int:
    try:
        return operate.down(Path(args.state_dir), console)
    except operate.NoStack as exc:
        console.print(f"[red]{exc}")
        return 1


def _harness_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--harness", default=None, help="your harness command line (run once per "
                   "rollout with OPENAI_BASE_URL/OPENAI_API_KEY set; see "
                   "docs/getting-started.md)")
    p.add_argument("--grader", default="", help="grader command line, run after the harness; "
                   "its last stdout line is {\"reward\": x} (default: the harness reports its "
                   "reward through the gateway)")
    p.add_argument("--group-grader", default="", help="group grader command line, run once "
                   "per group after its rollouts ended (docs/judge.md)")
    p.add_argument("--judge", action="store_true", help="the group grader is the built-in judge "
                   "(harnessrl.graders.judge) on the training engine")
    p.add_argument("--judge-config", default="", help="--judge's settings: a JSON file of "
                   "JudgeConfig fields (rubric, score range, sampling; docs/judge.md)")
    p.add_argument("--tasks", default=None, help="JSONL file of tasks (one JSON object with an "
                   "\"id\" per line)")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per task")
    p.add_argument("--concurrency", type=int, default=8, help="harness runs at once")
    p.add_argument("--timeout", type=float, default=300, help="per-attempt harness timeout (s)")
    p.add_argument("--attempts", type=int, default=1, help="attempts per rollout")
    p.add_argument("--model-name", default="tiny", help="model name the engines serve")
    sandbox_flags.add(p)
    tampered_flags.add(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="harnessrl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    state_help = "state directory of the stack (logs, addresses, rollouts, Redis data)"

    up = sub.add_parser("up", help="start everything on this machine and train (see README)")
    up.add_argument("--config", default=None, help="YAML/TOML/JSON file with any of these "
                    "flags as keys (flags given on the command line win)")
    up.add_argument("--state-dir", default=".harnessrl", help=state_help)
    up.add_argument("--redis-url", default=None,
                    help="Redis to use, as given (credentials included; one is started there "
                    "when none answers on this machine); default: a Redis of the stack's own, "
                    "with a password (AOF on)")
    up.add_argument("--key-prefix", default="hrl:", help="prefix of this stack's Redis keys")
    up.add_argument("--model-dir", default=None, help="model to serve and train (default: the "
                    "tiny model, built on first use)")
    up.add_argument("--engine-url", action="append", default=None, help="use this running "
                    "OpenAI-compatible engine (vLLM) instead of starting one (repeatable; "
                    "--rollouts-only, since the trainer cannot push into it)")
    _harness_flags(up)
    up.add_argument("--rollouts-only", action="store_true",
                    help="one run of tasks x group-size rollouts through the harness, no "
                    "training")
    up.add_argument("--num-tasks", type=int, default=4, help="example tasks (--rollouts-only "
                    "without --harness)")
    up.add_argument("--tasks-per-step", type=int, default=None, help="tasks per training step")
    up.add_argument("--steps", type=int, default=None, help="training steps")
    up.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    up.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this "
                    "rank instead of every weight (docs/lora.md); 0: full fine-tuning")
    up.add_argument("--mode", choices=("sync", "async", "collocated"), default="sync",
                    help="training mode (docs/modes.md)")
    up.add_argument("--output-dir", default=None, help="checkpoints, metrics, reward curve")
    up.add_argument("--eval-tasks", default=None, help="evaluate during training on this JSONL "
                    "task file (held-out tasks): before the first step, every --eval-every "
                    "steps and after the last; pass@k into metrics.jsonl and the report")
    up.add_argument("--eval-every", type=int, default=0, help="--eval-tasks: evaluate after "
                    "every N-th step too (0: before and after training only)")
    up.add_argument("--eval-k", type=int, default=4, help="--eval-tasks: samples per task")
    up.add_argument("--detach", action="store_true", help="leave the stack running in the "
                    "background, supervised; the other verbs find it through --state-dir")
    up.add_argument("--start-timeout", type=float, default=900, help="--detach: give up when "
                    "the stack does not serve within this many seconds")
    up.add_argument("--daemon", action="store_true", help=argparse.SUPPRESS)
    up.set_defaults(fn=cmd_up)

    bm = sub.add_parser("build-model", help="build the tiny local model (cached)")
    bm.add_argument("--out", default=None)
    bm.add_argument("--untied", action="store_true")
    bm.set_defaults(fn=cmd_build_model)

    run = sub.add_parser("run", help="create a run of your harness on a running stack and "
                         "follow it")
    run.add_argument("--controller", default="", help="controller address (default: the "
                     "detached stack's, from --state-dir)")
    run.add_argument("--state-dir", default=".harnessrl", help=state_help)
    _harness_flags(run)
    run.add_argument("--name", default="run")
    run.set_defaults(fn=cmd_run)

    def verb(name: str, help: str, fn) -> argparse.ArgumentParser:  # type: ignore[no-untyped-def]
        p = sub.add_parser(name, help=help)
        p.add_argument("--state-dir", default=".harnessrl", help=state_help)
        p.set_defaults(fn=fn)
        return p

    verb("status", "services, engines and versions, runs, trainer step",
         _on_stack(lambda st, a: operate.status(st, console)))
    p = verb("runs", "runs in the store", _on_stack(lambda st, a: operate.runs(st, console,
                                                                               a.limit)))
    p.add_argument("--limit", type=int, default=50)
    p = verb("rollouts", "a run's rollouts: rewards, attempts, errors",
             _on_stack(lambda st, a: operate.rollouts(st, console, a.run)))
    p.add_argument("run")
    p = verb("show", "one rollout: each call's prompt and completion (from the recorded "
             "tokens), token counts, policy version, the harness's stdout and stderr",
             _on_stack(lambda st, a: operate.show(st, console, a.rollout)))
    p.add_argument("rollout")
    p = verb("logs", "a service's log (store, gateway, controller, trainer, engine0, redis, "
             "supervisor)", _on_stack(lambda st, a: operate.logs(st, console, a.service,
                                                                 a.lines, a.follow)))
    p.add_argument("service")
    p.add_argument("-n", "--lines", type=int, default=50)
    p.add_argument("-f", "--follow", action="store_true")
    verb("down", "stop the detached stack", cmd_down)

    evaluate.add_parser(sub).set_defaults(fn=lambda a: evaluate.cmd_eval(a, console))

    report.add_parser(sub).set_defaults(fn=lambda a: report.cmd_report(a, console))
    export.add_parser(sub).set_defaults(fn=lambda a: export.cmd_export(a, console))

    args = ap.parse_args(argv)
    args.argv = argv
    if args.cmd == "up":
        _load_config(args, up)
    hlog.setup("cli", "WARNING")
    _operator_identity(args)
    return int(args.fn(args))


def _operator_identity(args: argparse.Namespace) -> None:
    """The CLI calls the services as the operator identity of the stack in --state-dir (which
    `up` and `eval` make; harnessrl/local/stack.py `tls_root`), unless $HARNESSRL_TLS_DIR names
    another (docs/security.md)."""
    state = getattr(args, "state_dir", None)
    if state is None or os.environ.get(identity.TLS_DIR_ENV):
        return
    from harnessrl.local.stack import tls_root

    operator = tls_root(Path(state).resolve()) / "operator"
    if args.cmd in ("up", "eval") or operator.is_dir():
        os.environ[identity.TLS_DIR_ENV] = str(operator)


if __name__ == "__main__":
    sys.exit(main())
