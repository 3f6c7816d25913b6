"""The swe recipe's trusted setup step: lays out one attempt's work folder for its harness.

The controller runs it before each attempt's harness (the run's `setup_command`, `harnessrl
up --setup`), outside the sandbox, in the attempt's work folder, with the harness's environment
less the model credential: `HARNESSRL_TASK_JSON` is the task's rollout view (`instance_id`,
`repo`, `base_commit`, `problem_statement`), the only part of the task a rollout may see. It
reads the task's full record (`--tasks FULL.jsonl`, by instance_id; repeatable) and writes

    repo/      the broken workspace (`workspace.prepare_workspace`, as the grader makes its copy)
    issue.md   the problem statement, as the controller handed it
    harness/   the harness's own code: `harness.py`, mini's config (`mini.yaml`, or `--config`)
               and the agent's tools (`tools/`)

and nothing else: the full record, the fix, the tests the grader adds and the libraries the
workspace is made from stay where the sandboxed harness cannot look. The harness runs from
its copy (`python harness/harness.py --mini MINI`: a path relative to the work folder), so its
command names nothing of this folder (a sandbox makes readable every folder its command names,
and this one holds the libraries and the task files, that is the fixes).

It refuses (exit 2) a task handed to the harness that holds more than the rollout view (a
controller given the full task file instead of `*.rollout.jsonl` would put the fix into the
harness's environment): `python -m examples.swe.swe_tasks FULL OUT` writes the rollout view.

`commands(...)` builds a run's three commands (setup, harness, grader), as the recipe's README,
`learning.py` and the tests use them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.swe.swe_tasks import ROLLOUT_FIELDS, find_task  # noqa: E402
from examples.swe.workspace import WorkspaceError, prepare_workspace  # noqa: E402

HERE = Path(__file__).resolve().parent
HARNESS_DIR = "harness"  # the harness's code in the work folder
HARNESS = f"{HARNESS_DIR}/harness.py"  # the harness command's script, relative to the work folder
VIEW_FIELDS = {*ROLLOUT_FIELDS, "id"}  # what the harness may be handed ("id": a task file's)


def check_view(task: dict[str, object]) -> None:
    """`ValueError` when the task handed to the harness holds more than its rollout view."""
    extra = sorted(set(task) - VIEW_FIELDS)
    if extra:
        raise ValueError(f"the task handed to the harness holds {', '.join(extra)}: give the "
                         "controller the tasks' rollout view (*.rollout.jsonl; `python -m "
                         "examples.swe.swe_tasks FULL OUT` writes it), never the full records")


def lay_out(task: dict[str, object], tasks: list[Path], work: Path,
            config: Path | None = None) -> None:
    """The work folder of the task `task` (its rollout view) from its full record in `tasks`."""
    check_view(task)
    record = find_task(tasks, str(task["instance_id"]))
    if task.get("base_commit") != record.base_commit:
        raise ValueError(f"{record.instance_id}: the task's base_commit {task.get('base_commit')}"
                         f" is not its record's {record.base_commit} (a stale rollout view?)")
    for name in ("repo", HARNESS_DIR, "issue.md"):  # left by an earlier run of this step
        path = work / name  # (a link made by a harness is removed, never followed)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
    prepare_workspace(record, work / "repo")
    (work / "issue.md").write_text(str(task["problem_statement"]))
    code = work / HARNESS_DIR
    code.mkdir()
    shutil.copyfile(HERE / "harness.py", code / "harness.py")
    shutil.copyfile(config or HERE / "mini.yaml", code / "mini.yaml")
    shutil.copytree(HERE / "tools", code / "tools",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def commands(tasks: list[Path], mini: Path | str, *, python: str = sys.executable,
             config: Path | None = None, mini_config: Sequence[str] = (),
             grader_flags: Sequence[str] = ()) -> dict[str, list[str]]:
    """The run's setup, harness and grader commands (argv lists) for the full task files
    `tasks` and mini's executable `mini` (`harness_env.ensure()`). A sandbox shows the folder
    of each absolute path its command names: the harness's names its Python and mini (their
    venvs) and nothing of this folder or the task files; the grader's names both (it needs
    the full records and the libraries)."""
    full = [a for t in tasks for a in ("--tasks", str(Path(t).resolve()))]
    setup = [python, str(HERE / "setup_attempt.py"), *full]
    if config is not None:
        setup += ["--config", str(Path(config).resolve())]
    harness = [python, HARNESS, "--mini", str(mini),
               *[a for spec in mini_config for a in ("--mini-config", spec)]]
    grader = [python, str(HERE / "grader.py"), *full, *grader_flags]
    return {"setup": setup, "harness": harness, "grader": grader}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", required=True, action="append", type=Path,
                    help="a full SWE task file (repeatable: the first that holds the task)")
    ap.add_argument("--config", type=Path, help="mini's config file (default: mini.yaml)")
    ap.add_argument("--work", type=Path, default=None, help="the work folder (default: "
                    "$HARNESSRL_WORKDIR, else the current folder)")
    a = ap.parse_args(argv)
    work = (a.work or Path(os.environ.get("HARNESSRL_WORKDIR") or ".")).resolve()
    try:
        task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
        lay_out(task, a.tasks, work, a.config)
    except (KeyError, TypeError, ValueError, OSError, WorkspaceError) as exc:
        print(f"swe setup: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"swe setup: {task['instance_id']} laid out in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
