"""Grades one SWE rollout by running the task's tests on the agent's source changes.

1. The grader makes its own clean copy of the task's workspace (`prepare_workspace`, the same
   code the rollout's workspace came from).
2. It takes the agent's changes (its workspace against that copy, file by file) and keeps only
   the changes to non-test Python source files (`source_change_allowed`): anything under a
   test folder, `test_*.py`, `*_test.py`, `conftest.py`, pytest/packaging configuration
   (`pytest.ini`, `setup.cfg`, `tox.ini`, `pyproject.toml`, `setup.py`), `sitecustomize.py`,
   new top-level modules (one could shadow a module the test run imports), non-Python files
   and symlinks are dropped, and the report says why.
3. It makes the kept changes in its copy, applies `test_patch` (the FAIL_TO_PASS tests come
   back), and runs exactly the FAIL_TO_PASS and PASS_TO_PASS tests with its own pytest
   configuration (`-c` of its own: a repository's `addopts` is never read), `python -I`, a time
   limit, and a JUnit XML report in a folder of its own.
4. It reads every test's outcome from that XML, never from the agent's output or the test run's
   exit code alone: a test missing from the report (a run ended by `os._exit(0)` on import
   writes none) has not passed.

Reward: 1.0 when every FAIL_TO_PASS and PASS_TO_PASS test passed, else 0.0. With `--partial`:
the share of FAIL_TO_PASS tests that passed, and 0.0 when any PASS_TO_PASS test did not pass.
`swe-report.json` (each test's outcome, kept and dropped files, the agent's patch) is written
in the working directory (the attempt's work folder); the last stdout line is
`{"reward": x, ...}`.

Limits, by design of this example: the tests run the agent's code in the grader's process
tree, so code that forges the report file itself is not caught here. On the local backend the
grader runs in a sandbox of its own (the attempt's work folder writable, no network), which
sees what its command names: this folder (the libraries) and its task files' folders; the
harness's sandbox sees neither (`setup_attempt.py`). Kubernetes pods, with the grader in a
container of its own image, are the isolation there.

Usage: `python examples/swe/grader.py --tasks FULL.jsonl [--tasks MORE.jsonl] [--partial]`; the
task's `instance_id` comes from HARNESSRL_TASK_JSON (the rollout view the controller was given).
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.swe.swe_tasks import SweTask, find_task, snapshot_files
from examples.swe.testrun import DEFAULT_TIMEOUT_S, TestRunner, run_tests
from examples.swe.workspace import WorkspaceError, apply_patch, prepare_workspace

REPORT = "swe-report.json"
MODEL_PATCH = "model.patch"
TEST_DIRS = {"test", "tests", "testing"}
CONFIG_FILES = {"pytest.ini", "setup.cfg", "tox.ini", "pyproject.toml", "setup.py",
                "sitecustomize.py", "usercustomize.py", "conftest.py"}
MAX_FILE_BYTES = 1 << 20


def source_change_allowed(rel: PurePosixPath, clean: Path) -> str | None:
    """None when the agent's change to `rel` is kept, else why it is dropped."""
    name = rel.name
    if any(p in TEST_DIRS for p in rel.parts[:-1]) or name.startswith("test_") \
            or name.endswith("_test.py"):
        return "a test file"
    if name in CONFIG_FILES:
        return "test or packaging configuration"
    if any(p.startswith(".") for p in rel.parts):
        return "a hidden file"
    if rel.suffix != ".py":
        return "not a Python source file"
    if not (clean / rel).exists():
        if len(rel.parts) == 1:
            return "a new top-level module"
        if not (clean / rel.parent / "__init__.py").exists():
            return "a new file outside the repository's packages"
    return None


@dataclass
class Changes:
    kept: list[str] = field(default_factory=list)
    dropped: list[dict[str, str]] = field(default_factory=list)
    patch: str = ""


def _files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in snapshot_files(root)}


def collect_changes(clean: Path, agent: Path) -> Changes:
    """The agent's changes against `clean`, the allowed ones made in `clean`."""
    ch = Changes()
    before, after = _files(clean), _files(agent) if agent.is_dir() else {}
    diffs: list[str] = []
    for rel in sorted(set(before) | set(after)):
        old = before[rel].read_bytes() if rel in before else None
        path = after.get(rel)
        if path is not None and path.is_symlink():
            ch.dropped.append({"path": rel, "why": "a symlink"})
            continue
        if path is not None and path.stat().st_size > MAX_FILE_BYTES:
            ch.dropped.append({"path": rel, "why": f"over {MAX_FILE_BYTES} bytes"})
            continue
        new = path.read_bytes() if path is not None else None
        if old == new:
            continue
        diffs += difflib.unified_diff(
            (old or b"").decode(errors="replace").splitlines(keepends=True),
            (new or b"").decode(errors="replace").splitlines(keepends=True),
            f"a/{rel}" if old is not None else "/dev/null",
            f"b/{rel}" if new is not None else "/dev/null")
        why = source_change_allowed(PurePosixPath(rel), clean)
        if why is not None:
            ch.dropped.append({"path": rel, "why": why})
            continue
        ch.kept.append(rel)
        target = clean / rel
        if new is None:
            target.unlink()
        else:
            target.write_bytes(new)
    ch.patch = "".join(d if d.endswith("\n") else d + "\n\\ No newline at end of file\n"
                       for d in diffs)
    return ch


