"""The training part of `harnessrl up`: runs the trainer service against a started `Stack`,
shows live progress, and ends with a summary (reward curve as PNG and in the terminal, where
the checkpoint is, how to resume, how to use a real model on a GPU)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from harnessrl import procs
from harnessrl.stack import Stack


def _read_metrics(path: Path) -> list[dict]:  # type: ignore[type-arg]
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return rows


def _progress_table(rows: list[dict], steps: int, started: float) -> Table:  # type: ignore[type-arg]
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
    return table


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


def run_training(stack: Stack, model_dir: Path, args: argparse.Namespace,
                 console: Console) -> int:
    out = Path(args.output_dir or (stack.state / "train")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ready = stack.logs / "trainer.ready"
    argv = procs.python_module(
        "services.trainer", "--model-path", str(model_dir), "--output-dir", str(out),
        "--store-address", stack.store_address, "--controller-address",
        stack.controller_address, "--gateway-admin-address", stack.gateway_admin_address,
        "--served-model-name", stack.cfg.served_model_name, "--bind", "127.0.0.1:0",
        "--ready-file", str(ready), "--resume" if args.resume else "--no-resume",
        "--push.backend", stack.cfg.weight_transfer_backend or "gloo",
        "--device", "cuda" if stack.cfg.weight_transfer_backend == "nccl" else "cpu")
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if getattr(args, "mode", "sync") != "sync":
        argv += ["--mode.kind", args.mode]
    if not args.resume and (out / "checkpoints").exists():
        console.print(f"[yellow]{out}/checkpoints exists; starting over (pass --resume to "
                      "continue from it)")
        import shutil
        shutil.rmtree(out / "checkpoints")
        (out / "metrics.jsonl").unlink(missing_ok=True)
    trainer = procs.ServiceProcess("trainer", argv, stack.logs, ready_file=ready).start()
    stack.procs["trainer"] = trainer
    metrics = out / "metrics.jsonl"
    started = time.monotonic()
    steps = args.steps or _default_steps()
    with Live(_progress_table([], steps, started), console=console, refresh_per_second=2) as live:
        while trainer.alive:
            live.update(_progress_table(_read_metrics(metrics), steps, started))
            time.sleep(1.0)
        live.update(_progress_table(_read_metrics(metrics), steps, started))
    rows = _read_metrics(metrics)
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
    latest = out / "checkpoints" / "latest"
    ckpt = latest.resolve() if latest.exists() else out / "checkpoints"
    console.print(f"""
[bold]done[/bold]: {len(rows)} steps in {time.monotonic() - started:.0f}s; mean reward of the first 5 steps {sum(first) / max(1, len(first)):.3f}, of the last 5 {sum(last) / max(1, len(last)):.3f}
reward curve: {png}
metrics:      {metrics}
checkpoint:   {ckpt}  (Hugging Face format: loads in transformers and vLLM as is)
logs:         {stack.logs}
resume:       harnessrl up --resume --steps {len(rows) + 10} --output-dir {out}
a real model on a GPU: bash scripts/setup.sh installs vLLM for CUDA where nvidia-smi works; then
              harnessrl up --model-dir /path/to/hf-model (e.g. a Qwen3 checkpoint) --output-dir runs/x
              the engine and the trainer then use NCCL for the weight push (see README).""")
    return 0


def _default_steps() -> int:
    from services.trainer.config import TrainerConfig

    return int(TrainerConfig.model_fields["steps"].default)
