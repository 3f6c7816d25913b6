"""The broken workspace of a SWE task: what a rollout starts from, and what the grader grades on.

`prepare_workspace(task, dest)` is the one way a workspace is made, for rollouts (the harness
calls it, or copies one that `build_workspaces` made with it for an image) and for the grader's
own clean copy alike:
1. the repository at `base_commit`, without history: `git archive` of a git repository, or the
   files of a snapshot folder whose content hash must equal `base_commit`;
2. SWE-smith-shaped tasks (with a `mutation`): the mutation is made and `test_patch` reverted,
   so the tests that catch the bug are not in the workspace (the grader adds them back, as
   SWE-bench applies `test_patch`);
3. nothing else: no `.git`, no copy of the original source, no fix.

`apply_patch` applies a unified diff with `git apply` in a folder that is not a git work tree
(`GIT_CEILING_DIRECTORIES` stops git from finding a repository above it).

`python -m examples.swe.workspace build TASKS OUT` writes `OUT/<instance_id>/` for every task
(what an image ships); `python -m examples.swe.workspace prepare TASKS INSTANCE_ID DEST`.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.swe.mutations import Mutation, apply_mutation
from examples.swe.swe_tasks import SweTask, load_swe_tasks, snapshot_files, snapshot_hash


class WorkspaceError(RuntimeError):
    """A workspace could not be made: the repository, snapshot or patch does not fit."""


def _git_env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_CEILING_DIRECTORIES"] = str(folder.resolve().parent)
    return env


def apply_patch(folder: Path, patch: str, *, reverse: bool = False) -> None:
    """Applies `patch` (a unified diff, paths a/... b/...) to the files in `folder`."""
    if not patch.strip():
        return
    argv = ["git", "apply", "--whitespace=nowarn", *(["-R"] if reverse else []), "-"]
    proc = subprocess.run(argv, cwd=folder, input=patch.encode(), capture_output=True,
                          env=_git_env(folder), timeout=60)
    if proc.returncode != 0:
        raise WorkspaceError(f"git apply{' -R' if reverse else ''} failed in {folder}: "
                             f"{proc.stderr.decode(errors='replace').strip()}")


def export_snapshot(task: SweTask, dest: Path) -> None:
    """The repository at `task.base_commit`, as plain files in `dest` (which must not exist)."""
    repo = Path(task.repo_path)
    if not repo.is_dir():
        raise WorkspaceError(f"{task.instance_id}: repo_path {repo} is not a folder")
    dest.mkdir(parents=True)
    if (repo / ".git").exists():
        proc = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar",
                               task.base_commit], capture_output=True, timeout=300)
        if proc.returncode != 0:
            raise WorkspaceError(f"{task.instance_id}: git archive {task.base_commit} in {repo} "
                                 f"failed: {proc.stderr.decode(errors='replace').strip()}")
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            tar.extractall(dest, filter="data")
        return
    found = snapshot_hash(repo)
    if found != task.base_commit:
        raise WorkspaceError(f"{task.instance_id}: the snapshot {repo} has hash {found}, the "
                             f"task was made from {task.base_commit} (the folder changed: "
                             "regenerate the tasks)")
    for src in snapshot_files(repo):
        out = dest / src.relative_to(repo)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out)


def prepare_workspace(task: SweTask | dict[str, Any], dest: Path) -> None:
    """Makes the broken workspace of `task` in `dest` (see the module docstring)."""
    if not isinstance(task, SweTask):
        task = SweTask.model_validate(task)
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise WorkspaceError(f"{dest} exists and is not empty")
    if dest.exists():
        dest.rmdir()
    export_snapshot(task, dest)
    if task.mutation is not None:
        m = Mutation.from_json(task.mutation)
        path = dest / m.file
        try:
            path.write_text(apply_mutation(path.read_text(), m))
        except (OSError, ValueError) as exc:
            raise WorkspaceError(f"{task.instance_id}: {exc}") from None
        apply_patch(dest, task.test_patch, reverse=True)


def build_workspaces(tasks: list[SweTask], out: Path) -> None:
    """`out/<instance_id>/` for each task (what the example's harness image ships)."""
    for task in tasks:
        prepare_workspace(task, out / task.instance_id)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="a workspace for every task: OUT/<instance_id>/")
    b.add_argument("tasks")
    b.add_argument("out")
    p = sub.add_parser("prepare", help="one task's workspace in DEST")
    p.add_argument("tasks")
    p.add_argument("instance_id")
    p.add_argument("dest")
    a = ap.parse_args(argv)
    try:
        tasks = load_swe_tasks(a.tasks)
        if a.verb == "build":
            build_workspaces(tasks, Path(a.out))
            print(f"{len(tasks)} workspaces in {a.out}")
        else:
            chosen = [t for t in tasks if t.instance_id == a.instance_id]
            if not chosen:
                raise ValueError(f"no task {a.instance_id!r} in {a.tasks}")
            prepare_workspace(chosen[0], Path(a.dest))
    except (ValueError, WorkspaceError) as exc:
        print(f"workspace: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
