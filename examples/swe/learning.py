"""The swe example's learning proof, opt-in (not in CI): warm-up -> eval -> RL -> eval.

    python -m examples.swe.learning all --out .harnessrl/swe-learning [--seeds 0 1]
    python -m examples.swe.learning warmup|slice|eval|train ...   (one phase; see --help)

0. `tasks`: the slice's own flip-only task set (make_tasks, no cap per function).
1. `slice`: the tasks in the policy's slice (`examples/swe/policy.py`; checked by running the
   list move in each broken workspace), split by function: held out (the validation split's
   functions, then train-split functions until `--heldout-min`) and warm-up/RL (the rest),
   as full task files (setup step, grader) and rollout views (controller).
2. `warmup`: the warm-up dialogues (`examples/swe/dialogues.py`: mini-swe-agent's own messages
   for the policy's moves on the warm-up tasks and their variants, each with the right and the
   wrong fix, mixed `--right-fraction` : rest) and the swe model built on them
   (`harnessrl/model/swe_model.py`). `verify`: mini itself against the scripted engine.
3. `eval`: `harnessrl eval` of a model on the held-out slice, k samples a task, through
   mini-swe-agent (unchanged), the grader and the controller; also the share of mini's calls
   that continue a token segment (from the store's recorded calls).
4. `train`: `harnessrl up` with the swe setup step, harness and grader on the train slice's tasks.

Every phase prints one JSON line; `all` prints the summary (pass@1 before and after per seed,
the gain and its 95% confidence interval: a paired bootstrap over tasks, samples pooled over
seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.swe import dialogues as dialogues_mod  # noqa: E402
from examples.swe import policy  # noqa: E402
from examples.swe.run_record import segment_share  # noqa: E402
from harnessrl.local.report import read_jsonl  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def load(path: Path) -> list[dict[str, Any]]:
    from examples.swe.swe_tasks import load_swe_tasks

    return [t.model_dump() for t in load_swe_tasks(path)]


def phase_warmup(a: argparse.Namespace) -> dict[str, Any]:
    from harnessrl.model.swe_model import SweRecipe, build_swe_model

    t0 = time.monotonic()
    _, warm = split_slice(a)
    listings = json.loads((a.out / "slice-split.json").read_text())["listings"]
    dialogues, weights, counts = dialogues_mod.make_dialogues(
        warm, a.right_fraction, a.seed, policy.mini_templates(a.mini_config), a.renames,
        listings, a.op_variants, a.max_shift)
    t_dialogues = time.monotonic() - t0
    recipe = SweRecipe(seed=a.seed, warmup_steps=a.warmup_steps,
                       warmup_batch_size=a.batch_size, warmup_lr=a.lr,
                       vocab_size=a.vocab, hidden_size=a.hidden,
                       intermediate_size=4 * a.hidden,
                       num_layers=a.layers, num_heads=max(1, a.hidden // 64))
    # tokenizer: the dialogues and the numbers 0..999 (each one token: line numbers are
    # copied), not the libraries' sources (they hold the held-out functions' names, which
    # would become tokens that the warm-up never trains)
    from harnessrl.model.tokenizer import numbers_corpus

    out = build_swe_model(a.model_dir, dialogues, numbers_corpus(16), [policy.BASH_TOOL],
                          recipe, weights)
    info = json.loads((out / "recipe.json").read_text())
    return {"phase": "warmup", "model_dir": str(out), "train_slice_tasks": counts,
            "warmup_tasks": len(warm), "dialogues": len(dialogues),
            "dialogue_seconds": round(t_dialogues, 1),
            **{k: info[k] for k in ("parameters", "vocab", "dialogue_tokens",
                                    "final_warmup_loss", "build_seconds")}}


def write_slice(tasks: list[dict[str, Any]], out: Path, name: str) -> int:
    from examples.swe.swe_tasks import SweTask, rollout_view

    out.mkdir(parents=True, exist_ok=True)
    full = out / f"{name}.jsonl"
    full.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    views = []
    for t in tasks:
        v = rollout_view(SweTask.model_validate(t))
        views.append({"id": t["instance_id"], **v})
    (out / f"{name}.rollout.jsonl").write_text("".join(json.dumps(v) + "\n" for v in views))
    return len(tasks)


def slice_tasks(tasks: list[dict[str, Any]], mini_config: Path,
                ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The tasks in the policy's slice whose list move shows the broken line alone (run in
    each task's broken workspace, two at a time), and that output by instance_id."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from examples.swe.workspace import prepare_workspace

    templates = policy.mini_templates(mini_config)
    with tempfile.TemporaryDirectory(prefix="swe-slice-") as tmp:
        def check(t: dict[str, Any]) -> str | None:
            info = policy.in_slice(t)
            if info is None:
                return None
            ws = Path(tmp) / t["instance_id"]
            prepare_workspace(t, ws)
            env = policy.command_env(templates, t["problem_statement"],
                                     Path(tmp) / f"{t['instance_id']}.attempt")
            return policy.usable(t, info, ws, env)

        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(check, tasks))
    listings = {t["instance_id"]: o for t, o in zip(tasks, outs) if o is not None}
    return [t for t in tasks if t["instance_id"] in listings], listings


def split_slice(a: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(held-out, train) tasks of the slice. Held out: every slice task of the validation
    split's functions, then whole functions of the train split (in the order of a hash of
    library and function) until there are `--heldout-min` tasks; the warm-up and RL see only
    the other functions' tasks. (The validation split alone has too few flip_comparison
    tasks in the slice: its 30 % of the functions hold about 10.)"""
    import hashlib

    cache = a.out / "slice-split.json"
    if cache.exists():
        d = json.loads(cache.read_text())
        return d["heldout"], d["train"]
    flips = [t for s in ("val", "train") for t in load(a.tasks_dir / f"{s}.jsonl")
             if t.get("kind") == "flip_comparison"]
    usable, listings = slice_tasks(flips, a.mini_config)
    by_fn: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in usable:
        by_fn.setdefault((t["library"], t["function"]), []).append(t)
    held = [t for t in usable if t["split"] == "val"]
    train_fns = sorted({k for k, v in by_fn.items() if v[0]["split"] == "train"},
                       key=lambda k: hashlib.sha256(f"{k[0]}:{k[1]}".encode()).hexdigest())
    moved = []
    for fn in train_fns:
        if len(held) >= a.heldout_min:
            break
        held += by_fn[fn]
        moved.append(f"{fn[0]}:{fn[1]}")
    held_ids = {t["instance_id"] for t in held}
    train = [t for t in usable if t["instance_id"] not in held_ids]
    cache.write_text(json.dumps({"heldout": held, "train": train, "moved": moved,
                                 "listings": listings}))
    return held, train


