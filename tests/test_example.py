"""The calculator example: harness, grader and task file, against vLLM and against a named
test double (a scripted OpenAI-compatible server) for malformed model output and API errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from harnessrl.local.engine import EngineProcess
from harnessrl.model import calc_task

CALC = Path(__file__).resolve().parent.parent / "examples" / "calc"
TASKS, HARNESS, GRADER = CALC / "tasks.jsonl", CALC / "harness.py", CALC / "grader.py"
TASK = {"id": "calc-x", "question": "What is 12 + 30?", "expression": "12 + 30", "answer": 42}


def task_env(task: dict[str, Any], base_url: str, model: str, api_key: str) -> dict[str, str]:
    """The environment the controller gives a harness run (services/controller/run_spec.py):
    API, model and the task, whole and one `HARNESSRL_TASK_<FIELD>` per field."""
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
           "HARNESSRL_MODEL": model, "HARNESSRL_TASK_JSON": json.dumps(task)}
    for k, v in task.items():
        env[f"HARNESSRL_TASK_{k.upper()}"] = v if isinstance(v, str) else json.dumps(v)
    return env


def _harness_module() -> Any:
    spec = importlib.util.spec_from_file_location("calc_harness", HARNESS)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _grade(workdir: Path, task: dict[str, Any]) -> tuple[float, str]:
    out = subprocess.run([sys.executable, str(GRADER)], cwd=workdir, capture_output=True,
                         text=True, env=task_env(task, "http://unused", "m", "k"), check=True)
    last = json.loads(out.stdout.strip().splitlines()[-1])
    return last["reward"], last["reason"]


def _run_harness(workdir: Path, base_url: str, model: str, task: dict[str, Any] = TASK,
                 api_key: str = "dummy-key") -> subprocess.CompletedProcess[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(HARNESS)], cwd=workdir, capture_output=True,
                          text=True, env=task_env(task, base_url, model, api_key),
                          timeout=120)


def _transcript(workdir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (workdir / "transcript.jsonl").read_text().splitlines()]


# --- grader and task file -------------------------------------------------------------------

@pytest.mark.parametrize("answer,reward", [
    ("The answer is 42.", 1.0), ("42", 1.0), ("I estimate 41.", 0.0),
    ("The answer is 42, no 43.", 0.0), ("no idea", 0.0), ("", 0.0)])
def test_grader_rewards_the_last_number(tmp_path: Path, answer: str, reward: float) -> None:
    (tmp_path / "answer.txt").write_text(answer)
    assert _grade(tmp_path, TASK)[0] == reward


def test_grader_without_answer_file(tmp_path: Path) -> None:
    assert _grade(tmp_path, TASK) == (0.0, "no answer.txt")


def test_task_file_is_well_formed() -> None:
    tasks = [json.loads(x) for x in TASKS.read_text().splitlines()]
    assert len(tasks) >= 64 and len({t["id"] for t in tasks}) == len(tasks)
    harness = _harness_module()
    for t in tasks:
        assert t["question"] == calc_task.question(t["expression"])
        assert harness.calculator(t["expression"]) == str(t["answer"])
        assert 0 <= t["answer"] <= calc_task.MAX_ANSWER


def test_harness_speaks_exactly_what_the_model_was_warmed_up_on() -> None:
    harness = _harness_module()
    assert harness.SYSTEM_PROMPT == calc_task.SYSTEM_PROMPT
    assert harness.TOOLS == calc_task.TOOLS


def test_calculator_tool_rejects_what_it_must_not_run() -> None:
    h = _harness_module()
    assert h.run_tool("calculator", '{"expression": "7 * 6 - 2"}') == "40"
    assert h.run_tool("calculator", '{"expression": "__import__(\'os\')"}').startswith("error")
    assert h.run_tool("calculator", '{"expression": "2 ** 10"}').startswith("error")
    assert h.run_tool("calculator", "{not json").startswith("error: arguments")
    assert h.run_tool("calculator", '{"x": 1}').startswith("error: expected")
    assert h.run_tool("search", '{"expression": "1"}') == "error: unknown tool 'search'"


# --- against a scripted OpenAI-compatible test double ---------------------------------------

class ScriptedOpenAI:
    """Test double of an OpenAI-compatible server: answers each chat completion with the next
    scripted message (or HTTP status) and records the requests."""

    def __init__(self, script: list[dict[str, Any] | int]) -> None:
        self.script = list(script)
        self.requests: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                step = owner.script.pop(0)
                if isinstance(step, int):
                    payload, status = {"error": {"message": "scripted", "type": "x"}}, step
                else:
                    status = 200
                    payload = {"id": f"c{len(owner.requests)}", "object": "chat.completion",
                               "created": 0, "model": body["model"],
                               "choices": [{"index": 0, "message": step,
                                            "finish_reason": "tool_calls"
                                            if step.get("tool_calls") else "stop"}]}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted() -> Iterator[Any]:
    servers: list[ScriptedOpenAI] = []

    def make(script: list[dict[str, Any] | int]) -> ScriptedOpenAI:
        servers.append(ScriptedOpenAI(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _tool_call(arguments: str, name: str = "calculator") -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": name, "arguments": arguments}}]}


def test_harness_runs_the_tool_and_sends_its_result_back(tmp_path: Path, scripted: Any) -> None:
    srv = scripted([_tool_call('{"expression": "12 + 30"}'),
                    {"role": "assistant", "content": "The answer is 42."}])
    run = _run_harness(tmp_path, srv.url, "m")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "answer.txt").read_text() == "The answer is 42."
    second = srv.requests[1]
    assert second["tools"] == calc_task.TOOLS and second["model"] == "m"
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    assert second["messages"][-2]["tool_calls"][0]["function"]["arguments"] == \
        '{"expression": "12 + 30"}'
    t = _transcript(tmp_path)
    assert [x["finish_reason"] for x in t] == ["tool_calls", "stop"]
    assert _grade(tmp_path, TASK)[0] == 1.0


@pytest.mark.parametrize("first", [
    {"role": "assistant", "content": "42 I think"},                     # no tool call
    _tool_call("{broken json"),                                         # bad arguments
    _tool_call('{"expression": "1"}', name="nonexistent"),              # unknown tool
])
def test_harness_finishes_on_malformed_model_output(tmp_path: Path, scripted: Any,
                                                    first: dict[str, Any]) -> None:
    srv = scripted([first, {"role": "assistant", "content": "I estimate 7."}])
    run = _run_harness(tmp_path, srv.url, "m")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "answer.txt").exists()
    assert len(_transcript(tmp_path)) == len(srv.requests)
    if first.get("tool_calls"):
        assert srv.requests[1]["messages"][-1]["content"].startswith("error")
    reward, _ = _grade(tmp_path, TASK)
    assert reward in (0.0, 1.0)


def test_harness_stops_after_max_calls_when_the_model_only_calls_tools(
        tmp_path: Path, scripted: Any) -> None:
    h = _harness_module()
    srv = scripted([_tool_call('{"expression": "1 + 1"}')] * h.MAX_CALLS)
    run = _run_harness(tmp_path, srv.url, "m")
    assert run.returncode == 0, run.stderr
    assert len(srv.requests) == h.MAX_CALLS
    assert (tmp_path / "answer.txt").read_text() == ""
    assert _grade(tmp_path, TASK)[0] == 0.0


def test_harness_exits_nonzero_on_an_api_error(tmp_path: Path, scripted: Any) -> None:
    srv = scripted([_tool_call('{"expression": "12 + 30"}'), 400])
    run = _run_harness(tmp_path, srv.url, "m")
    assert run.returncode != 0
    assert "400" in run.stderr
    assert len(_transcript(tmp_path)) == 1


# --- against the real vLLM ------------------------------------------------------------------

@pytest.mark.vllm
def test_harness_against_vllm(vllm_engine: EngineProcess, tmp_path: Path) -> None:
    tasks = [json.loads(x) for x in TASKS.read_text().splitlines()][:3]
    for i, task in enumerate(tasks):
        wd = tmp_path / f"run{i}"
        run = _run_harness(wd, vllm_engine.openai_base_url, vllm_engine.model_name, task,
                           vllm_engine.api_key)  # straight to the engine: its key
        assert run.returncode == 0, run.stderr
        t = _transcript(wd)
        assert len(t) >= 2, t
        assert t[0]["tool_calls"] and t[0]["tool_calls"][0]["name"] == "calculator"
        assert t[0]["finish_reason"] == "tool_calls"
        assert (wd / "answer.txt").read_text() == (t[-1]["content"] or "")
        reward, _ = _grade(wd, task)
        assert 0.0 <= reward <= 1.0
