"""`harnessrl eval`: a model's pass@k on a task file, through the harness, grader and controller
that training uses.

    harnessrl eval                                   # the tiny model on examples/calc, k = 4
    harnessrl eval --model runs/x/checkpoints -k 8 --limit 32 --out after.json
    harnessrl eval --model http://127.0.0.1:8000/v1 --tasks t.jsonl --harness "..." --grader "..."
    harnessrl eval --compare before.json after.json

It starts what it needs as `harnessrl up` does (`harnessrl.local.stack`: Redis when none answers,
store, gateway, controller, and a vLLM engine unless the model is a URL) in `--state-dir`
(default `.harnessrl/eval`, apart from `up`'s), under a Redis key prefix of its own
(`eval-<nonce>:`), so it never meets another stack's runs. Then one controller run: every task
`k` times (`group_size` = k), published to no stream (`harnessrl.evaluation`), the sampling
settings imposed on every call by the gateway, each call recorded as in training. When the run
is done its rollouts are read from the store, scored (`harnessrl.passk`: the unbiased pass@k
estimator), and the stack is stopped.

The model (`--model`): nothing (the tiny model harnessrl builds), a Hugging Face model folder,
a trainer checkpoint (`.../checkpoints/step-000012`), a trainer's checkpoints folder or output
dir (its `latest` checkpoint), or the base URL of a running OpenAI-compatible engine (then no
engine is started; the served model name comes from its `/v1/models` unless `--model-name`).

Output: the result JSON (`--out`, default `<state-dir>/<run id>.json`; schema in
`harnessrl.evaluation`), an HTML page beside it (`harnessrl/local/report.py`), a table on the
terminal. A sample that failed (harness crash, grader error, timeout) counts as not passed with
reward 0 and is listed with its reason; it never fails the command. Exit status: 0 when the
run finished, 1 when it could not (the stack did not start, the run failed), 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from rich.console import Console
from rich.table import Table

from harnessrl import evaluation as ev
from harnessrl.config import mask_passwords
from harnessrl.engine_guard import process_key
from harnessrl.errors import InvalidArgument
from harnessrl.local import progress, sandbox_flags
from harnessrl.local.follow import follow_run
from harnessrl.sampling import unmatched
from harnessrl.tasks import load_task_file

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "calc"
SHOWN_TASKS = 40


class EvalError(Exception):
    """A problem with the options (exit status 2)."""


@dataclass
class ModelChoice:
    """What is evaluated: `model_dir` is served by an engine harnessrl starts, `url` is a
    running engine's root URL."""

    kind: str  # "base", "model_dir", "checkpoint" or "url"
    served_name: str
    model_dir: Path | None = None
    url: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "served_name": self.served_name, **self.info}
        if self.model_dir is not None:
            out["path"] = str(self.model_dir)
        if self.url:
            out["url"] = self.url
        return out


def engine_root(url: str) -> str:
    """`http://host:port/v1/` -> `http://host:port` (the gateway adds the API paths)."""
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def served_models(root: str) -> list[str]:
    resp = httpx.get(root + "/v1/models", timeout=10, auth=process_key())  # engine_guard.py
    resp.raise_for_status()
    return [m["id"] for m in resp.json().get("data", [])]


def resolve_model(arg: str | None, model_name: str | None) -> ModelChoice:
    """`--model` as a `ModelChoice` (EvalError naming what is wrong)."""
    if arg is None:
        return ModelChoice("base", model_name or "tiny")  # model_dir: built in `run`
    if arg.startswith(("http://", "https://")):
        root = engine_root(arg)
        if model_name:
            return ModelChoice("url", model_name, url=root)
        try:
            names = served_models(root)
        except (httpx.HTTPError, ValueError) as exc:
            raise EvalError(f"--model {arg}: no OpenAI-compatible engine answers at "
                            f"{root}/v1/models ({exc})") from None
        if not names:
            raise EvalError(f"--model {arg}: the engine serves no model")
        return ModelChoice("url", names[0], url=root)
    path = Path(arg).expanduser().resolve()
    if not path.is_dir():
        raise EvalError(f"--model {arg}: no such directory (give a model folder, a trainer "
                        "checkpoint or output dir, or an engine's URL)")
    if (path / "config.json").exists():
        kind = "checkpoint" if (path / "state.json").exists() else "model_dir"
        return ModelChoice(kind, model_name or "tiny", model_dir=path,
                           info=_checkpoint_info(path))
    from harnessrl.checkpoint_folders import latest_checkpoint

    for folder in (path, path / "checkpoints"):
        found = latest_checkpoint(folder) if (folder / "latest").exists() else None
        if found is not None:
            return ModelChoice("checkpoint", model_name or "tiny", model_dir=found.resolve(),
                               info=_checkpoint_info(found))
    raise EvalError(f"--model {arg}: neither a model folder (config.json) nor a trainer's "
                    "checkpoints (checkpoints/latest)")