def phase_slice(a: argparse.Namespace) -> dict[str, Any]:
    held, rl = split_slice(a)
    forms: dict[str, Any] = {}
    if a.rl_forms:  # the RL tasks also in their equivalent forms (examples/swe/rl_forms.py)
        from examples.swe.rl_forms import make_forms

        kept, dropped = make_forms(rl, a.out / "forms", a.mini_config)
        rl = rl + kept
        forms = {"rl_form_tasks": len(kept), "rl_forms_dropped": dropped}
    write_slice(held, a.out, "heldout")
    write_slice(rl, a.out, "rl-train")
    write_slice(held + rl, a.out, "all")  # full records: the setup step and the grader
    fns_val = {(t["library"], t["function"]) for t in held}
    fns_train = {(t["library"], t["function"]) for t in rl}
    assert not fns_val & fns_train
    return {"phase": "slice", "heldout_tasks": len(held), "heldout_functions": len(fns_val),
            "heldout_from_val_split": sum(t["split"] == "val" for t in held),
            "rl_train_tasks": len(rl), "rl_train_functions": len(fns_train),
            "moved_functions": json.loads((a.out / "slice-split.json").read_text())["moved"],
            "rl_operators": sorted({policy.in_slice(t).op for t in rl}),  # type: ignore[union-attr]
            **forms, "dir": str(a.out)}


def recipe_cmds(a: argparse.Namespace, full: Path) -> dict[str, str]:
    """The runs' setup, harness and grader commands (`setup_attempt.commands`): the setup step
    lays out each attempt's work folder from the full task file `full`; the harness runs from
    its copy there and names only its Python and mini (installed now, never in a rollout), so
    its sandbox sees neither `full` nor the libraries."""
    from examples.swe.harness_env import ensure
    from examples.swe.setup_attempt import commands

    cmds = commands([full], ensure(), config=a.mini_config)
    return {k: shlex.join(v) for k, v in cmds.items()}


def harnessrl_cli(a: argparse.Namespace) -> tuple[list[str], Path]:
    """How to run `harnessrl` (module in `--cli-repo`, its cwd there so that its code wins)."""
    return [sys.executable, "-m", "harnessrl.local.cli"], a.cli_repo


