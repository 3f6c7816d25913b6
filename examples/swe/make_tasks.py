"""Makes the example's SWE task set from its libraries (`examples/swe/repos/*`), SWE-smith style.

For each library, each function of its source and each mutation site (`mutations.KINDS`): the
mutation is made in a copy and the library's whole test suite is run. The mutation becomes a
task only if at least one test fails (FAIL_TO_PASS), at most `--max-fail` do, every other test
still passes (PASS_TO_PASS), and the run ends within its time limit. Mutations that give the
same broken source are one. A function gives at most `--per-function` tasks of each kind.

Each task's `problem_statement` is written from what fails: the failing test's name, its code
as a reproduction, pytest's assertion lines, and how many other tests fail; it never names the
fix. `patch` is the gold fix (broken → working source), `test_patch` gives back the
FAIL_TO_PASS tests, which the workspace leaves out.

Split: by function. A share `--val-share` of each library's functions (chosen by a hash of the
library and function name, so it is stable as tasks are added) gives the validation tasks;
train tasks never touch them.

`python -m examples.swe.make_tasks` rewrites `examples/swe/tasks/{train,val}.jsonl` and their
rollout views `{train,val}.rollout.jsonl`; it takes a few minutes (a test run per mutation).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import os
import re
import shutil
import sys
import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.swe.grader import source_change_allowed
from examples.swe.mutations import KINDS, Mutation, apply_mutation, find_mutations
from examples.swe.swe_tasks import SweTask, rollout_view, snapshot_files, snapshot_hash
from examples.swe.testrun import TestRunner, run_tests

HERE = Path(__file__).resolve().parent
REPOS = HERE / "repos"
OUT = HERE / "tasks"
STATEMENT_TEST_LINES = 24
STATEMENT_ASSERT_LINES = 8


def test_functions(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (first line incl. decorators, last line) of each top-level test function."""
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name.startswith("test"):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out[node.name] = (first, node.end_lineno or node.lineno)
    return out


def strip_tests(source: str, path: Path, names: set[str]) -> str:
    """`source` (the test module at `path`) without the test functions `names`."""
    lines = source.splitlines(keepends=True)
    spans = sorted((span for n, span in test_functions(path).items() if n in names),
                   reverse=True)
    for first, last in spans:
        end = last
        while end < len(lines) and not lines[end].strip():  # the blank lines after it
            end += 1
        del lines[first - 1:end]
    return "".join(lines)


def unified(rel: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(keepends=True),
                                        new.splitlines(keepends=True), f"a/{rel}", f"b/{rel}"))


def failure_lines(message: str) -> list[str]:
    """pytest's `E ` lines (the assertion and its values), never the traceback's code."""
    out = [ln.rstrip() for ln in message.splitlines() if ln.startswith("E ")]
    if not out and message:
        out = [message.splitlines()[0][:200]]
    return out[:STATEMENT_ASSERT_LINES]


def problem_statement(lib: str, repo: Path, failing: list[str], messages: dict[str, str],
                      total: int) -> str:
    first = failing[0]
    file, name = first.split("::", 1)
    src = (repo / file).read_text().splitlines()
    a, b = test_functions(repo / file)[name]
    body = src[a - 1:b]
    if len(body) > STATEMENT_TEST_LINES:
        body = body[:STATEMENT_TEST_LINES] + ["    ..."]
    parts = [f"In `{lib}`, the test `{first}` fails.", "", "Reproduction:", "",
             "```python", *body, "```", "", "What pytest reports:", "", "```",
             *failure_lines(messages.get(first, "")), "```"]
    others = [t.split("::", 1)[1] for t in failing[1:]]
    if others:
        shown = ", ".join(f"`{t}`" for t in others[:5]) + (" ..." if len(others) > 5 else "")
        parts += ["", f"{len(others)} more test{'s' if len(others) > 1 else ''} fail"
                      f"{'s' if len(others) == 1 else ''} the same way: {shown}."]
    parts += ["", f"The other {total - len(failing)} tests pass. Make the library behave as "
                  "the test expects; the tests are right, change only the library's code."]
    return "\n".join(parts)


def _split_of(lib: str, function: str, val_share: float) -> str:
    h = int(hashlib.sha256(f"{lib}:{function}".encode()).hexdigest()[:8], 16)
    return "val" if h / 0xFFFFFFFF < val_share else "train"


def _instance_id(lib: str, m: Mutation, n: int) -> str:
    fn = re.sub(r"[^A-Za-z0-9]+", "_", m.function).strip("_")
    return f"harnessrl__{lib}__{fn}__{m.kind}-{n}"