def _checkpoint_info(path: Path) -> dict[str, Any]:
    """A trainer checkpoint's step and policy version (state.json), when it is one."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"step": state.get("step"), "policy_version": state.get("policy_version")}


def _max_model_len(model_dir: Path) -> int:
    """The stack's 32,768 positions, or fewer when the model has fewer."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        return min(32768, int(cfg.get("max_position_embeddings") or 32768))
    except (OSError, ValueError, TypeError):
        return 32768


@dataclass
class Options:
    tasks_file: Path
    tasks: list[tuple[str, dict[str, Any]]]
    tasks_in_file: int
    harness: list[str]
    grader: list[str]
    sampling: Any  # c.SamplingPolicy | None


def check_options(args: argparse.Namespace) -> Options:
    """The options, checked before anything starts (EvalError says what is wrong)."""
    if args.samples < 1:
        raise EvalError(f"-k/--samples must be >= 1 (got {args.samples})")
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be >= 1 (got {args.limit})")
    if args.tasks is None and args.harness:
        raise EvalError("--harness needs --tasks (the JSONL file of its tasks)")
    tasks_file = Path(args.tasks or EXAMPLE / "tasks.jsonl").expanduser().resolve()
    if not tasks_file.is_file():
        raise EvalError(f"--tasks {args.tasks}: no such file")
    try:
        tasks = load_task_file(tasks_file)
    except InvalidArgument as exc:
        raise EvalError(f"--tasks: {exc}") from None
    in_file = len(tasks)
    if args.limit is not None and args.limit < len(tasks):
        tasks = (random.Random(args.seed).sample(tasks, args.limit) if args.seed is not None
                 else tasks[:args.limit])
    harness = shlex.split(args.harness) if args.harness else \
        [sys.executable, str(EXAMPLE / "harness.py")]
    if args.grader is not None:
        grader = shlex.split(args.grader)
    else:
        grader = [] if args.harness else [sys.executable, str(EXAMPLE / "grader.py")]
    if not harness:
        raise EvalError("--harness is empty")
    sampling = ev.sampling_policy(args.temperature, args.top_p, args.max_tokens)
    if sampling is not None and (problem := unmatched(sampling, ev.EVAL_STREAM)):
        raise EvalError(problem)
    try:
        sandbox_flags.fields(args)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    return Options(tasks_file, tasks, in_file, harness, grader, sampling)