def phase_eval(a: argparse.Namespace, model: str, name: str) -> dict[str, Any]:
    full = a.out / "heldout.jsonl"
    argv, cwd = harnessrl_cli(a)
    result = a.out / f"eval-{name}.json"
    cmds = recipe_cmds(a, full)
    cmd = [*argv, "eval", "--model", str(model), "--tasks", str(a.out / "heldout.rollout.jsonl"),
           "--setup", cmds["setup"], "--harness", cmds["harness"], "--grader", cmds["grader"],
           "-k", str(a.k), "--concurrency", str(a.concurrency), "--timeout", "300",
           "--state-dir", str(a.out / f"state-eval-{name}"), "--out", str(result)]
    if a.limit:
        cmd += ["--limit", str(a.limit)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, text=True, capture_output=True,
                       env=os.environ | {"PYTHONPATH": str(cwd)})
    seconds = time.monotonic() - t0
    (a.out / f"eval-{name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0 or not result.exists():
        raise SystemExit(f"harnessrl eval failed ({p.returncode}): {p.stderr[-3000:]}")
    res = json.loads(result.read_text())
    return {"phase": "eval", "name": name, "model": str(model), "k": a.k,
            "tasks": len(res["tasks"]), "metrics": res["metrics"], "seconds": round(seconds),
            "segments": segment_share(res, a.out / f"state-eval-{name}", full),
            "result": str(result)}


def phase_tasks(a: argparse.Namespace) -> dict[str, Any]:
    """The slice's own task set: `examples/swe/make_tasks.py` with only flip_comparison
    mutations and no cap per function (the shipped set keeps at most 2 per function and kind,
    too few held-out flips for >= 30 tasks). The split is make_tasks' own (a hash of library
    and function), so its val functions are the shipped set's val functions."""
    from examples.swe import make_tasks

    orig = make_tasks.find_mutations

    def flips_only(text: str, rel: str):  # type: ignore[no-untyped-def]
        return [m for m in orig(text, rel) if m.kind == "flip_comparison"]

    make_tasks.find_mutations = flips_only
    out = a.tasks_dir
    t0 = time.monotonic()
    try:
        make_tasks.main(["--repos", str(a.repos), "--per-function", "99", "--out", str(out),
                         "--jobs", "2"])
    finally:
        make_tasks.find_mutations = orig
    counts = {s: sum(1 for _ in open(out / f"{s}.jsonl")) for s in ("train", "val")}
    return {"phase": "tasks", "dir": str(out), **counts,
            "seconds": round(time.monotonic() - t0)}


def phase_verify(a: argparse.Namespace) -> dict[str, Any]:
    """Runs the swe harness (mini-swe-agent, unchanged) against the scripted engine playing the
    policy's moves on a few warm-up tasks, and checks that mini's trajectory holds exactly the
    messages `dialogues.dialogue` synthesises (both variants)."""
    import tempfile

    from examples.swe.harness_env import ensure
    from examples.swe.setup_attempt import HARNESS, lay_out
    from harnessrl import procs

    chosen = split_slice(a)[1][: a.verify_tasks]  # warm-up tasks
    templates = policy.mini_templates(a.mini_config)
    checked, mismatches = 0, []
    with tempfile.TemporaryDirectory(prefix="swe-verify-") as tmp_s:
        tmp = Path(tmp_s)
        script = tmp / "script.json"
        scripts = []
        for t in chosen:
            info = policy.in_slice(t)
            for right in (True, False):
                scripts.append({"marker": f"[verify {t['instance_id']} {right}]", "replies": [
                    {"content": "", "command": cmd} for cmd in policy.moves(info, right)]})
        script.write_text(json.dumps({"scripts": scripts}))
        eng, info_e = procs.start_service(
            "scripted-engine", "harnessrl.testing.scripted_engine",
            ["--script", str(script), "--model", "tiny"], tmp, timeout=60,
            env={"PYTHONPATH": str(a.cli_repo)})
        try:
            full = tmp / "tasks.jsonl"
            full.write_text("".join(json.dumps(t) + "\n" for t in chosen))
            for t in chosen:
                info = policy.in_slice(t)
                for right in (True, False):
                    marker = f"[verify {t['instance_id']} {right}]"
                    task = {**t, "problem_statement": t["problem_statement"] + "\n\n" + marker}
                    wd = tmp / f"run-{checked}"
                    wd.mkdir()
                    view = {k: task[k] for k in ("instance_id", "repo", "base_commit",
                                                 "problem_statement")}
                    env = os.environ | {
                        "OPENAI_BASE_URL": f"http://127.0.0.1:{info_e['http_port']}/v1",
                        "OPENAI_API_KEY": "verify", "HARNESSRL_MODEL": "tiny",
                        "HARNESSRL_TASK_JSON": json.dumps(view)}
                    # as a run does it: the setup step lays out the work folder, then the
                    # harness runs from its copy there
                    lay_out(view, [full], wd, a.mini_config)
                    p = subprocess.run([sys.executable, HARNESS, "--mini", str(ensure())],
                                       cwd=wd, env=env, text=True, capture_output=True,
                                       timeout=300)
                    traj = json.loads((wd / "mini.traj.json").read_text())
                    got = policy.strip_for_api(traj["messages"])
                    want = policy.strip_for_api(
                        dialogues_mod.dialogue(task, info, right, tmp / "ws", templates) or [])
                    checked += 1
                    if got != want:
                        mismatches.append({"task": t["instance_id"], "right": right,
                                           "rc": p.returncode, "got": got, "want": want})
        finally:
            eng.stop()
    if mismatches:
        (a.out / "verify-mismatches.json").write_text(json.dumps(mismatches, indent=1))
    return {"phase": "verify", "dialogues_checked": checked, "mismatches": len(mismatches)}


def phase_train(a: argparse.Namespace, seed: int) -> dict[str, Any]:
    """`harnessrl up` on the RL tasks; with --eval-during, its trainer also evaluates the
    held-out slice (k samples) before the first step and after the last, on the same stack
    (`harnessrl up --eval-tasks`: one engine start instead of three)."""
    full = a.out / "all.jsonl"
    argv, cwd = harnessrl_cli(a)
    out = a.out / f"train-seed{seed}"
    prefix = f"swe-learn-{seed}-{int(time.time())}:"
    cmds = recipe_cmds(a, full)
    cmd = [*argv, "up", "--model-dir", str(a.model_dir), "--tasks",
           str(a.out / "rl-train.rollout.jsonl"), "--setup", cmds["setup"],
           "--harness", cmds["harness"], "--grader", cmds["grader"],
           "--group-size", str(a.group_size),
           "--concurrency", str(a.concurrency), "--timeout", "300",
           "--steps", str(a.steps), "--tasks-per-step", str(a.tasks_per_step),
           "--output-dir", str(out), "--state-dir", str(a.out / f"state-train-{seed}"),
           "--key-prefix", prefix]
    if a.eval_during:
        cmd += ["--eval-tasks", str(a.out / "heldout.rollout.jsonl"), "--eval-k", str(a.k),
                "--eval-every", str(a.eval_every)]
    env = os.environ | {"PYTHONPATH": str(cwd),  # the services it starts run that code too
                        "HARNESSRL_TRAINER_OPTIMIZER__LR": str(a.rl_lr),
                        "HARNESSRL_TRAINER_SEED": str(seed)}
    if not a.eval_before:  # the before-eval of another seed's run stands for this one's
        env["HARNESSRL_TRAINER_EVAL__BEFORE_TRAINING"] = "false"
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, text=True, capture_output=True, env=env)
    seconds = time.monotonic() - t0
    (a.out / f"train-seed{seed}.log").write_text(p.stdout + p.stderr)
    metrics = read_jsonl(out / "metrics.jsonl")
    steps = [m for m in metrics if m.get("kind") != "eval"]
    evals = [m for m in metrics if m.get("kind") == "eval"]
    seg = {}
    for ev in evals:
        try:
            res = json.loads(Path(ev["result"]).read_text())
            res.setdefault("store", {"redis_url": "redis://127.0.0.1:6379/0",
                                     "key_prefix": prefix})
            seg[ev["step"]] = segment_share(res, a.out / f"state-train-{seed}",
                                            a.out / "heldout.jsonl")
        except Exception as exc:  # noqa: BLE001 - a figure, not the run
            seg[ev["step"]] = {"error": repr(exc)}
    return {"phase": "train", "seed": seed, "rc": p.returncode, "seconds": round(seconds),
            "steps": len(steps), "prefix": prefix,
            "reward_per_step": [m.get("reward_mean") for m in steps],
            "step_seconds": [m.get("step_time_s") for m in steps],
            "evals": [{k: ev.get(k) for k in ("step", "pass@1", "pass@4", "avg@4", "tasks",
                                               "samples_failed", "eval_s", "result")}
                      for ev in evals],
            "segments": seg,
            "checkpoint": str(out / "checkpoints")}


