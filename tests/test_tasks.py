"""One task-file reader (`harnessrl.tasks`) for the controller and the trainer: the same ids,
the same errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.errors import InvalidArgument
from harnessrl.tasks import load_task_file
from harnessrl.v1 import common_pb2 as c
from services.controller.run_spec import resolve_tasks
from services.trainer.rollouts import load_tasks


def test_controller_and_trainer_read_the_same_ids(tmp_path: Path) -> None:
    f = tmp_path / "tasks.jsonl"
    f.write_text("\n".join([json.dumps({"id": "a", "q": 1}), "",
                            json.dumps({"task_id": 7, "q": 2}), json.dumps({"q": 3})]) + "\n")
    assert [tid for tid, _ in load_task_file(f)] == ["a", "7", "4"]  # line 4: positional
    controller = [t.task_id for t in resolve_tasks(c.RunSpec(tasks_file=str(f)))]
    trainer = [str(t["id"]) for t in load_tasks(f)]
    assert controller == trainer == ["a", "7", "4"]
    assert load_tasks(f)[2] == {"q": 3, "id": "4"}


@pytest.mark.parametrize("lines, error", [
    (['{"id": "a"}', '{"id": "a"}'], "duplicate task id 'a'"),
    (['{"id": "a"}', "[1]"], "line 2: a task must be a JSON object"),
    (['{"id": ["x"]}'], "task id must be a string or an integer"),
    (["", " "], "no tasks"),
])
def test_both_reject_the_same_bad_files(tmp_path: Path, lines: list[str], error: str) -> None:
    f = tmp_path / "tasks.jsonl"
    f.write_text("\n".join(lines) + "\n")
    for read in (load_tasks, lambda p: resolve_tasks(c.RunSpec(tasks_file=str(p)))):
        with pytest.raises(InvalidArgument, match=error):
            read(f)
