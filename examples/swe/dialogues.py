"""The swe learning proof's warm-up dialogues: mini-swe-agent's own messages when a model
plays the policy's moves (`examples/swe/policy.py`) on a slice task or a warm-up variant of it.

The system and instance templates of `examples/swe/mini.yaml` are rendered as mini renders
them (jinja2, StrictUndefined), the commands run as mini's local environment runs them (`bash`
via `subprocess` with stderr merged, in the task's real broken workspace, with mini's
environment variables, the harness's tools and the statement in `issue.md` beside the
workspace) and their outputs rendered with mini.yaml's `observation_template`.
`learning.py verify` runs mini itself (its own venv) against the scripted engine with the
same moves and checks that its trajectory's messages are these, message for message.

Warm-up variants (`make_dialogues`): another operator of the broken one's family on the broken
line, fresh names (`rename_map`), the broken file shifted down; see `dialogue`.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from examples.swe.policy import SUBMIT, SliceInfo, command_env, in_slice, list_command, \
    listing_pins, mini_templates, moves, render, run_like_mini, sed_fixes


def rename_map(info: SliceInfo, rng: random.Random,
               words: list[str] | None = None) -> dict[str, str]:
    """Fresh names for the mutated function and the failing test (same shape: the test stays
    `test_<function>_...`), so that a warm-up dialogue cannot be memorised by its names and
    the model must copy them (the first run of this proof memorised 43 tasks' names: 0 of 76
    list moves on held-out tasks copied the test's name). Each part of a name is a word of
    `words` (identifier parts, `identifier_words`) or, one time in four, random letters; a
    new function name is never one of `words` itself (no clash with a name in the code)."""
    import keyword

    letters = "abcdefghijklmnopqrstuvwxyz"
    pool = set(words or [])

    def word() -> str:
        while True:
            w = (rng.choice(words) if words and rng.random() < 0.75 else
                 "".join(rng.choice(letters) for _ in range(rng.randint(3, 7))))
            if not keyword.iskeyword(w):
                return w

    fn_name = _function_of(info)
    new_fn = ""
    while not new_fn or new_fn in pool or new_fn == fn_name:
        new_fn = "_".join(word() for _ in range(rng.randint(1, 3)))
    suffix = info.test[len("test_") + len(fn_name):]  # "" or "_<case>"
    new_suffix = "".join(f"_{word()}" for _ in range(rng.randint(1, 4))) if suffix else ""
    stem, new_stem = Path(info.file).stem, ""  # the module too (its file and its imports)
    while not new_stem or new_stem in pool or new_stem in (stem, new_fn):
        new_stem = "_".join(word() for _ in range(rng.randint(1, 2)))
    return {fn_name: new_fn, info.test: f"test_{new_fn}{new_suffix}", stem: new_stem}


def identifier_words(roots: list[Path]) -> list[str]:
    """The parts (split at `_`) of every identifier in the Python files under `roots`."""
    out: set[str] = set()
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            for ident in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", p.read_text()):
                out.update(w.lower() for w in ident.split("_") if len(w) >= 2)
    return sorted(out)


def _function_of(info: SliceInfo) -> str:
    return info.function or info.test[len("test_"):].split("_")[0]


def _rename_text(text: str, names: dict[str, str]) -> str:
    for old in sorted(names, key=len, reverse=True):
        text = re.sub(rf"\b{re.escape(old)}\b", names[old], text)
    return text


FAMILIES = (("<", ">", "<=", ">=", "==", "!="), ("in", "not in"), ("is", "is not"))


def family(op: str) -> tuple[str, ...]:
    """The operators that can stand where `op` stands (the flips stay inside a family)."""
    return next(f for f in FAMILIES if op in f)


def _workspace(task: Any, info: SliceInfo, ws: Path, op: str | None,
               rename: dict[str, str] | None, shift: int) -> SliceInfo:
    """The task's broken workspace in `ws`, made into a warm-up variant: the broken line's
    operator `op` instead of the mutation's, names renamed, `shift` empty lines at the top of
    the broken file. Returns the variant's SliceInfo."""
    from examples.swe.workspace import prepare_workspace

    shutil.rmtree(ws, ignore_errors=True)
    prepare_workspace(task, ws)
    if op and op != info.op:
        path = ws / info.file
        lines = path.read_text().splitlines(keepends=True)
        lines[info.line - 1] = lines[info.line - 1].replace(f" {info.op} ", f" {op} ", 1)
        path.write_text("".join(lines))
        info = SliceInfo(info.test, info.file, info.line, op, info.function)
    if rename:
        for p in ws.rglob("*.py"):
            p.write_text(_rename_text(p.read_text(), rename))
            if p.stem in rename:
                p.rename(p.with_name(rename[p.stem] + ".py"))
        info = SliceInfo(rename.get(info.test, info.test), _rename_text(info.file, rename),
                         info.line, info.op, rename.get(info.function, info.function))
    if shift:
        (ws / info.file).write_text("\n" * shift + (ws / info.file).read_text())
        info = SliceInfo(info.test, info.file, info.line + shift, info.op, info.function)
    return info


def _shift_listing(listing: str, file: str, shift: int) -> str:
    return re.sub(rf"^({re.escape(file)}):(\d+):",
                  lambda m: f"{m.group(1)}:{int(m.group(2)) + shift}:", listing, flags=re.M)


def dialogue(task: Any, info: SliceInfo, right: bool, workdir: Path,
             templates: dict[str, Any] | None = None, rename: dict[str, str] | None = None,
             listing: str | None = None, op: str | None = None,
             shift: int = 0) -> list[dict[str, Any]] | None:
    """mini's messages for this task when the model plays `moves(info, right)`: system, user,
    then (assistant tool call, tool observation) per move, the submit's observation left out
    (mini ends the run there). Runs the moves in a fresh broken workspace under `workdir`.
    None when the list move's output does not start with the broken line (not in the slice).
    Warm-up variants (`_workspace`): `op` on the broken line instead of the mutation's (a
    bug of the same kind; the statement is left as it is), `rename` (old -> new, whole words,
    in the files and the statement), `shift` empty lines before the broken file's first.
    `listing`: the list move's output in the workspace with `op` (not renamed, not shifted),
    known already; the move is then not run again: its output renamed and shifted is what
    the tool prints (it depends on names and line numbers only through what it prints)."""
    t = templates or mini_templates()
    rec = task if isinstance(task, dict) else task.model_dump()
    ws = workdir / rec["instance_id"]
    orig = info
    info = _workspace(task, info, ws, op, rename, shift)
    statement = _rename_text(rec["problem_statement"], rename or {})
    if listing is not None:
        listing = _shift_listing(_rename_text(listing, rename or {}), info.file, shift)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": render(t["system"])},
        {"role": "user", "content": render(t["instance"], task=statement)}]
    env = command_env(t, statement, workdir / f"{rec['instance_id']}.attempt")
    try:
        if op in (None, orig.op) and not shift and not sed_fixes(
                task, SliceInfo(info.test, info.file, info.line, info.op), ws):
            return None
        for k, cmd in enumerate(moves(info, right)):
            msgs.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": f"call{k}", "type": "function",
                "function": {"name": "bash",
                             "arguments": json.dumps({"command": cmd}, ensure_ascii=False)}}]})
            if cmd == SUBMIT:
                break
            out: dict[str, Any]
            if k == 0 and listing is not None:  # what the tool prints, and keeps for `fix`
                out = {"output": listing, "returncode": 0, "exception_info": ""}
                Path(env["SWE_ISSUE"] + ".suspects").write_text(listing)
            else:
                out = run_like_mini(cmd, ws, env)
            if k == 0 and not listing_pins(info, out["output"]):
                return None
            msgs.append({"role": "tool", "tool_call_id": f"call{k}",
                         "content": render(t["observation"], output=out)})
        return msgs
    finally:
        shutil.rmtree(ws, ignore_errors=True)
        shutil.rmtree(workdir / f"{rec['instance_id']}.attempt", ignore_errors=True)


