"""The warm-up policy of the swe learning proof: three copy moves that fix a flipped comparison,
and the mini-swe-agent dialogues they make.

A tiny model cannot reason about code, but it can copy. The policy the warm-up teaches is

1. `suspects`: the example's fault-localisation tool, for the failing test that the problem
   statement's first line names (which the slice requires to be `test_<NAME>...` for the
   mutated function NAME; the tool reads the statement that the harness writes beside the
   workspace, so the move has no slot). It (`examples/swe/tools/suspects.py`, beside the
   harness, outside the workspace) runs the issue's reproduction and the workspace's tests
   (the failing ones are not there) and prints each comparison of NAME on a line the
   reproduction executes and no passing test does: `FILE:LINE: EXPR`.
2. The fix move, the one decision left open: `fix flip` (right: the tool gives the first
   suspect's comparison its flipped operator, which undoes the mutation: it turned `>` into
   `<`, `<` back to `>`) or `fix 'OP'` with the operator the listing shows (wrong: the edit
   writes the comparison as it stands and leaves the bug in place). The choice is the same
   words for every task, like the calc example's "The answer is" against "I estimate"
   (examples/calc), so what RL teaches on a few functions holds for the held-out ones. The
   warm-up dialogues take the right fix with probability `right_fraction`, so the warmed-up
   policy is right about that often and RL has headroom. (The first three learning attempts
   wrote the inverse operator itself, `fix '>'`: a choice per operator, read off the
   listing; RL did not carry it to held-out functions: examples/swe/LEARNING.md.)
3. `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`: submits.

The slice (`in_slice`): flip_comparison tasks whose mutation is one operator on one line,
whose failing test is named `test_<NAME>...` for the mutated function NAME, whose broken
line the fix move (first occurrence of ` OP ` on that line) turns back into the working
line, and (`usable`, run in the broken workspace) whose `suspects` output starts with that
line.

The warm-up dialogues these moves make: `examples/swe/dialogues.py`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from jinja2 import StrictUndefined, Template

HERE = Path(__file__).resolve().parent
MINI_CONFIG = HERE / "mini.yaml"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

# mini 2.4.6's bash tool (minisweagent/models/utils/actions_toolcall.py BASH_TOOL), the one
# tool every request carries
BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command",
    "parameters": {"type": "object", "properties": {"command": {
        "type": "string", "description": "The bash command to execute"}},
        "required": ["command"]}}}

# broken operator -> the fix (the inverse, as mutations._FLIP) and the wrong one
RIGHT = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "==": "!=", "!=": "==",
         "in": "not in", "not in": "in", "is": "is not", "is not": "is"}
WRONG = {op: op for op in RIGHT}  # the operator copied: the edit changes nothing
_OPS = sorted(RIGHT, key=len, reverse=True)


LIST = "suspects"  # the failing test: the one the issue names (the tool reads it)


def list_command(test: str) -> str:
    """The list move; `test` is what the tool takes from the issue itself."""
    return LIST


def fix_command(new: str) -> str:
    """The fix move: the tool `fix` gives the first suspect's comparison the operator NEW,
    quoted (unquoted, `<` and `>` are the shell's redirections: the first learning run wrote
    `fix <`, a syntax error, on 17 of its 30 held-out tasks' right fixes)."""
    return f"fix '{new}'"


FLIP_MOVE = "fix flip"  # the right fix: the tool writes the flipped operator (RIGHT)


def fix_move(op: str, right: bool) -> str:
    """The policy's fix move for a listing that shows `op`: `fix flip`, or `op` copied."""
    return FLIP_MOVE if right else fix_command(WRONG[op])


@dataclass(frozen=True)
class SliceInfo:
    test: str  # the first failing test's name (what the list move copies)
    file: str
    line: int
    op: str  # the broken operator, as it stands in the workspace
    function: str = ""  # the mutated function's own name


def _broken_op(m: dict[str, Any]) -> str | None:
    """The operator the mutation wrote: the one where original and replacement differ."""
    orig, repl = m["original"], m["replacement"]
    for op in _OPS:
        for inv in (RIGHT[op],):
            if repl.replace(f" {op} ", f" {inv} ", 1) == orig and f" {op} " in repl:
                return op
    return None


def in_slice(task: Any) -> SliceInfo | None:
    """The policy's view of a task, or None when the task is not in the slice."""
    rec = task if isinstance(task, dict) else task.model_dump()
    m = rec.get("mutation") or {}
    if rec.get("kind", m.get("kind")) != "flip_comparison" or m.get("line") != m.get("end_line"):
        return None
    name = m["function"].split(".")[-1]
    if name.startswith("_") or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return None
    first_test = rec["FAIL_TO_PASS"][0].split("::")[-1]
    if not (first_test == f"test_{name}" or first_test.startswith(f"test_{name}_")):
        return None
    if f"::{first_test}` fails" not in rec["problem_statement"]:
        return None
    op = _broken_op(m)
    if op is None:
        return None
    return SliceInfo(first_test, m["file"], m["line"], op, name)


def mini_templates(config: Path = MINI_CONFIG) -> dict[str, str]:
    data = yaml.safe_load(config.read_text())
    return {"system": data["agent"]["system_template"],
            "instance": data["agent"]["instance_template"],
            "observation": data["model"]["observation_template"],
            "env": data["environment"].get("env", {})}


def command_env(templates: dict[str, Any], statement: str, workdir: Path) -> dict[str, str]:
    """What the agent's commands see besides the process's environment: mini.yaml's
    `environment.env` and the harness's tools (as `harness.mini_env` gives mini), with the
    problem statement written to `workdir/issue.md` as the setup step writes it."""
    from examples.swe.harness import tools_env

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "issue.md").write_text(statement)
    return {**tools_env(dict(os.environ), workdir / "issue.md"),
            **{k: str(v) for k, v in templates["env"].items()}}


