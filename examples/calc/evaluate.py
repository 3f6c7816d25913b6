"""Measures a policy's mean reward on the calculator task by running the harness and the grader
directly against an OpenAI-compatible server (no gateway, no controller):

    python -m examples.calc.evaluate --base-url http://127.0.0.1:8000/v1 --model tiny-qwen3
    python -m examples.calc.evaluate            # builds the tiny model, starts vLLM on it

Prints per-outcome counts and ends with one JSON line: mean reward, share of runs whose first
reply was a well-formed calculator call on the right expression, calls per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness.py"
GRADER = HERE / "grader.py"


def task_env(task: dict[str, Any], base_url: str, model: str, api_key: str) -> dict[str, str]:
    """The environment the controller gives a harness run: API, model and the task (whole, and
    one `HARNESSRL_TASK_<FIELD>` per field)."""
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
           "HARNESSRL_MODEL": model, "HARNESSRL_TASK_JSON": json.dumps(task)}
    for k, v in task.items():
        env[f"HARNESSRL_TASK_{k.upper()}"] = v if isinstance(v, str) else json.dumps(v)
    return env


def run_once(task: dict[str, Any], workdir: Path, base_url: str, model: str,
             api_key: str = "dummy", timeout: float = 120.0) -> dict[str, Any]:
    """Harness then grader in `workdir`; returns reward, calls and exit codes."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = task_env(task, base_url, model, api_key)
    h = subprocess.run([sys.executable, str(HARNESS)], cwd=workdir, env=env,
                       capture_output=True, text=True, timeout=timeout)
    g = subprocess.run([sys.executable, str(GRADER)], cwd=workdir, env=env,
                       capture_output=True, text=True, timeout=timeout)
    transcript_path = workdir / "transcript.jsonl"
    transcript = ([json.loads(x) for x in transcript_path.read_text().splitlines()]
                  if transcript_path.exists() else [])
    first = transcript[0]["tool_calls"] if transcript else []
    right_call = bool(first) and first[0]["name"] == "calculator" and _expr(first[0]) == \
        task["expression"]
    return {"task": task["id"], "harness_rc": h.returncode, "harness_stderr": h.stderr[-2000:],
            "reward": json.loads(g.stdout.strip().splitlines()[-1])["reward"],
            "calls": len(transcript), "right_call": right_call,
            "answer": (workdir / "answer.txt").read_text() if (workdir / "answer.txt").exists()
            else None}


def _expr(call: dict[str, Any]) -> str | None:
    try:
        return json.loads(call["arguments"]).get("expression")
    except (json.JSONDecodeError, AttributeError):
        return None


def evaluate(base_url: str, model: str, tasks: list[dict[str, Any]], runs: int,
             concurrency: int) -> dict[str, Any]:
    picked = [tasks[i % len(tasks)] for i in range(runs)]
    with tempfile.TemporaryDirectory(prefix="calc-eval-") as tmp, \
            ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(
            lambda it: run_once(it[1], Path(tmp) / f"run-{it[0]}", base_url, model),
            enumerate(picked)))
    failed = [r for r in results if r["harness_rc"] != 0]
    if failed:
        raise RuntimeError(f"{len(failed)} harness runs failed; first: "
                           f"{failed[0]['harness_stderr']}")
    n = len(results)
    return {"runs": n, "mean_reward": sum(r["reward"] for r in results) / n,
            "right_tool_call": sum(r["right_call"] for r in results) / n,
            "calls_per_run": sum(r["calls"] for r in results) / n,
            "copy_style_answers": sum(bool(r["answer"]) and r["answer"].startswith("The answer")
                                      for r in results) / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="OpenAI-compatible API root (…/v1); default: start vLLM "
                   "on the tiny model")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="model folder to serve when no --base-url (default: the tiny model)")
    p.add_argument("--model", default=None, help="model name (default: the served tiny model)")
    p.add_argument("--tasks", type=Path, default=HERE / "tasks.jsonl")
    p.add_argument("--runs", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    a = p.parse_args()
    tasks = [json.loads(x) for x in a.tasks.read_text().splitlines() if x.strip()]
    engine = None
    base_url, model = a.base_url, a.model
    if base_url is None:
        from harnessrl.local.engine import start_engine
        from harnessrl.model.build import build_tiny_model, default_model_dir

        model_dir = a.model_dir or build_tiny_model(default_model_dir())
        engine = start_engine(model_dir, workdir=Path(tempfile.mkdtemp(prefix="calc-vllm-")))
        print(f"starting vLLM on {model_dir} (log {engine.log_path})", file=sys.stderr)
        engine.wait_healthy()
        base_url, model = engine.openai_base_url, model or engine.model_name
    try:
        summary = evaluate(base_url, model or "tiny-qwen3", tasks, a.runs, a.concurrency)
    finally:
        if engine is not None:
            engine.stop()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
