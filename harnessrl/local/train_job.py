"""The training part of `harnessrl up`: runs the trainer service against a started `Stack`,
shows live progress, and ends with a summary (reward curve as PNG and in the terminal, where
the checkpoint is, how to resume, how to use a real model on a GPU)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from harnessrl import procs
from harnessrl.checkpoint_folders import latest_checkpoint
from harnessrl.local import progress, sandbox_flags, tampered_flags
from harnessrl.local.progress import fmt_s
from harnessrl.local.engine import LoraEngine
from harnessrl.local.stack import Stack

# `harnessrl up --lora-rank`'s learning rate (full fine-tuning's default is 6e-4): 5x, tuned on
# the calculator example at rank 8, alpha 16; 10x broke the tool-call format (docs/lora.md)
UP_LR = 3e-3
STEPS = 24  # the trainer's default steps (TrainerConfig.steps): it trains them without --steps


def _read_metrics(path: Path, kind: str = "step") -> list[dict]:  # type: ignore[type-arg]
    """metrics.jsonl's step lines, or (kind "eval") its evaluation lines."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if (row.get("kind") == "eval") == (kind == "eval"):
            rows.append(row)
    return rows


def eval_text(r: dict) -> str:  # type: ignore[type-arg]
    """An evaluation line of metrics.jsonl in a few words."""
    metrics = ", ".join(f"{k} {v:.3f}" for k, v in r.items()
                        if (k.startswith("pass@") or k.startswith("avg@")) and v is not None)
    return (f"eval at step {r['step']} (version {r['policy_version']}): {metrics}; "
            f"{r['samples_failed']} of {r['samples']} samples failed, {r['eval_s']:.0f}s")


