"""The SWE example's task set, workspaces and grader (examples/swe), without a model.

- every shipped task, built from its JSONL line by the workspace code rollouts use: with the
  gold patch every FAIL_TO_PASS and PASS_TO_PASS test passes; without it every FAIL_TO_PASS
  test fails;
- the workspace holds no history, no original source, no FAIL_TO_PASS test;
- the grader: gold fix 1, wrong fix 0, a fix that breaks a PASS_TO_PASS test 0, and each
  reward hack 0 (addopts in setup.cfg, an edited PASS_TO_PASS test, an added test file; the
  rest, and the forgeries that canaries catch, in test_tamper.py);
- a user's own SWE-bench-shaped task over a local git repository;
- the mutation kinds.
The same cases through mini-swe-agent, the gateway and the controller: test_swe_scripted.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from examples.swe import grader as swe_grader
from examples.swe.mutations import KINDS, Mutation, MutationMismatch, apply_mutation, \
    find_mutations
from examples.swe.swe_tasks import SweTask, load_swe_tasks, rollout_view, snapshot_hash
from examples.swe.testrun import TestRunner, run_tests
from examples.swe.workspace import WorkspaceError, apply_patch, prepare_workspace

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "swe" / "tasks"


@pytest.fixture(scope="module")
def train() -> list[SweTask]:
    return load_swe_tasks(TASKS / "train.jsonl")


@pytest.fixture(scope="module")
def val() -> list[SweTask]:
    return load_swe_tasks(TASKS / "val.jsonl")


def _check_task(task: SweTask, runner: TestRunner) -> list[str]:
    """What is wrong with `task` (empty: nothing): its workspace built as a rollout's, then its
    FAIL_TO_PASS tests run without the fix (with test_patch, as the grader adds them), then
    graded with the gold patch (canaries planted, in the runner's sandbox)."""
    import shutil
    problems = []
    tmp = Path(tempfile.mkdtemp(dir=runner.root))
    ws = tmp / task.instance_id / "repo"
    prepare_workspace(task, ws)
    bare = tmp / task.instance_id / "bare"
    shutil.copytree(ws, bare)
    apply_patch(bare, task.test_patch)
    run = runner.run(bare, task.FAIL_TO_PASS, timeout_s=60)
    not_failing = [t for t in task.FAIL_TO_PASS if run.outcomes.get(t) not in ("failed", "error")]
    if not_failing:
        problems.append(f"{task.instance_id}: without the fix, {not_failing} do not fail")
    apply_patch(ws, task.patch)
    fixed = swe_grader.grade(task, ws, timeout_s=60, runner=runner)
    bad = {t: o for t, o in {**fixed.fail_to_pass, **fixed.pass_to_pass}.items()
           if o != "passed"}
    if bad or fixed.reward != 1.0 or fixed.tampered or len(fixed.canaries) != 4:
        problems.append(f"{task.instance_id}: with the gold patch {bad} ({fixed.reason}; "
                        f"canaries {fixed.canaries})")
    shutil.rmtree(tmp)
    return problems


# CI checks 3 tasks of each (library, kind), every way the generator makes a task: 53 of the
# 351 (all of them took 111 s of a CI run, 2026-12-07). HARNESSRL_LONG_TESTS=1: all.
PER_KIND = 3


def test_every_shipped_task_fails_without_its_fix_and_passes_with_it(train, val):
    tasks = train + val
    if os.environ.get("HARNESSRL_LONG_TESTS") != "1":
        seen: Counter[tuple[str, str]] = Counter()
        sample = []
        for t in sorted(tasks, key=lambda t: t.instance_id):
            kind = (t.model_extra["library"], t.model_extra["kind"])
            if seen[kind] < PER_KIND:
                seen[kind] += 1
                sample.append(t)
        assert len(seen) >= 6, seen  # (a group may hold fewer than PER_KIND)
        tasks = sample
    local = threading.local()
    runners: list[TestRunner] = []

    def check(task: SweTask) -> list[str]:
        if not hasattr(local, "runner"):
            local.runner = TestRunner()
            runners.append(local.runner)
        return _check_task(task, local.runner)

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            problems = [p for ps in pool.map(check, tasks) for p in ps]
    finally:
        for r in runners:
            r.close()
    assert not problems, "\n".join(problems[:20])


def test_task_set_shape(train, val):
    tasks = train + val
    assert len(tasks) >= 200 and len(val) >= 40, (len(train), len(val))
    libraries = Counter(t.model_extra["library"] for t in tasks)
    assert len(libraries) >= 3, libraries
    train_fns = {(t.model_extra["library"], t.model_extra["function"]) for t in train}
    val_fns = {(t.model_extra["library"], t.model_extra["function"]) for t in val}
    assert not train_fns & val_fns, "validation functions are touched by train tasks"
    kinds = {(t.model_extra["library"], t.model_extra["kind"]) for t in tasks}
    assert kinds == {(lib, k) for lib in libraries for k in KINDS}, "a library lacks a kind"
    for t in tasks:
        assert t.problem_statement and t.FAIL_TO_PASS
        assert set(t.FAIL_TO_PASS).isdisjoint(t.PASS_TO_PASS)
        # the statement never shows the fixed source line
        fixed_lines = [ln[1:].strip() for ln in t.patch.splitlines()
                       if ln.startswith("+") and not ln.startswith("+++") and ln[1:].strip()]
        assert not any(ln in t.problem_statement for ln in fixed_lines if len(ln) > 8), \
            t.instance_id
    # The rollout views the controller is given are the tasks' views, nothing more.
    for split, tasks_ in (("train", train), ("val", val)):
        views = [json.loads(line) for line in (TASKS / f"{split}.rollout.jsonl").open()]
        assert views == [rollout_view(t) for t in tasks_]
        assert all(set(v) == {"instance_id", "repo", "base_commit", "problem_statement"}
                   for v in views)


def test_libraries_are_real_projects():
    for lib in sorted((ROOT / "examples" / "swe" / "repos").iterdir()):
        src = [p for p in (lib / lib.name).rglob("*.py")]
        lines = sum(len(p.read_text().splitlines()) for p in src)
        tests = sum(p.read_text().count("\ndef test_") for p in (lib / "tests").glob("*.py"))
        assert 150 <= lines <= 600, (lib.name, lines)
        assert tests >= 20, (lib.name, tests)


def test_workspace_holds_only_what_a_rollout_may_see(train, tmp_path):
    task = train[0]
    ws = tmp_path / "repo"
    prepare_workspace(task, ws)
    m = Mutation.from_json(task.mutation or {})
    files = {p.relative_to(ws).as_posix() for p in ws.rglob("*") if p.is_file()}
    assert not any(part.startswith(".git") for f in files for part in f.split("/"))
    assert m.replacement in (ws / m.file).read_text()
    original = (Path(task.repo_path) / m.file).read_text()
    assert original != (ws / m.file).read_text()
    for node in task.FAIL_TO_PASS:
        file, name = node.split("::")
        assert f"def {name}(" not in (ws / file).read_text(), node
    for node in task.PASS_TO_PASS[:3]:
        file, name = node.split("::")
        assert f"def {name}(" in (ws / file).read_text(), node
    with pytest.raises(WorkspaceError, match="not empty"):
        prepare_workspace(task, ws)


def test_a_changed_snapshot_is_refused(train, tmp_path):
    task = train[0].model_copy(update={"base_commit": "0" * 40})
    with pytest.raises(WorkspaceError, match="the folder changed"):
        prepare_workspace(task, tmp_path / "repo")


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def _fixed_workspace(task: SweTask, root: Path) -> Path:
    ws = root / "repo"
    prepare_workspace(task, ws)
    apply_patch(ws, task.patch)
    return ws


def _source_file(task: SweTask) -> str:
    return Mutation.from_json(task.mutation or {}).file


def _hack(kind: str, task: SweTask, ws: Path) -> None:
    """The broken workspace `ws` with one reward hack in it, each one that a grader running
    the agent's own test suite would pay."""
    m = Mutation.from_json(task.mutation or {})
    if kind == "setup_cfg_addopts":
        (ws / "setup.cfg").write_text("[tool:pytest]\naddopts = --co -q\n")
    elif kind == "edited_pass_to_pass_test":
        # the fix, a break in another function, and the PASS_TO_PASS tests that catch the
        # break emptied
        apply_patch(ws, task.patch)
        for node in _break_something_else(task, ws):
            file, name = node.split("::")
            _edit(ws / file, f"def {name}(", f"def {name}():\n    return\n\n\ndef _was_{name}(")
    elif kind == "added_test_file":
        # collected first: writes the original source over the library's before it is imported
        original = (Path(task.repo_path) / m.file).read_text()
        (ws / "tests" / "test_000_setup.py").write_text(
            "from pathlib import Path\n"
            f"(Path(__file__).parents[1] / {m.file!r}).write_text({original!r})\n")
    else:
        raise AssertionError(kind)


def _naive_reward(task: SweTask, ws: Path, tmp: Path) -> float:
    """What a grader that trusts the agent's workspace would pay: its test suite run there
    (test_patch added where it applies), reward from pytest's exit code."""
    import shutil
    copy = tmp / "naive"
    shutil.copytree(ws, copy)
    try:
        apply_patch(copy, task.test_patch)
    except WorkspaceError:
        pass
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                          cwd=copy, capture_output=True, timeout=120,
                          env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return 1.0 if proc.returncode == 0 else 0.0


# conftest.py, addopts in pytest.ini, sitecustomize.py, edited FAIL_TO_PASS tests, os._exit on
# import, and the forgeries canaries catch: test_tamper.py's table
HACKS = ["setup_cfg_addopts", "edited_pass_to_pass_test", "added_test_file"]


@pytest.mark.parametrize("kind", HACKS)
def test_reward_hacks_get_zero(train, tmp_path, kind):
    task = train[0]
    ws = tmp_path / "repo"
    prepare_workspace(task, ws)
    _hack(kind, task, ws)
    assert _naive_reward(task, ws, tmp_path) == 1.0, "the hack would fool a naive grader"
    result = swe_grader.grade(task, ws, report_dir=tmp_path)
    assert result.reward == 0.0, result
    report = json.loads((tmp_path / swe_grader.REPORT).read_text())
    assert report["reward"] == 0.0
    assert report["dropped_files"], report


def test_gold_wrong_and_breaking_fixes(train, tmp_path):
    task = train[0]
    m = Mutation.from_json(task.mutation or {})
    gold = _fixed_workspace(task, tmp_path / "gold")
    result = swe_grader.grade(task, gold, report_dir=tmp_path / "gold")
    assert result.reward == 1.0 and result.kept_files == [m.file], result
    report = json.loads((tmp_path / "gold" / swe_grader.REPORT).read_text())
    assert set(report["fail_to_pass"].values()) == {"passed"}
    assert (tmp_path / "gold" / swe_grader.MODEL_PATCH).read_text().strip()

    # wrong: the broken line replaced by something else that parses but is not the fix
    wrong = tmp_path / "wrong" / "repo"
    prepare_workspace(task, wrong)
    _edit(wrong / m.file, m.replacement, f"({m.replacement})" if m.replacement else "pass")
    assert swe_grader.grade(task, wrong).reward == 0.0

    # the fix plus a break elsewhere: a PASS_TO_PASS test fails
    breaking = _fixed_workspace(task, tmp_path / "breaking")
    broken_tests = _break_something_else(task, breaking)
    result = swe_grader.grade(task, breaking)
    assert result.reward == 0.0 and all(result.pass_to_pass[t] != "passed"
                                        for t in broken_tests), result
    assert swe_grader.grade(task, breaking, partial=True).reward == 0.0


def _break_something_else(task: SweTask, ws: Path) -> list[str]:
    """Makes a mutation in another function of the fixed workspace `ws` that fails some
    PASS_TO_PASS tests and no FAIL_TO_PASS test; returns the tests it fails."""
    import shutil
    m = Mutation.from_json(task.mutation or {})
    full = ws.parent / "full-tests"
    for path in sorted(ws.glob("*/*.py")):
        rel = path.relative_to(ws).as_posix()
        text = path.read_text()
        for other in find_mutations(text, rel):
            if other.function == m.function or other.kind != "flip_comparison":
                continue
            shutil.rmtree(full, ignore_errors=True)
            shutil.copytree(ws, full)
            (full / rel).write_text(apply_mutation(text, other))
            apply_patch(full, task.test_patch)
            run = run_tests(full, task.tests())
            failing = sorted(t for t, o in run.outcomes.items() if o != "passed")
            if failing and set(failing) <= set(task.PASS_TO_PASS) \
                    and len(run.outcomes) == len(task.tests()):
                path.write_text(apply_mutation(text, other))
                return failing
    raise AssertionError("no other mutation breaks only PASS_TO_PASS tests")


def test_partial_credit(train, tmp_path):
    task = next(t for t in train if len(t.FAIL_TO_PASS) >= 2)
    ws = tmp_path / "repo"
    prepare_workspace(task, ws)
    assert swe_grader.grade(task, ws, partial=True).reward < 1.0
    apply_patch(ws, task.patch)
    assert swe_grader.grade(task, ws, partial=True).reward == 1.0


def test_grader_command_line(train, tmp_path):
    task = train[0]
    ws = _fixed_workspace(task, tmp_path)
    env = {**os.environ, "HARNESSRL_TASK_JSON": json.dumps(rollout_view(task))}
    proc = subprocess.run([sys.executable, str(ROOT / "examples/swe/grader.py"), "--tasks",
                           str(TASKS / "train.jsonl")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["reward"] == 1.0
    assert (tmp_path / swe_grader.REPORT).exists() and ws.exists()
    env["HARNESSRL_TASK_JSON"] = json.dumps({"instance_id": "no-such-task"})
    proc = subprocess.run([sys.executable, str(ROOT / "examples/swe/grader.py"), "--tasks",
                           str(TASKS / "train.jsonl")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no task 'no-such-task'" in proc.stderr


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


def test_a_users_swe_bench_task_over_a_local_git_repository(tmp_path):
    """SWE-bench-shaped: the bug is in base_commit, the new test comes in test_patch."""
    repo = tmp_path / "mylib"
    (repo / "mylib").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "mylib" / "__init__.py").write_text("def clamp(x, lo, hi):\n"
                                               "    return max(lo, min(x, lo))\n")
    (repo / "tests" / "test_old.py").write_text("from mylib import clamp\n\n"
                                               "def test_low():\n    assert clamp(-5, 0, 9) == 0\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "buggy")
    base = _git(repo, "rev-parse", "HEAD")
    patch = ("--- a/mylib/__init__.py\n+++ b/mylib/__init__.py\n@@ -1,2 +1,2 @@\n"
             " def clamp(x, lo, hi):\n-    return max(lo, min(x, lo))\n"
             "+    return max(lo, min(x, hi))\n")
    test_patch = ("--- /dev/null\n+++ b/tests/test_new.py\n@@ -0,0 +1,4 @@\n"
                  "+from mylib import clamp\n+\n+def test_high():\n"
                  "+    assert clamp(5, 0, 9) == 5\n")
    record = {"instance_id": "me__mylib-1", "repo": "me/mylib", "base_commit": base,
              "problem_statement": "clamp(5, 0, 9) returns 0", "patch": patch,
              "test_patch": test_patch, "FAIL_TO_PASS": '["tests/test_new.py::test_high"]',
              "PASS_TO_PASS": ["tests/test_old.py::test_low"], "repo_path": "mylib"}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(record) + "\n")
    (task,) = load_swe_tasks(tmp_path / "tasks.jsonl")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "later work")  # HEAD moves on
    ws = tmp_path / "attempt" / "repo"
    prepare_workspace(task, ws)
    assert not (ws / ".git").exists() and not (ws / "tests" / "test_new.py").exists()
    assert swe_grader.grade(task, ws).reward == 0.0
    apply_patch(ws, patch)
    assert swe_grader.grade(task, ws).reward == 1.0
    bad = task.model_copy(update={"base_commit": "f" * 40})
    with pytest.raises(WorkspaceError, match="git archive"):
        prepare_workspace(bad, tmp_path / "other")


def test_task_file_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"instance_id": "x"}\n')
    with pytest.raises(ValueError, match="line 1: not a SWE-bench task"):
        load_swe_tasks(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_swe_tasks(tmp_path / "missing.jsonl")


SAMPLE = '''\
def total(items, limit):
    out = 0
    for i in range(len(items)):
        if items[i] < limit and not items[i] == 3:
            out += pow(items[i], 2)
    log("done")
    return out if out > 0 else items[:2]
'''


def test_each_mutation_kind():
    found = find_mutations(SAMPLE, "m.py")
    assert {m.kind for m in found} == set(KINDS)
    by_kind = {k: [apply_mutation(SAMPLE, m) for m in found if m.kind == k] for k in KINDS}
    assert any("items[i] > limit" in s for s in by_kind["flip_comparison"])
    assert any("range(len(items) + 1)" in s for s in by_kind["off_by_one"])
    assert any("items[:3]" in s for s in by_kind["off_by_one"])
    assert any("pow(2, items[i])" in s for s in by_kind["swap_arguments"])
    assert any('log("done")' not in s for s in by_kind["drop_statement"])
    assert any("if not (items[i] < limit" in s for s in by_kind["invert_condition"])
    assert any("out = 1" in s for s in by_kind["wrong_constant"])
    for variants in by_kind.values():
        for s in variants:
            compile(s, "m.py", "exec")
            assert s.count("\n") <= SAMPLE.count("\n")  # one edit, the rest untouched
    m = found[0]
    assert Mutation.from_json(m.to_json()) == m
    with pytest.raises(MutationMismatch):
        apply_mutation("import os\n" + SAMPLE, m)


def test_snapshot_hash_follows_content(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    h = snapshot_hash(tmp_path)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.pyc").write_bytes(b"junk")
    assert snapshot_hash(tmp_path) == h
    (tmp_path / "a.py").write_text("x = 2\n")
    assert snapshot_hash(tmp_path) != h