def variant_listing(task: Any, info: SliceInfo, op: str, workdir: Path,
                    templates: dict[str, Any]) -> str:
    """The list move's output in the task's workspace with `op` on the broken line (run)."""
    rec = task if isinstance(task, dict) else task.model_dump()
    ws = workdir / f"{rec['instance_id']}.{op.replace(' ', '_')}"
    v = _workspace(task, info, ws, op, None, 0)
    try:
        env = command_env(templates, rec["problem_statement"], Path(f"{ws}.attempt"))
        return str(run_like_mini(list_command(v.test), ws, env)["output"])
    finally:
        shutil.rmtree(ws, ignore_errors=True)
        shutil.rmtree(f"{ws}.attempt", ignore_errors=True)


def make_dialogues(tasks: list[Any], right_fraction: float, seed: int,
                   templates: dict[str, Any] | None = None, renames: int = 0,
                   listings: dict[str, str] | None = None, ops: bool = False,
                   max_shift: int = 0,
                   ) -> tuple[list[list[dict[str, Any]]], list[float], dict[str, int]]:
    """Both variants (right and wrong fix) of every slice task's dialogue, as it is and
    `renames` times renamed (`rename_map`, and shifted by up to `max_shift` lines), with
    `ops`: the same for every operator of the broken one's family (`family`, listings run
    for each), and the weight of each in the warm-up mix (right: `right_fraction`, wrong:
    the rest). `listings`: the list move's output by instance_id, known already."""
    from concurrent.futures import ThreadPoolExecutor

    templates = templates or mini_templates()
    dialogues: list[list[dict[str, Any]]] = []
    weights: list[float] = []
    counts = {"tasks": 0, "variants": 0, "renamed": 0, "dropped": 0}
    rng = random.Random(seed)
    words = identifier_words(sorted({Path(t["repo_path"]) for t in tasks})) if renames else []
    chosen = [(rec, info) for rec in tasks if (info := in_slice(rec)) is not None]
    jobs = [(rec, info, op) for rec, info in chosen
            for op in (family(info.op) if ops else (info.op,))]
    with tempfile.TemporaryDirectory(prefix="swe-warmup-") as tmp:
        def listing_of(job: tuple[Any, SliceInfo, str]) -> str:
            rec, info, op = job
            known = (listings or {}).get(rec["instance_id"])
            if op == info.op and known is not None:
                return known
            return variant_listing(rec, info, op, Path(tmp), templates)

        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(listing_of, jobs))
        for (rec, info, op), listing in zip(jobs, outs):
            counts["tasks" if op == info.op else "variants"] += 1
            for v in range(1 + renames):  # the variant as it is, then renamed
                names = rename_map(info, rng, words) if v else None
                shift = rng.randint(0, max_shift) if v else 0
                pair = [dialogue(rec, info, right, Path(tmp), templates, names, listing, op,
                                 shift) for right in (True, False)]
                if pair[0] is None or pair[1] is None:
                    counts["dropped"] += 1
                    continue
                counts["renamed"] += bool(v)
                dialogues += [pair[0], pair[1]]
                weights += [right_fraction, 1 - right_fraction]
    return dialogues, weights, counts