def library_tasks(repo: Path, out: Path, *, max_fail: int, per_function: int, val_share: float,
                  jobs: int) -> list[dict[str, Any]]:
    lib = repo.name
    base = snapshot_hash(repo)
    tests_rel = {p.relative_to(repo).as_posix() for p in snapshot_files(repo)
                 if source_change_allowed(PurePosixPath(p.relative_to(repo).as_posix()), repo)
                 == "a test file"}
    baseline = run_tests(repo, [])
    if baseline.exit_code != 0 or not baseline.outcomes:
        raise SystemExit(f"{lib}: the unmutated tests do not all pass:\n{baseline.output_tail}")
    all_tests = sorted(baseline.outcomes)
    sources = [p for p in snapshot_files(repo) if p.suffix == ".py"
               and p.relative_to(repo).as_posix() not in tests_rel]
    candidates: list[tuple[Mutation, str, str]] = []  # (mutation, original, mutated)
    seen: set[str] = set()
    for path in sources:
        rel = path.relative_to(repo).as_posix()
        text = path.read_text()
        for m in find_mutations(text, rel):
            try:
                mutated = apply_mutation(text, m)
            except ValueError:
                continue
            key = hashlib.sha256(f"{rel}\0{mutated}".encode()).hexdigest()
            if key not in seen:
                seen.add(key)
                candidates.append((m, text, mutated))

    local = threading.local()
    runners: list[TestRunner] = []

    def check(item: tuple[Mutation, str, str]) -> tuple[Mutation, str, str, Any]:
        m, _, mutated = item
        if not hasattr(local, "runner"):
            local.runner = TestRunner(sandbox=False)  # our own libraries' mutations: trusted
            runners.append(local.runner)
        with local.runner.scratch(f"swe-mut-{lib}-") as tmp:
            copy = Path(tmp) / lib
            shutil.copytree(repo, copy, ignore=shutil.ignore_patterns("__pycache__",
                                                                      ".pytest_cache"))
            (copy / m.file).write_text(mutated)
            return (*item, local.runner.run(copy, [], timeout_s=20))

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(check, candidates))
    finally:
        for r in runners:
            r.close()
    tasks: list[dict[str, Any]] = []
    taken: Counter[tuple[str, str]] = Counter()
    for m, original, mutated, run in results:
        failing = sorted(t for t, o in run.outcomes.items() if o != "passed")
        if (run.timed_out or run.exit_code != 1 or set(run.outcomes) != set(all_tests)
                or not 1 <= len(failing) <= max_fail):
            continue
        if taken[(m.function, m.kind)] >= per_function:
            continue
        taken[(m.function, m.kind)] += 1
        passing = [t for t in all_tests if t not in failing]
        test_patch = ""
        by_file: dict[str, set[str]] = defaultdict(set)
        for t in failing:
            file, name = t.split("::", 1)
            by_file[file].add(name)
        for file, names in sorted(by_file.items()):
            full = (repo / file).read_text()
            test_patch += unified(file, strip_tests(full, repo / file, names), full)
        tasks.append({
            "instance_id": _instance_id(lib, m, taken[(m.function, m.kind)]),
            "repo": f"harnessrl-examples/{lib}",
            "base_commit": base,
            "problem_statement": problem_statement(lib, repo, failing, run.messages,
                                                   len(all_tests)),
            "patch": unified(m.file, mutated, original),
            "test_patch": test_patch,
            "FAIL_TO_PASS": failing,
            "PASS_TO_PASS": passing,
            "repo_path": os.path.relpath(repo, out),
            "mutation": m.to_json(),
            "split": _split_of(lib, m.function, val_share),
            "library": lib,
            "function": m.function,
            "kind": m.kind,
        })
    print(f"{lib}: {len(candidates)} mutations tried, {len(tasks)} tasks "
          f"({dict(Counter(t['kind'] for t in tasks))})", file=sys.stderr)
    return tasks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repos", type=Path, default=REPOS, help="a folder of libraries")
    ap.add_argument("--libraries", nargs="*", help="default: every folder of --repos")
    ap.add_argument("--max-fail", type=int, default=6, help="at most this many FAIL_TO_PASS")
    ap.add_argument("--per-function", type=int, default=2,
                    help="at most this many tasks per function and mutation kind")
    ap.add_argument("--val-share", type=float, default=0.3,
                    help="share of each library's functions kept for validation")
    ap.add_argument("--jobs", type=int, default=2, help="test runs at once")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    libs = a.libraries or sorted(p.name for p in a.repos.iterdir() if p.is_dir())
    a.out.mkdir(parents=True, exist_ok=True)
    tasks = [t for lib in libs for t in library_tasks(
        (a.repos / lib).resolve(), a.out.resolve(), max_fail=a.max_fail, per_function=a.per_function, val_share=a.val_share,
        jobs=a.jobs)]
    a.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        chosen = [t for t in tasks if t["split"] == split]
        (a.out / f"{split}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in chosen))
        views = [rollout_view(SweTask.model_validate(t)) for t in chosen]
        (a.out / f"{split}.rollout.jsonl").write_text(
            "".join(json.dumps(v) + "\n" for v in views))
        kinds = Counter(t["kind"] for t in chosen)
        fns = len({(t["library"], t["function"]) for t in chosen})
        print(f"{split}: {len(chosen)} tasks from {fns} functions {dict(kinds)}")
    assert set(KINDS) >= {t["kind"] for t in tasks}
    return 0


if __name__ == "__main__":
    sys.exit(main())
