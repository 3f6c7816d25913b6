"""SWE-bench-format task files: the one reader, for the workspace builder, the grader and the
task generator.

A task is one JSON object a line with SWE-bench's fields:
- `instance_id`: unique name of the task;
- `repo`: the repository's name (`owner/name` in SWE-bench; informational here);
- `base_commit`: the revision the workspace starts from: a git commit when `repo_path` is a git
  repository, else the `snapshot_hash` of the plain folder `repo_path` (checked, so that a
  changed folder is never graded against tasks made from another version of it);
- `problem_statement`: what the agent is told;
- `patch`: the gold fix, a unified diff of source files (never shown to a rollout);
- `test_patch`: a unified diff of test files, applied by the grader before it runs the tests;
- `FAIL_TO_PASS`, `PASS_TO_PASS`: pytest node ids (`tests/test_x.py::test_y`), as lists or as
  JSON strings of lists (SWE-bench's files use both);
plus harnessrl's own:
- `repo_path`: where the repository is on this machine (relative paths are taken from the task
  file's folder); required, since fetching repositories is not in scope;
- `mutation` (optional): the edit that makes the broken workspace (`examples.swe.mutations`).
  A task with one is SWE-smith-shaped: `base_commit` is the working library, and its workspace
  is that with the mutation made and `test_patch` reverted. A task without one is
  SWE-bench-shaped: the workspace is `base_commit` as it is.
- `split`, `library`, `function`, `kind` (optional): how the task was made.

The controller never sees these records whole: `rollout_view` keeps only what a rollout may
see (the controller puts every task field into the harness's environment).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ROLLOUT_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement")
IGNORED_IN_SNAPSHOTS = {"__pycache__", ".pytest_cache", ".git", ".mypy_cache", ".ruff_cache"}


class SweTask(BaseModel):
    """One task of a SWE-bench-format file (see the module docstring)."""

    model_config = ConfigDict(extra="allow")

    instance_id: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._\-]+$",
                             description="unique name of the task")
    repo: str = Field(description="the repository's name (informational)")
    base_commit: str = Field(min_length=7, description="git commit or snapshot hash")
    problem_statement: str = Field(min_length=1, description="what the agent is told")
    patch: str = Field(description="the gold fix (unified diff)")
    test_patch: str = Field(default="", description="unified diff of tests, applied to grade")
    FAIL_TO_PASS: list[str] = Field(min_length=1, description="tests the fix makes pass")
    PASS_TO_PASS: list[str] = Field(default_factory=list, description="tests that must stay "
                                                                      "passing")
    repo_path: str = Field(description="the repository on this machine (relative: to the task "
                                       "file's folder)")
    mutation: dict[str, Any] | None = Field(default=None, description="SWE-smith-shaped: the "
                                            "edit that breaks base_commit")

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, v: object) -> object:
        return json.loads(v) if isinstance(v, str) else v

    def tests(self) -> list[str]:
        return [*self.FAIL_TO_PASS, *self.PASS_TO_PASS]


def load_swe_tasks(path: str | Path) -> list[SweTask]:
    """The tasks of a JSONL file, `repo_path` made absolute; `ValueError` names the line."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the task file {path}: {exc}") from None
    tasks: list[SweTask] = []
    seen: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            task = SweTask.model_validate_json(line)
        except ValidationError as exc:
            raise ValueError(f"{where}: not a SWE-bench task: {exc}") from None
        if task.instance_id in seen:
            raise ValueError(f"{where}: instance_id {task.instance_id!r} repeats")
        seen.add(task.instance_id)
        task.repo_path = str((path.parent / task.repo_path).resolve())
        tasks.append(task)
    if not tasks:
        raise ValueError(f"{path} holds no tasks")
    return tasks


def find_task(paths: str | Path | list[Path], instance_id: str) -> SweTask:
    """The task `instance_id` of the first of the files `paths` that holds it."""
    files = [Path(p) for p in paths] if isinstance(paths, list) else [Path(paths)]
    for path in files:
        for task in load_swe_tasks(path):
            if task.instance_id == instance_id:
                return task
    raise ValueError(f"no task {instance_id!r} in {', '.join(map(str, files))}")


def rollout_view(task: SweTask) -> dict[str, str]:
    """What a rollout may see of a task: no fix, no tests, no mutation."""
    return {k: getattr(task, k) for k in ROLLOUT_FIELDS}


def snapshot_files(root: Path) -> list[Path]:
    """The files of a snapshot folder (caches and VCS folders left out), sorted."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not IGNORED_IN_SNAPSHOTS.intersection(rel.parts):
            out.append(p)
    return out


def snapshot_hash(root: Path) -> str:
    """A content hash of a folder: its files' relative paths and bytes (40 hex digits, the
    length of a git commit id)."""
    h = hashlib.sha256()
    for p in snapshot_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:40]


def write_rollout_view(src: str | Path, dest: str | Path) -> int:
    """Writes the rollout view of every task of `src` to `dest` (the controller's task file);
    returns how many."""
    tasks = load_swe_tasks(src)
    Path(dest).write_text("".join(json.dumps(rollout_view(t)) + "\n" for t in tasks))
    return len(tasks)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Writes the rollout view of a SWE task file "
                                             "(what the controller is given).")
    ap.add_argument("tasks", help="SWE-bench-format JSONL")
    ap.add_argument("out", help="the controller's JSONL")
    a = ap.parse_args()
    print(f"{write_rollout_view(a.tasks, a.out)} tasks -> {a.out}")
