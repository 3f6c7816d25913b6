"""`suspects [TEST]`: spectrum-based fault localisation for the swe example's learning proof, a
tool shipped beside the harness (outside the workspace; the grader takes only source changes).

With a line tracer on the functions with the longest name NAME such that TEST (default: the
failing test that the issue's first line names) is `test_NAME` or `test_NAME_...`, it runs the issue's reproduction (the failing test's code, the first
```python block of the problem statement in `$SWE_ISSUE`, which the harness writes beside the
workspace, run in the namespace of the test module the statement names) and then the
workspace's own test suite (pytest, in the current folder; the failing tests are not in it),
and prints each comparison of those functions on a line that the reproduction executed and
no passing test did, one a line: `FILE:LINE: EXPR` (without an issue: every line no passing
test executed), and keeps them in `$SWE_ISSUE.suspects` for `fix NEW` (`suspects.py --fix`),
which gives the first suspect's comparison the operator NEW (`fix flip`: its flipped
operator, `<` <-> `>`, `<=` <-> `>=`, `==` <-> `!=`, `in` <-> `not in`, `is` <-> `is not`).
"""

from __future__ import annotations

import ast
import contextlib
import glob
import importlib.util
import os
import re
import sys


def targets(test: str) -> list[tuple[str, str, ast.FunctionDef]]:
    fs = [(p, s, f) for p in sorted(glob.glob("*/*.py")) if not p.startswith("tests/")
          for s in [open(p).read()] for f in ast.walk(ast.parse(s))
          if isinstance(f, ast.FunctionDef)
          and (test == f"test_{f.name}" or test.startswith(f"test_{f.name}_"))]
    n = max((len(f.name) for _, _, f in fs), default=0)
    return [t for t in fs if len(t[2].name) == n]


def _tracer(files: set[str], seen: set[tuple[str, int]]):  # type: ignore[no-untyped-def]

    def local(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "line":
            seen.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def glob_(frame, event, arg):  # type: ignore[no-untyped-def]
        return local if frame.f_code.co_filename in files else None

    return glob_


def traced(files: set[str], run) -> set[tuple[str, int]]:  # type: ignore[no-untyped-def]
    """(file, line) of every line `run()` executed in `files` (absolute paths)."""
    seen: set[tuple[str, int]] = set()
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), \
            contextlib.redirect_stderr(null):
        sys.settrace(_tracer(files, seen))
        try:
            run()
        except BaseException:  # noqa: BLE001 - the reproduction fails: that is the point
            pass
        finally:
            sys.settrace(None)
    return seen


def reproduction(issue: str):  # type: ignore[no-untyped-def]
    """A function that runs the issue's reproduction, or None."""
    m = re.search(r"the test `([^`:]+)::(test_\w+)` fails", issue)
    code = re.search(r"```python\n(.*?)```", issue, re.S)
    if not m or not code or not os.path.exists(m.group(1)):
        return None
    path, name = m.groups()

    def run() -> None:
        spec = importlib.util.spec_from_file_location("_suspects_repro", path)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        exec(code.group(1), mod.__dict__)  # noqa: S102 - the issue's own reproduction
        mod.__dict__[name]()

    return run


def fix(new: str, issue: str) -> int:
    """`fix NEW`: the first suspect's comparison gets the operator NEW (the first ` OP ` on
    its line becomes ` NEW `; `fix flip`: ` FLIP[OP] `); the suspects are the ones `suspects`
    printed last for this issue (`$SWE_ISSUE.suspects`)."""
    try:
        first = open(f"{issue}.suspects").read().splitlines()[0]
    except (OSError, IndexError):
        print("fix: run suspects first")
        return 1
    path, line, expr = first.split(":", 2)
    n = int(line)
    src = open(path).read()
    comp = next((c for c in ast.walk(ast.parse(src)) if isinstance(c, ast.Compare)
                 and c.lineno == n and ast.get_source_segment(src, c) == expr.strip()), None)
    if comp is None:
        print(f"fix: {path}:{n} no longer holds {expr.strip()}")
        return 1
    old = OPS[type(comp.ops[0])]
    new = FLIP[old] if new == "flip" else new
    lines = src.splitlines(keepends=True)
    lines[n - 1] = lines[n - 1].replace(f" {old} ", f" {new} ", 1)
    with open(path, "w") as f:
        f.write("".join(lines))
    return 0


OPS = {ast.Lt: "<", ast.Gt: ">", ast.LtE: "<=", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
       ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
# the flip the task family's mutation applies (examples/swe/mutations._FLIP); its own inverse
FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "==": "!=", "!=": "==",
        "in": "not in", "not in": "in", "is": "is not", "is not": "is"}


def main(argv: list[str]) -> int:
    issue = os.environ.get("SWE_ISSUE", "")
    if argv[:1] == ["--fix"]:
        return fix(" ".join(argv[1:]), issue) if len(argv) > 1 else 2
    text = open(issue).read() if os.path.isfile(issue) else ""
    named = re.search(r"the test `[^`:]+::(test_\w+)` fails", text)
    if len(argv) > 1 or not (argv or named):
        print("usage: suspects [TEST_NAME]  (default: the failing test of $SWE_ISSUE)",
              file=sys.stderr)
        return 2
    test = argv[0] if argv else named.group(1)  # type: ignore[union-attr]
    fs = targets(test)
    if not fs:
        print(f"no function named after {test}")
        return 1
    import pytest

    files = {os.path.abspath(p) for p, _, _ in fs}
    sys.path.insert(0, os.getcwd())
    repro = reproduction(text) if text else None
    hit = traced(files, repro) if repro else None
    seen = traced(files, lambda: pytest.main(["-q", "-p", "no:cacheprovider", "tests"]))
    out = [f"{p}:{c.lineno}: {ast.get_source_segment(s, c)}" for p, s, f in fs
           for c in ast.walk(f) if isinstance(c, ast.Compare)
           and (os.path.abspath(p), c.lineno) not in seen
           and (hit is None or (os.path.abspath(p), c.lineno) in hit)]
    print("".join(f"{ln}\n" for ln in out), end="")
    if issue:
        with open(f"{issue}.suspects", "w") as f:
            f.write("".join(f"{ln}\n" for ln in out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
