"""Task files and task ids: the one reader of a JSONL task file, for the controller and the
trainer alike.

A task file holds one JSON object per line (blank lines skipped). A task's id is its "id"
field, else its "task_id" field (a string or an integer), else its position: the 1-based line
number in a file, the 0-based index of an inline list. Ids are 1-`MAX_TASK_ID_CHARS`
printable characters and unique within a file or run. Problems raise `InvalidArgument`
naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harnessrl.errors import InvalidArgument

MAX_TASK_ID_CHARS = 256


def task_object(text: str, where: str) -> dict[str, Any]:
    """The task (a JSON object) in `text`; `where` names it in errors."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{where}: a task must be a JSON object, got "
                              f"{type(data).__name__}")
    return data


def task_id(data: dict[str, Any], fallback: str, where: str) -> str:
    """The task's own id ("id", else "task_id"), else `fallback` (its position)."""
    raw = data.get("id", data.get("task_id"))
    if raw is None:
        return fallback
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise InvalidArgument(f"{where}: task id must be a string or an integer, got {raw!r}")
    return str(raw)


def check_task_ids(ids: list[str]) -> None:
    """`InvalidArgument` for an empty, too long, non-printable or repeated id."""
    seen: set[str] = set()
    for tid in ids:
        if not tid or len(tid) > MAX_TASK_ID_CHARS or any(ord(ch) < 32 for ch in tid):
            raise InvalidArgument(f"invalid task id {tid!r}: 1-{MAX_TASK_ID_CHARS} "
                                  "printable characters")
        if tid in seen:
            raise InvalidArgument(f"duplicate task id {tid!r}")
        seen.add(tid)


def load_task_file(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """The (id, task) pairs of a JSONL task file, in file order, ids checked."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot read tasks_file {path}: {exc}") from None
    tasks = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            where = f"{path} line {lineno}"
            data = task_object(line, where)
            tasks.append((task_id(data, str(lineno), where), data))
    if not tasks:
        raise InvalidArgument(f"the run has no tasks ({path} is empty)")
    check_task_ids([tid for tid, _ in tasks])
    return tasks