def paired_bootstrap(before: dict[str, list[float]], after: dict[str, list[float]],
                     n: int = 10000, seed: int = 0) -> dict[str, float]:
    """Gain of mean pass@1 (after - before), 95% CI by resampling tasks (paired)."""
    ids = sorted(set(before) & set(after))
    diffs = [sum(after[i]) / len(after[i]) - sum(before[i]) / len(before[i]) for i in ids]
    rng = random.Random(seed)
    boots = sorted(sum(rng.choice(diffs) for _ in ids) / len(ids) for _ in range(n))
    return {"gain": sum(diffs) / len(diffs), "ci95": [boots[int(0.025 * n)],
                                                     boots[int(0.975 * n) - 1]],
            "tasks": len(ids)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("tasks", "verify", "warmup", "slice", "eval", "train", "all"))
    ap.add_argument("--verify-tasks", type=int, default=3)
    ap.add_argument("--heldout-min", type=int, default=30)
    ap.add_argument("--rl-forms", action="store_true",
                    help="slice: the RL tasks also in equivalent forms that show other "
                         "operators (examples/swe/rl_forms.py)")
    ap.add_argument("--repos", type=Path, default=HERE / "repos",
                    help="tasks: the libraries (examples/swe/repos)")
    ap.add_argument("--tasks-dir", type=Path, default=HERE / "tasks")
    ap.add_argument("--out", type=Path, default=REPO / ".harnessrl" / "swe-learning")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--mini-config", type=Path, default=HERE / "mini.yaml")
    ap.add_argument("--cli-repo", type=Path, default=REPO,
                    help="the checkout whose `harnessrl` CLI runs eval and up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--right-fraction", type=float, default=0.4)
    ap.add_argument("--renames", type=int, default=0,
                    help="warmup: renamed variants per task (fresh function and test names), "
                         "so that the model learns to copy names instead of memorising them")
    ap.add_argument("--op-variants", action="store_true",
                    help="warmup: each task also with every other operator of its family on "
                         "the broken line (the listing run for each)")
    ap.add_argument("--max-shift", type=int, default=0,
                    help="warmup: renamed variants start the broken file with up to N empty "
                         "lines (new line numbers to copy)")
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=4096, help="warmup: BPE vocabulary bound")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--eval-model", default=None, help="eval: the model (default --model-dir)")
    ap.add_argument("--eval-name", default="before")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tasks-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--rl-lr", type=float, default=6e-4)
    ap.add_argument("--eval-during", action="store_true",
                    help="train: evaluate the held-out slice inside the training run")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--no-eval-before", dest="eval_before", action="store_false",
                    help="train --eval-during: no evaluation before the first step")
    a = ap.parse_args(argv)
    from harnessrl import log

    log.setup("swe-learning")
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.model_dir is None:
        a.model_dir = a.out / "model"
    if a.phase == "tasks":
        print(json.dumps(phase_tasks(a)), flush=True)
    elif a.phase == "verify":
        print(json.dumps(phase_verify(a)), flush=True)
    elif a.phase == "warmup":
        print(json.dumps(phase_warmup(a)), flush=True)
    elif a.phase == "slice":
        print(json.dumps(phase_slice(a)), flush=True)
    elif a.phase == "eval":
        print(json.dumps(phase_eval(a, a.eval_model or a.model_dir, a.eval_name)), flush=True)
    elif a.phase == "train":
        print(json.dumps(phase_train(a, a.seed)), flush=True)
    else:
        summary: dict[str, Any] = {"warmup": phase_warmup(a), "slice": phase_slice(a)}
        print(json.dumps(summary["warmup"]), flush=True)
        before = phase_eval(a, a.model_dir, "before")
        summary["before"] = before
        b = json.loads(Path(before["result"]).read_text())
        runs = []
        for seed in a.seeds:
            tr = phase_train(a, seed)
            ev = phase_eval(a, Path(tr["checkpoint"]), f"after-seed{seed}")
            runs.append({"train": tr, "after": ev})
            print(json.dumps(runs[-1]), flush=True)
        summary["runs"] = runs
        rewards_b = task_rewards(b)
        pooled: dict[str, list[float]] = {}
        for r in runs:
            for tid, rw in task_rewards(json.loads(Path(r["after"]["result"]).read_text())
                                        ).items():
                pooled.setdefault(tid, []).extend(rw)
        summary["gain"] = paired_bootstrap(rewards_b, pooled)
        print(json.dumps(summary), flush=True)
    return 0


def task_rewards(res: dict[str, Any]) -> dict[str, list[float]]:
    out = {}
    for t in res["tasks"]:
        rw = [float(x or 0.0) >= 1.0 for x in t["rewards"]]
        out[t["task_id"]] = [float(x) for x in rw]
    return out


if __name__ == "__main__":
    sys.exit(main())