def run(args: argparse.Namespace, console: Console) -> int:
    """`harnessrl eval` without --compare."""
    try:
        opts = check_options(args)
        model = resolve_model(args.model, args.model_name)
    except EvalError as exc:
        console.print(f"[red]harnessrl eval: {exc}", highlight=False)
        return 2
    from harnessrl.local.stack import Stack, StackConfig

    t_start = time.monotonic()
    timings: dict[str, float] = {}
    if model.kind == "base":
        from harnessrl.model.build import build_tiny_model, default_model_dir

        with progress.phase(console, "building the tiny model (cached after the first time)",
                            240):
            model.model_dir = build_tiny_model(default_model_dir())
        timings["model_s"] = time.monotonic() - t_start
    state = Path(args.state_dir).resolve()
    nonce = uuid.uuid4().hex[:8]
    cfg = StackConfig(state_dir=state, redis_url=args.redis_url, key_prefix=f"eval-{nonce}:",
                      model_dir=model.model_dir, served_model_name=model.served_name,
                      external_engines=(model.url,) if model.url else (),
                      weight_transfer_backend=None,
                      max_model_len=_max_model_len(model.model_dir) if model.model_dir
                      else 32768)
    stack = Stack(cfg)
    run_id = f"eval-{nonce}"
    try:
        t0 = time.monotonic()
        what = "starting Redis, store, gateway, controller" + (
            "" if model.url else " and vLLM (about a minute)")
        try:
            with progress.phase(console, what, None if model.url else 90):
                stack.start()
        except Exception as exc:  # noqa: BLE001 - reported, exit 1
            console.print(f"[red]harnessrl eval: the stack did not start: {exc}",
                          highlight=False)
            return 1
        timings["start_s"] = time.monotonic() - t0
        result = _evaluate(stack, args, opts, model, run_id, timings, console)
    finally:
        with progress.phase(console, "stopping services"):
            stack.stop()
    if result is None:
        return 1
    timings["total_s"] = time.monotonic() - t_start
    result["timings"] = {k: round(v, 3) for k, v in timings.items()}
    out = Path(args.out).resolve() if args.out else state / f"{run_id}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_result(result, console)
    from harnessrl.local.report import write_eval_report

    page = write_eval_report([(out.name, result)], Path(args.html) if args.html
                             else out.with_suffix(".html"))
    console.print(f"result: {out}\npage:   {page}\nrollout workdirs (harness and grader "
                  f"output): {state / 'rollouts' / run_id}", highlight=False, soft_wrap=True)
    return 0


def _evaluate(stack: Any, args: argparse.Namespace, opts: Options, model: ModelChoice,
              run_id: str, timings: dict[str, float], console: Console
              ) -> dict[str, Any] | None:
    from harnessrl.clients import ControllerClient, StoreClient
    from harnessrl.v1 import common_pb2 as c

    spec = ev.eval_spec(name="eval", tasks=opts.tasks, k=args.samples,
                        harness_command=opts.harness, grader_command=opts.grader,
                        model=model.served_name, sampling=opts.sampling,
                        concurrency=args.concurrency, timeout_s=args.timeout,
                        max_attempts=args.attempts)
    sandbox_flags.apply(spec, args, hide=[str(opts.tasks_file)])
    started = time.time()
    t0 = time.monotonic()
    ctl = ControllerClient.connect(stack.controller_address)
    try:
        ctl.create_run(spec, run_id=run_id)
    except grpc.RpcError as exc:  # INVALID_ARGUMENT, with what is wrong
        console.print(f"[red]harnessrl eval: the controller refused the run: "
                      f"{exc.code().name}: {exc.details()}", highlight=False)
        return None
    finally:
        ctl.close()
    progress.line(console, f"[harnessrl] eval run {run_id}: {len(opts.tasks)} tasks x "
                  f"{args.samples} samples, model {model.served_name} ({model.kind})")
    done = follow_run(stack.controller_address, run_id, console)
    timings["rollouts_s"] = time.monotonic() - t0
    if done.status not in (c.RUN_STATUS_SUCCEEDED, c.RUN_STATUS_CANCELLED):
        console.print(f"[red]harnessrl eval: run {run_id} ended "
                      f"{c.RunStatus.Name(done.status)}: {done.error}", highlight=False)
        return None
    store = StoreClient.connect(stack.store_address)
    try:
        rollouts = store.list_rollouts(run_id).rollouts
    finally:
        store.close()
    return ev.build_result(
        model=model.describe(), tasks_file=opts.tasks_file, tasks_in_file=opts.tasks_in_file,
        task_ids=[tid for tid, _ in opts.tasks], rollouts=rollouts, k=args.samples,
        threshold=args.threshold, harness=opts.harness, grader=opts.grader,
        sampling=opts.sampling, run_id=run_id, started_at=started, timings=timings,
        limit=args.limit, seed=args.seed, grader_output=ev.read_grader_output,
        store={"redis_url": mask_passwords(stack.redis_url),
               "key_prefix": stack.cfg.key_prefix})


# -- showing and comparing results -------------------------------------------------------------

