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
   back), plants canary tests among the task's tests (`harnessrl.graders.pytest_canaries`:
   copies of real tests that must fail, plain ones that must pass; which is which stays in
   this process), and runs exactly the FAIL_TO_PASS, PASS_TO_PASS and canary tests with its
   own pytest configuration (`-c` of its own: a repository's `addopts` is never read),
   `python -I`, a time limit, and a JUnit XML report in a folder of its own, in a sandbox
   nested in its own (`harnessrl.graders.nested_sandbox`: no task file, none of the grader's
   processes or output, no network).
4. It reads every test's outcome from that XML, never from the agent's output or the test run's
   exit code alone: a test missing from the report (a run ended by `os._exit(0)` on import
   writes none) has not passed.
5. The canaries' outcomes against the key: a must-fail canary that passed, a must-pass one that
   did not, or one missing where its file's tests ran, means the agent's code forged the run's
   outcome (replaced pytest's `runtest`, forged reports, rewrote the JUnit file...): the grade
   is void, reward 0, flagged `"tampered": true` with the evidence.

Reward: 1.0 when every FAIL_TO_PASS and PASS_TO_PASS test passed, else 0.0. With `--partial`:
the share of FAIL_TO_PASS tests that passed, and 0.0 when any PASS_TO_PASS test did not pass.
A tampered run: 0.0. `swe-report.json` (each test's outcome, kept and dropped files, the
agent's patch, the canaries and their outcomes) is written in the working directory (the
attempt's work folder); the last stdout line is `{"reward": x, "reason": ..., "tampered":
bool, "evidence": ...}`.

What this cannot catch (`harnessrl.graders.canaries`): a forgery aimed at exactly the real
tests' node ids (the task statement names the failing tests), or one that reads each test's
source to spot the canaries' failing line. On the local backend the grader itself runs in a
sandbox (the attempt's work folder writable, no network) that sees what its command names;
the harness's sandbox sees neither the libraries nor the task files (`setup_attempt.py`).
In a container without user namespaces (the default seccomp profile) bubblewrap cannot run:
give the grader's container a profile that allows it, or `--test-sandbox none` (the report
says so; canaries still run).

Usage: `python examples/swe/grader.py --tasks FULL.jsonl [--tasks MORE.jsonl] [--partial]
[--test-sandbox bwrap|none]`; the
task's `instance_id` comes from HARNESSRL_TASK_JSON (the rollout view the controller was given).
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.swe.swe_tasks import SweTask, find_task, snapshot_files
from examples.swe.testrun import DEFAULT_TIMEOUT_S, TestRunner
from harnessrl.graders import pytest_canaries
from harnessrl.graders.canaries import CanaryKey
from harnessrl.graders.nested_sandbox import Unavailable
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
    tampered: bool = False
    evidence: str = ""  # what the canaries showed, when tampered
    # the canaries planted ({node_id: {"must": pass|fail, "outcome": ...}}), revealed after
    canaries: dict[str, dict[str, str]] = field(default_factory=dict)
    test_sandbox: str = "bwrap"  # where the tests ran: "bwrap" (nested sandbox) or "none"


def grade(task: SweTask, agent_repo: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S,
          partial: bool = False, python: str = sys.executable, plugins: bool = False,
          report_dir: Path | None = None, runner: TestRunner | None = None,
          canaries: bool = True, sandbox: bool = True,
          hide: tuple[Path, ...] = ()) -> Grade:
    """The reward of the agent's workspace `agent_repo` for `task` (see the module docstring);
    with `report_dir`, writes `swe-report.json` and `model.patch` there. `runner`: a test
    runner to reuse (many grades in one process; its python, plugins and sandbox then apply);
    else one is made (`sandbox`: in the nested sandbox, `hide` and the task's repository
    masked in it). `canaries=False` grades as the recipe did before canaries (measurements
    and the forgery table's first column only: a forged outcome then goes unseen)."""
    start = time.monotonic()
    own = runner is None
    if runner is None:
        runner = TestRunner(python, plugins, sandbox=sandbox,
                            hide=(*hide, Path(task.repo_path)))
    try:
        with runner.scratch("swe-clean-") as tmp:
            clean = Path(tmp) / "repo"
            prepare_workspace(task, clean)
            changes = collect_changes(clean, agent_repo)
            apply_patch(clean, task.test_patch)
            key = pytest_canaries.plant(clean, task.FAIL_TO_PASS, task.PASS_TO_PASS) \
                if canaries else CanaryKey()
            run = runner.run(clean, [*task.tests(), *key.node_ids()], timeout_s=timeout_s)
    finally:
        if own:
            runner.close()
    verdict = key.check(run.outcomes)
    f2p = {t: run.outcomes.get(t, "missing") for t in task.FAIL_TO_PASS}
    p2p = {t: run.outcomes.get(t, "missing") for t in task.PASS_TO_PASS}
    f2p_ok = sum(o == "passed" for o in f2p.values())
    p2p_ok = all(o == "passed" for o in p2p.values())
    if verdict.tampered:
        reward, reason = 0.0, f"void: the test run's outcome was forged ({verdict.summary()})"
    elif run.timed_out:
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
                   round(time.monotonic() - start, 3), verdict.tampered,
                   verdict.summary() if verdict.tampered else "",
                   {c.node_id: {"must": c.must, "outcome": run.outcomes.get(c.node_id,
                                                                             "missing")}
                    for c in key.canaries},
                   "bwrap" if runner.sandbox is not None else "none")
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
    ap.add_argument("--test-sandbox", choices=("bwrap", "none"), default="bwrap",
                    help="where the tests run: a sandbox nested in the grader's (default), or "
                         "none where bubblewrap cannot run (the report says so)")
    a = ap.parse_args(argv)
    try:
        instance_id = json.loads(os.environ["HARNESSRL_TASK_JSON"])["instance_id"]
        task = find_task(a.tasks, instance_id)
        result = grade(task, Path(a.workspace).resolve(), timeout_s=a.timeout,
                       partial=a.partial, python=a.python, plugins=a.pytest_plugins,
                       report_dir=Path.cwd(), sandbox=a.test_sandbox == "bwrap",
                       hide=tuple(a.tasks))
    except (KeyError, ValueError, WorkspaceError, Unavailable) as exc:
        print(f"grader: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"reward": result.reward, "reason": result.reason,
                      "tampered": result.tampered, "evidence": result.evidence}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
