"""A multi-turn harness on the official `openai` SDK, for the gateway's restart and replica
tests: a chat conversation with tools (the whole history resent each turn) or a Responses
chain (`previous_response_id`), `turns` turns.

The task (`HARNESSRL_TASK_JSON`): {"mode": "chat" | "responses", "turns": 3, "seed": 0,
"pause": false, "fresh_connections": false}. With `pause`, after each turn but the last it
writes `turn-<i>.done` in its working directory and waits for `go-<i>` (the test restarts the
gateway meanwhile). With `fresh_connections`, each request opens a new connection (a
round-robin proxy in front of two replicas then alternates them per request). What it received
goes to `transcript.jsonl`; `--grade` prints reward 1 when every turn was answered.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SYSTEM = "You are a careful assistant. Use the calculator tool, then give the answer."
QUESTION = "What is 970 - 154?"
PARAMS = {"type": "object", "properties": {"expression": {"type": "string"}},
          "required": ["expression"]}
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": PARAMS}}]
RESPONSES_TOOLS = [{"type": "function", "name": "calculator",
                    "description": "Evaluate an arithmetic expression.", "parameters": PARAMS}]


def _wait_go(i: int, timeout_s: float = 300.0) -> None:
    Path(f"turn-{i}.done").write_text("")
    deadline = time.monotonic() + timeout_s
    while not Path(f"go-{i}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go-{i} within {timeout_s}s")
        time.sleep(0.05)


def _chat(client, model: str, task: dict, log) -> None:  # type: ignore[no-untyped-def]
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": QUESTION}]
    for i in range(task.get("turns", 3)):
        resp = client.chat.completions.create(model=model, messages=messages, tools=CHAT_TOOLS,
                                              max_tokens=40, temperature=1.0,
                                              seed=task.get("seed", 0) + i)
        msg = resp.choices[0].message
        calls = msg.tool_calls or []
        log({"turn": i, "text": msg.content, "tool_calls": [
            [t.function.name, t.function.arguments] for t in calls]})
        messages.append(msg.model_dump(exclude_none=True))
        if calls:
            messages += [{"role": "tool", "tool_call_id": t.id, "content": "816"} for t in calls]
        else:
            messages.append({"role": "user", "content": f"And {i} + 4?"})
        if task.get("pause") and i < task.get("turns", 3) - 1:
            _wait_go(i)


def _responses(client, model: str, task: dict, log) -> None:  # type: ignore[no-untyped-def]
    previous = None
    follow: object = QUESTION
    for i in range(task.get("turns", 3)):
        resp = client.responses.create(model=model, instructions=SYSTEM, tools=RESPONSES_TOOLS,
                                       input=follow, previous_response_id=previous,
                                       max_output_tokens=40, temperature=0.0)
        calls = [o for o in resp.output if o.type == "function_call"]
        log({"turn": i, "id": resp.id, "previous": previous, "text": resp.output_text,
             "tool_calls": [[o.name, o.arguments] for o in calls]})
        previous = resp.id
        follow = [{"type": "function_call_output", "call_id": o.call_id, "output": "816"}
                  for o in calls] or f"And {i} + 4?"
        if task.get("pause") and i < task.get("turns", 3) - 1:
            _wait_go(i)


def main() -> int:
    task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
    if "--grade" in sys.argv:
        lines = Path("transcript.jsonl").read_text().splitlines() \
            if Path("transcript.jsonl").exists() else []
        ok = len(lines) == task.get("turns", 3)
        print(json.dumps({"reward": 1.0 if ok else 0.0, "reason": f"{len(lines)} turns"}))
        return 0
    import httpx2  # openai 3.x's own HTTP client library
    import openai

    http = openai.DefaultHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0)) \
        if task.get("fresh_connections") else None
    client = openai.OpenAI(http_client=http, timeout=120) if http else \
        openai.OpenAI(timeout=120)
    model = os.environ.get("OPENAI_MODEL", "tiny")
    with open("transcript.jsonl", "a") as out:
        def log(entry: dict) -> None:
            out.write(json.dumps(entry) + "\n")
            out.flush()
        (_chat if task["mode"] == "chat" else _responses)(client, model, task, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