def _progress_table(rows: list[dict], steps: int, started: float,  # type: ignore[type-arg]
                    evals: tuple[dict, ...] = ()) -> Table:  # type: ignore[type-arg]
    table = Table(title=f"training: step {len(rows)}/{steps}  "
                        f"({time.monotonic() - started:.0f}s)", expand=False)
    for col in ("step", "version", "reward", "loss", "kl", "clip", "entropy", "tokens",
                "step s"):
        table.add_column(col, justify="right")

    def f(v: object, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows[-12:]:
        table.add_row(str(r["step"]), str(r["policy_version"]), f(r.get("reward_mean"), ".3f"),
                      f(r.get("loss"), ".4f"), f(r.get("kl"), ".4f"),
                      f(r.get("clip_fraction"), ".3f"), f(r.get("entropy"), ".3f"),
                      str(r.get("tokens", "-")), f(r.get("step_time_s"), ".1f"))
    if evals:
        table.caption = eval_text(evals[-1])
    return table


def step_line(r: dict, steps: int, started: float, rows: list[dict]) -> str:  # type: ignore[type-arg]
    """A training step as one plain log line, with elapsed time and ETA."""
    el = time.monotonic() - started
    left = (steps - r["step"]) * el / max(1, len(rows))
    rew = r.get("reward_mean")
    return (f"[harnessrl] training: step {r['step']}/{steps}, reward "
            f"{'-' if rew is None else format(rew, '.3f')}, version {r['policy_version']}, "
            f"{r.get('step_time_s', 0):.1f}s; {fmt_s(el)} elapsed, ETA {fmt_s(left)}")


def plot_rewards(rows: list[dict], png: Path) -> None:  # type: ignore[type-arg]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows if r.get("reward_mean") is not None]
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("harnessrl: reward on examples/calc")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def terminal_plot(rows: list[dict]) -> str:  # type: ignore[type-arg]
    import plotext as plt

    steps = [r["step"] for r in rows if r.get("reward_mean") is not None]
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    fig = plt.figure  # plotext 6 API: one figure object, signals drawn onto it
    fig.clear()
    fig.draw(fig.signal(steps, rewards, marker="dot"))
    fig.title("mean reward per step")
    fig.label("step", axis="x")
    fig.plot_size(70, 15)
    return str(plt.uncolorize(str(fig.build())))  # plain text: rich would garble ANSI codes


def group_grader(stack: Stack, args: argparse.Namespace) -> list[str]:
    """`--group-grader`, or with `--judge` the built-in judge on the stack's first engine
    (reached directly, not through the gateway: its calls are never recorded)."""
    if not getattr(args, "judge", False):
        return shlex.split(getattr(args, "group_grader", "") or "")
    config = getattr(args, "judge_config", "")
    return [sys.executable, "-m", "harnessrl.graders.judge", "--base-url",
            stack.engines[0].openai_base_url, "--model", stack.cfg.served_model_name,
            *(["--config", str(Path(config).resolve())] if config else [])]


def lora_engine(args: argparse.Namespace, model_dir: Path | None, state: Path
                ) -> LoraEngine | None:
    """`--lora-rank N`: the engines serve runtime-loaded adapters, base calls through a zero
    adapter written for the model (docs/lora.md); slots for one run's versions in flight."""
    rank = getattr(args, "lora_rank", 0)
    if not rank or model_dir is None:
        return None
    from harnessrl.lora_adapters import LoraConfig, write_zero_adapter

    zero = write_zero_adapter(model_dir, LoraConfig(rank=rank), state / "lora-zero")
    return LoraEngine(max_rank=max(16, rank), max_loras=4, zero_adapter=zero)


def start_trainer(stack: Stack, model_dir: Path, args: argparse.Namespace,
                  console: Console) -> procs.ServiceProcess:
    """Starts the trainer service against the stack, under its supervisor (restarted with
    --resume when it fails), on a port chosen once."""
    out = Path(args.output_dir or (stack.state / "train")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ready = stack.logs / "trainer.ready"
    argv = procs.python_module(
        "services.trainer", "--model-path", str(model_dir), "--output-dir", str(out),
        "--store-address", stack.store_address, "--controller-address",
        stack.controller_address, "--gateway-admin-address", stack.gateway_admin_address,
        "--served-model-name", stack.cfg.served_model_name,
        "--bind", f"127.0.0.1:{procs.free_port()}",
        "--ready-file", str(ready), "--resume" if args.resume else "--no-resume",
        "--push.backend", stack.cfg.weight_transfer_backend or "gloo",
        "--device", "cuda" if stack.cfg.weight_transfer_backend in ("nccl", "ipc") else "cpu")
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if getattr(args, "harness", None):  # the user's own harness, grader and tasks
        argv += ["--harness-command", json.dumps(shlex.split(args.harness)),
                 "--grader-command", json.dumps(shlex.split(args.grader or "")),
                 "--group-grader-command", json.dumps(group_grader(stack, args)),
                 "--tasks-file", str(Path(args.tasks).resolve()),
                 "--group-size", str(args.group_size), "--concurrency", str(args.concurrency),
                 "--rollout-timeout-s", str(args.timeout), "--max-attempts", str(args.attempts)]
    if hasattr(args, "no_sandbox"):  # the runs' sandbox and setup step (docs/sandbox.md)
        argv += sandbox_flags.trainer_flags(args)
    if hasattr(args, "tampered_rewards"):  # a tampered rollout's reward (--tampered-rewards)
        argv += tampered_flags.trainer_flags(args)
    if getattr(args, "tasks_per_step", None):
        argv += ["--tasks-per-step", str(args.tasks_per_step)]
    if getattr(args, "eval_tasks", None):  # evaluation during training (evaluation.py)
        argv += ["--eval.tasks-file", str(Path(args.eval_tasks).resolve()),
                 "--eval.every", str(args.eval_every), "--eval.k", str(args.eval_k)]
    if stack.cfg.weight_transfer_backend == "ipc" and not getattr(args, "lora_rank", 0):
        # one GPU: the engine sleeps while it steps (not with LoRA: it serves other runs)
        argv += ["--mode.sleep-level", "1"]
    if getattr(args, "lora_rank", 0):
        argv += ["--lora.rank", str(args.lora_rank), "--lora.alpha", str(2 * args.lora_rank)]
        if "HARNESSRL_TRAINER_OPTIMIZER__LR" not in os.environ:  # an adapter needs a larger lr
            argv += ["--optimizer.lr", str(UP_LR)]
    argv += list(getattr(args, "trainer_flags", None) or ())
    if getattr(args, "mode", "sync") != "sync":
        argv += ["--mode.kind", args.mode]
    if not args.resume and (out / "checkpoints").exists():
        console.print(f"[yellow]{out}/checkpoints exists; starting over (pass --resume to "
                      "continue from it)")
        import shutil
        shutil.rmtree(out / "checkpoints")
        shutil.rmtree(out / "eval", ignore_errors=True)  # the evaluations of that run
        (out / "metrics.jsonl").unlink(missing_ok=True)
    trainer = procs.ServiceProcess("trainer", argv, stack.logs, ready_file=ready,
                                   tls_root=stack.tls, env=stack.engine_env("trainer"))
    trainer.restart = "on-failure"  # exit 0: its steps are done
    trainer.restart_argv = [a if a != "--no-resume" else "--resume" for a in argv]
    trainer.start()
    stack.add(trainer)
    trainer.wait_ready(300)
    return trainer


def run_training(stack: Stack, model_dir: Path, args: argparse.Namespace,
                 console: Console) -> int:
    out = Path(args.output_dir or (stack.state / "train")).resolve()
    start_trainer(stack, model_dir, args, console)
    metrics = out / "metrics.jsonl"
    started = time.monotonic()
    steps = args.steps or STEPS
    sup = stack.supervisor

    def finished() -> bool:
        tr = stack.procs["trainer"]
        if sup is None:
            return not tr.alive
        return "trainer" in sup._done

    if console.is_terminal:
        with Live(_progress_table([], steps, started), console=console,
                  refresh_per_second=2) as live:
            while not finished():
                live.update(_progress_table(_read_metrics(metrics), steps, started,
                                            tuple(_read_metrics(metrics, "eval"))))
                time.sleep(1.0)
            live.update(_progress_table(_read_metrics(metrics), steps, started,
                                        tuple(_read_metrics(metrics, "eval"))))
    else:  # a log: one plain line per step, and a heartbeat while a step runs
        seen, beat, evals_seen = 0, time.monotonic(), 0
        while not finished():
            rows = _read_metrics(metrics)
            for r in rows[seen:]:
                progress.line(console, step_line(r, steps, started, rows))
            evals = _read_metrics(metrics, "eval")
            for r in evals[evals_seen:]:
                progress.line(console, f"[harnessrl] {eval_text(r)}")
            evals_seen = len(evals)
            if len(rows) > seen or time.monotonic() - beat > 30:
                if len(rows) == seen:
                    progress.line(console, f"[harnessrl] training: step {seen + 1}/{steps} "
                                  f"running, {fmt_s(time.monotonic() - started)} elapsed")
                seen, beat = len(rows), time.monotonic()
            time.sleep(1.0)
    rows = _read_metrics(metrics)
    trainer = stack.procs["trainer"]
    assert trainer.proc is not None
    if trainer.proc.returncode != 0:
        console.print(f"[red]trainer exited with {trainer.proc.returncode}; log "
                      f"{trainer.log_path}:\n{trainer.log_tail(30)}")
        return 1
    if not rows:
        console.print("[red]no step finished")
        return 1
    png = out / "reward_curve.png"
    plot_rewards(rows, png)
    console.print(terminal_plot(rows))
    first = [r["reward_mean"] for r in rows[:5] if r.get("reward_mean") is not None]
    last = [r["reward_mean"] for r in rows[-5:] if r.get("reward_mean") is not None]
    evals = _read_metrics(metrics, "eval")
    for r in evals:
        console.print(eval_text(r), markup=False, highlight=False, soft_wrap=True)
    if len(evals) >= 2:
        console.print(f"compare: harnessrl eval --compare {evals[0]['result']} "
                      f"{evals[-1]['result']}", markup=False, highlight=False, soft_wrap=True)
    ckpt = latest_checkpoint(out / "checkpoints") or out / "checkpoints"
    kind = ("a LoRA adapter: harnessrl export it, --merge for a merged model" if
            getattr(args, "lora_rank", 0) else
            "Hugging Face format: loads in transformers and vLLM as is")
    console.print(f"""
[bold]done[/bold]: {len(rows)} steps in {time.monotonic() - started:.0f}s; mean reward of the first 5 steps {sum(first) / max(1, len(first)):.3f}, of the last 5 {sum(last) / max(1, len(last)):.3f}
reward curve: {png}
metrics:      {metrics}
checkpoint:   {ckpt}  ({kind})
logs:         {stack.logs}
resume:       harnessrl up --resume --steps {len(rows) + 10} --output-dir {out}
a real model on a GPU: bash scripts/setup.sh installs vLLM for CUDA where nvidia-smi works; then
              harnessrl up --model-dir /path/to/hf-model (e.g. a Qwen3 checkpoint) --output-dir runs/x
              the engine and the trainer then use NCCL for the weight push (see docs/training.md).""")
    return 0