def load_result(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise EvalError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != ev.FORMAT:
        raise EvalError(f"{path}: not a harnessrl eval result (format {ev.FORMAT!r})")
    return data


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _short(text: str, n: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def print_result(r: dict[str, Any], console: Console) -> None:
    m = r["metrics"]
    head = Table(title=f"eval {r['run_id']}: {r['model'].get('kind')} "
                       f"{r['model'].get('path') or r['model'].get('url') or ''}",
                 title_justify="left")
    for name in (*m, "samples", "failed", "calls/sample"):
        head.add_column(name, justify="right")
    head.add_row(*(_fmt(v) for v in m.values()), str(r["samples"]), str(r["samples_failed"]),
                 f"{r['calls_mean']:.2f}")
    console.print(head)
    table = Table(title=f"{r['tasks_evaluated']} of {r['tasks_in_file']} tasks of "
                        f"{r['tasks_file']}, k = {r['k']}", title_justify="left")
    for col in ("task", "passed", "rewards", "failures"):
        table.add_column(col, justify="left" if col in ("task", "failures") else "right")
    for t in r["tasks"][:SHOWN_TASKS]:
        fails = t["failures"]
        table.add_row(t["task_id"], f"{t['c']}/{t['n']}",
                      " ".join("x" if x is None else f"{x:g}" for x in t["rewards"]),
                      f"{len(fails)}: {_short(fails[0]['reason'])}" if fails else "")
    if len(r["tasks"]) > SHOWN_TASKS:
        table.caption = f"... {len(r['tasks']) - SHOWN_TASKS} more tasks in the JSON"
    console.print(table)
    if r["samples_failed"]:
        console.print(f"[yellow]{r['samples_failed']} of {r['samples']} samples failed "
                      "(counted as not passed, reward 0; reasons in the JSON's tasks[]."
                      "failures)", highlight=False)


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two results side by side: per metric A, B and B - A; per task in both, c/n and the
    change of its pass@1; what differs in how they were made (warnings)."""
    names = list(dict.fromkeys([*a["metrics"], *b["metrics"]]))
    metrics = {n: {"a": a["metrics"].get(n), "b": b["metrics"].get(n),
                   "diff": (b["metrics"][n] - a["metrics"][n])
                   if n in a["metrics"] and n in b["metrics"] else None} for n in names}
    ta = {t["task_id"]: t for t in a["tasks"]}
    tb = {t["task_id"]: t for t in b["tasks"]}
    tasks = [{"task_id": tid, "a": f"{ta[tid]['c']}/{ta[tid]['n']}",
              "b": f"{tb[tid]['c']}/{tb[tid]['n']}",
              "diff_pass@1": tb[tid]["pass@1"] - ta[tid]["pass@1"]}
             for tid in ta if tid in tb]
    warnings = []
    for key, what in (("tasks_sha256", "task files"), ("k", "k"), ("sampling", "sampling"),
                      ("harness", "harnesses"), ("grader", "graders"),
                      ("threshold", "thresholds")):
        if a.get(key) != b.get(key):
            warnings.append(f"the {what} differ: {a.get(key)} vs {b.get(key)}")
    only_a = [t for t in ta if t not in tb]
    only_b = [t for t in tb if t not in ta]
    if only_a or only_b:
        warnings.append(f"{len(only_a)} tasks only in A, {len(only_b)} only in B (compared: "
                        f"the {len(tasks)} in both)")
    return {"metrics": metrics, "tasks": tasks, "only_a": only_a, "only_b": only_b,
            "warnings": warnings}


def print_compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str],
                  diff: dict[str, Any], console: Console) -> None:
    head = Table(title=f"A = {names[0]} ({a['model'].get('kind')}), B = {names[1]} "
                       f"({b['model'].get('kind')})", title_justify="left")
    for col in ("metric", "A", "B", "B - A"):
        head.add_column(col, justify="left" if col == "metric" else "right")
    for n, row in diff["metrics"].items():
        d = row["diff"]
        head.add_row(n, _fmt(row["a"]), _fmt(row["b"]), "-" if d is None else f"{d:+.3f}")
    console.print(head)
    table = Table(title="per task (passed / samples)", title_justify="left")
    for col in ("task", "A", "B", "pass@1 B - A"):
        table.add_column(col, justify="left" if col == "task" else "right")
    for t in diff["tasks"][:SHOWN_TASKS]:
        table.add_row(t["task_id"], t["a"], t["b"], f"{t['diff_pass@1']:+.2f}")
    if len(diff["tasks"]) > SHOWN_TASKS:
        table.caption = f"... {len(diff['tasks']) - SHOWN_TASKS} more tasks"
    console.print(table)
    for w in diff["warnings"]:
        console.print(f"[yellow]note: {w}", highlight=False)


def run_compare(args: argparse.Namespace, console: Console) -> int:
    try:
        a, b = (load_result(p) for p in args.compare)
    except EvalError as exc:
        console.print(f"[red]harnessrl eval --compare: {exc}", highlight=False)
        return 2
    diff = compare(a, b)
    names = (Path(args.compare[0]).name, Path(args.compare[1]).name)
    print_compare(a, b, names, diff, console)
    if args.out:
        Path(args.out).write_text(json.dumps({"a": str(args.compare[0]),
                                              "b": str(args.compare[1]), **diff},
                                             indent=1) + "\n")
    if args.html:
        from harnessrl.local.report import write_eval_report

        page = write_eval_report([(names[0], a), (names[1], b)], Path(args.html))
        console.print(f"page: {page}", highlight=False)
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `eval` verb's flags (cli.py calls this)."""
    p = sub.add_parser("eval", help="pass@k of a model on a task file, through the harness, "
                       "grader and controller of training (see docs/evaluation.md)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="what to evaluate: a model folder, a trainer "
                   "checkpoint or output dir (its latest checkpoint), or a running engine's "
                   "base URL (http://host:port/v1); default: the tiny model")
    p.add_argument("--model-name", default=None, help="model name to serve it as / that the "
                   "engine at the URL serves (default: tiny; for a URL, its first /v1/models)")
    p.add_argument("--tasks", default=None, help="JSONL task file (default: examples/calc's)")
    sandbox_flags.add(p)
    p.add_argument("--harness", default=None, help="harness command line (default: the calc "
                   "example's)")
    p.add_argument("--grader", default=None, help="grader command line; its last stdout line "
                   "is {\"reward\": x} (default: the calc example's with the default harness; "
                   "with --harness and no --grader the harness reports its reward)")
    p.add_argument("-k", "--samples", type=int, default=4, help="samples per task: pass@1.."
                   "pass@k and avg@k")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature "
                   "imposed on every call (default: the harness's own)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus imposed on every call")
    p.add_argument("--max-tokens", type=int, default=None, help="completion tokens per call "
                   "at most")
    p.add_argument("--limit", type=int, default=None, help="evaluate N tasks only (the first "
                   "N; with --seed, N drawn at random by that seed)")
    p.add_argument("--seed", type=int, default=None, help="seed of the --limit draw (the "
                   "engine's sampling itself is not seeded)")
    p.add_argument("--threshold", type=float, default=1.0, help="a sample passes when its "
                   "reward >= this")
    p.add_argument("--concurrency", type=int, default=8, help="harness runs at once")
    p.add_argument("--timeout", type=float, default=300, help="per-attempt harness timeout (s)")
    p.add_argument("--attempts", type=int, default=1, help="attempts per sample (an "
                   "infrastructure failure is retried)")
    p.add_argument("--out", default=None, help="result JSON (default: STATE_DIR/<run>.json); "
                   "with --compare, the comparison as JSON")
    p.add_argument("--html", default=None, help="HTML page (default: beside --out; with "
                   "--compare: only when given)")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="compare two results side by side (starts nothing)")
    p.add_argument("--state-dir", default=".harnessrl/eval", help="state directory of the "
                   "evaluation's stack (logs, rollout workdirs, results)")
    p.add_argument("--redis-url", default=None, help="Redis to use, as given (one is started "
                   "there when none answers on this machine); default: a Redis of the "
                   "evaluation's own, with a password")
    return p


def cmd_eval(args: argparse.Namespace, console: Console) -> int:
    return run_compare(args, console) if args.compare else run(args, console)