def render(template: str, **kw: Any) -> str:
    return Template(template, undefined=StrictUndefined).render(**kw)


def run_like_mini(command: str, cwd: Path, env: dict[str, str], timeout: int = 60) -> dict:
    """mini's LocalEnvironment.execute (shell=True, stderr into stdout, utf-8 replace)."""
    p = subprocess.run(command, shell=True, text=True, cwd=cwd, env=os.environ | env,
                       encoding="utf-8", errors="replace", stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=timeout, start_new_session=True)
    return {"output": p.stdout, "returncode": p.returncode, "exception_info": ""}


def moves(info: SliceInfo, right: bool) -> list[str]:
    return [list_command(info.test), fix_move(info.op, right), SUBMIT]


def listing_pins(info: SliceInfo, output: str) -> bool:
    """The list move's first line is the broken line (the sed move copies the first line)."""
    lines = output.splitlines()
    return bool(lines) and lines[0].startswith(f"{info.file}:{info.line}: ")


def sed_fixes(task: Any, info: SliceInfo, workspace: Path) -> bool:
    """The right sed (first ` OP ` on the broken line) gives back the working line."""
    m = (task if isinstance(task, dict) else task.model_dump())["mutation"]
    broken = (workspace / info.file).read_text().splitlines()[info.line - 1]
    col = m["col"]
    if broken[col:col + len(m["replacement"])] != m["replacement"]:
        return False
    working = broken[:col] + m["original"] + broken[col + len(m["replacement"]):]
    return broken.replace(f" {info.op} ", f" {RIGHT[info.op]} ", 1) == working


def usable(task: Any, info: SliceInfo, workspace: Path, env: dict[str, str]) -> str | None:
    """In the slice for real: in the task's broken workspace the right sed fixes it and the
    list move's output starts with the broken line; that output, else None."""
    if not sed_fixes(task, info, workspace):
        return None
    out = run_like_mini(list_command(info.test), workspace, env)["output"]
    return out if listing_pins(info, out) else None


def strip_for_api(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A trajectory's messages as mini sends them (no `extra`), for comparison."""
    out = []
    for m in messages:
        if m.get("role") == "exit":
            continue
        d = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            d["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                             "arguments": json.loads(
                                                 c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(d)
    return out