@dataclass
class Grade:
    reward: float
    reason: str
    fail_to_pass: dict[str, str]
    pass_to_pass: dict[str, str]
    kept_files: list[str]
    dropped_files: list[dict[str, str]]
    pytest_exit_code: int | None
    duration_s: float


def grade(task: SweTask, agent_repo: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S,
          partial: bool = False, python: str = sys.executable, plugins: bool = False,
          report_dir: Path | None = None, runner: TestRunner | None = None) -> Grade:
    """The reward of the agent's workspace `agent_repo` for `task` (see the module docstring);
    with `report_dir`, writes `swe-report.json` and `model.patch` there. `runner`: a test
    runner to reuse (many grades in one process; its python and plugins then apply)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="swe-clean-") as tmp:
        clean = Path(tmp) / "repo"
        prepare_workspace(task, clean)
        changes = collect_changes(clean, agent_repo)
        apply_patch(clean, task.test_patch)
        if runner is not None:
            run = runner.run(clean, task.tests(), timeout_s=timeout_s)
        else:
            run = run_tests(clean, task.tests(), timeout_s=timeout_s, python=python,
                            plugins=plugins)
    f2p = {t: run.outcomes.get(t, "missing") for t in task.FAIL_TO_PASS}
    p2p = {t: run.outcomes.get(t, "missing") for t in task.PASS_TO_PASS}
    f2p_ok = sum(o == "passed" for o in f2p.values())
    p2p_ok = all(o == "passed" for o in p2p.values())
    if run.timed_out:
        reward, reason = 0.0, f"the tests ran past {timeout_s:g}s (killed)"
    elif f2p_ok == len(f2p) and p2p_ok:
        reward, reason = 1.0, "every FAIL_TO_PASS and PASS_TO_PASS test passed"
    else:
        bad = [f"{t}: {o}" for t, o in [*f2p.items(), *p2p.items()] if o != "passed"]
        reward = f2p_ok / len(f2p) if partial and p2p_ok else 0.0
        reason = (f"{f2p_ok}/{len(f2p)} FAIL_TO_PASS passed, PASS_TO_PASS "
                  f"{'all passed' if p2p_ok else 'not all passed'}; e.g. {bad[0]}")
        if not run.outcomes:
            reason += f" (no test report; pytest exit code {run.exit_code})"
    result = Grade(reward, reason, f2p, p2p, changes.kept, changes.dropped, run.exit_code,
                   round(time.monotonic() - start, 3))
    if report_dir is not None:
        report = {"instance_id": task.instance_id, **asdict(result),
                  "test_output_tail": run.output_tail}
        (report_dir / REPORT).write_text(json.dumps(report, indent=1))
        (report_dir / MODEL_PATCH).write_text(changes.patch)
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Grades a SWE rollout (see the module docstring).")
    ap.add_argument("--tasks", required=True, action="append", type=Path,
                    help="a SWE-bench-format task file (full records); repeat it to give "
                         "several (e.g. train and val)")
    ap.add_argument("--workspace", default="repo", help="the agent's repository (default: "
                                                        "./repo, where the harness put it)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds the test run may take")
    ap.add_argument("--partial", action="store_true",
                    help="reward = share of FAIL_TO_PASS passed (0 if a PASS_TO_PASS fails)")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python that runs the tests (needs pytest and the repo's deps)")
    ap.add_argument("--pytest-plugins", action="store_true",
                    help="load installed pytest plugins (off: faster, and the same for all)")
    a = ap.parse_args(argv)
    try:
        instance_id = json.loads(os.environ["HARNESSRL_TASK_JSON"])["instance_id"]
        task = find_task(a.tasks, instance_id)
        result = grade(task, Path(a.workspace).resolve(), timeout_s=a.timeout,
                       partial=a.partial, python=a.python,
                       plugins=a.pytest_plugins, report_dir=Path.cwd())
    except (KeyError, ValueError, WorkspaceError) as exc:
        print(f"grader: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"reward": result.reward, "reason": result.reason}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
