"""Equivalent forms of the learning proof's RL tasks, so that they show every operator.

A flip task breaks the comparison `L op R` of a function into `L flip(op) R`; the policy's
list move shows the broken comparison and the model's one decision is the operator to write
back (the flip of the one shown). The slice's RL tasks come from the few functions that are
not held out, and they show few operators (the first learning runs: `in`, `is`, `>`, `==`,
`<`, none of the held-out set's most common `!=` and `>=`); RL moved the choice towards the
operators it saw rather than towards each task's right one.

A form rewrites the task's correct comparison into an equivalent one, in a snapshot of the
library of its own, and breaks the form's comparison by the same flip:

- `mirror` (ordering operators): `R mirror(op) L`, e.g. `a < b` -> `b > a`;
- `neg`: `not (L neg(op) R)`, e.g. `a < b` -> `not (a >= b)`, `x in s` -> `not (x not in s)`;
- `mirror_neg` (ordering operators): both.

The broken code means what the task's broken code means (`not (a <= b)` is `a > b`), so the
same tests fail with the same messages: statement, FAIL_TO_PASS and PASS_TO_PASS are the
task's. The listing shows another operator (`a <= b` instead of `a > b`). The forms are only
RL tasks: held-out tasks and warm-up tasks stay as made by `make_tasks`. Each form is kept
only when it is checked on its real workspace: the list move pins the broken line, the
unchanged workspace grades 0, and the policy's right fix (the flip of the operator shown)
grades 1.
"""

from __future__ import annotations

import ast
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from examples.swe import policy
from examples.swe.make_tasks import unified
from examples.swe.swe_tasks import SweTask, snapshot_hash
from examples.swe.workspace import export_snapshot, prepare_workspace

MIRROR = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}
NEG = {"<": ">=", ">=": "<", ">": "<=", "<=": ">", "==": "!=", "!=": "==",
       "in": "not in", "not in": "in", "is": "is not", "is not": "is"}
FLIP = policy.RIGHT  # the flip map is its own inverse: `a < b` <-> `a > b`


def split_compare(text: str) -> tuple[str, str, str]:
    """(left, operator, right) of a one-operator comparison written on one line."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Compare) or len(node.ops) != 1:
        raise ValueError(f"not a one-operator comparison: {text!r}")
    src = text.strip()
    left = ast.get_source_segment(src, node.left)
    right = ast.get_source_segment(src, node.comparators[0])
    assert left is not None and right is not None and node.left.end_col_offset is not None
    op = " ".join(src[node.left.end_col_offset:node.comparators[0].col_offset].split())
    if op not in NEG:  # e.g. a parenthesised operand: `(a) < b`
        raise ValueError(f"no operator alone between the operands of {text!r}")
    return left, op, right


def correct_forms(original: str) -> dict[str, tuple[str, int, str]]:
    """The forms of the correct comparison `original`: name -> (the form's text, the offset
    of its inner comparison in that text, the inner comparison)."""
    left, op, right = split_compare(original)
    forms = {"neg": f"{left} {NEG[op]} {right}"}
    if op in MIRROR:
        forms["mirror"] = f"{right} {MIRROR[op]} {left}"
        forms["mirror_neg"] = f"{right} {NEG[MIRROR[op]]} {left}"
    return {name: ((f"not ({inner})", 5, inner) if name.endswith("neg") else (inner, 0, inner))
            for name, inner in forms.items()}


def form_task(task: dict[str, Any], name: str, root: Path) -> dict[str, Any]:
    """The task in form `name`: a snapshot of its library with the correct comparison
    rewritten (under `root`), and the flip of the form's comparison as its mutation."""
    m = task["mutation"]
    text, offset, inner = correct_forms(m["original"])[name]
    left, op, right = split_compare(inner)
    broken_inner = f"{left} {FLIP[op]} {right}"
    snap = root / f"{task['instance_id']}__{name}"
    shutil.rmtree(snap, ignore_errors=True)
    export_snapshot(SweTask.model_validate(task), snap)  # the task's library, as it is
    path = snap / m["file"]
    lines = path.read_text().splitlines(keepends=True)
    line, col = lines[m["line"] - 1], m["col"]
    if line[col:col + len(m["original"])] != m["original"]:
        raise ValueError(f"{task['instance_id']}: the mutation's text is not at its column")
    correct = line[:col] + text + line[col + len(m["original"]):]
    broken = correct[:col + offset] + broken_inner + correct[col + offset + len(inner):]
    lines[m["line"] - 1] = correct
    source = "".join(lines)
    ast.parse(source)  # the rewritten library still parses
    path.write_text(source)
    lines[m["line"] - 1] = broken
    return {**task, "instance_id": f"{task['instance_id']}__{name}",
            "base_commit": snapshot_hash(snap), "repo_path": str(snap),
            "patch": unified(m["file"], "".join(lines), source),
            "mutation": {**m, "col": col + offset, "end_col": col + offset + len(inner),
                         "original": inner, "replacement": broken_inner},
            "form": name}


def checked(task: dict[str, Any], tmp: Path, templates: dict[str, Any]) -> str | None:
    """Why the form task `task` is not kept (None: kept). See the module docstring."""
    from examples.swe import grader

    info = policy.in_slice(task)
    if info is None:
        return "not in the policy's slice"
    ws = tmp / task["instance_id"]
    prepare_workspace(task, ws)
    env = policy.command_env(templates, task["problem_statement"], Path(f"{ws}.attempt"))
    if policy.usable(task, info, ws, env) is None:
        return "the list move does not pin the broken line"
    t = SweTask.model_validate(task)
    if grader.grade(t, ws, timeout_s=120).reward != 0.0:
        return "the broken workspace does not grade 0"
    policy.run_like_mini(policy.fix_move(info.op, True), ws, env)
    if grader.grade(t, ws, timeout_s=120).reward != 1.0:
        return "the right fix does not grade 1"
    return None


def make_forms(tasks: list[dict[str, Any]], root: Path, mini_config: Path,
               ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every form of every task, checked (two at a time): the kept ones, and why the others
    were dropped, by instance_id."""
    templates = policy.mini_templates(mini_config)
    forms, dropped = [], {}
    for t in tasks:
        try:
            forms += [form_task(t, name, root) for name in correct_forms(t["mutation"]["original"])]
        except (ValueError, SyntaxError) as exc:  # a comparison this rewrite does not handle
            dropped[t["instance_id"]] = str(exc)
    with tempfile.TemporaryDirectory(prefix="swe-forms-") as tmp_s, ThreadPoolExecutor(2) as pool:
        why = list(pool.map(lambda t: checked(t, Path(tmp_s), templates), forms))
    dropped.update({t["instance_id"]: w for t, w in zip(forms, why) if w is not None})
    return [t for t, w in zip(forms, why) if w is None], dropped
