"""A calculator agent: the example harness that harnessrl trains through.

It knows nothing about harnessrl. It talks to an OpenAI-compatible API with the official
`openai` SDK, configured by the environment only:

- `OPENAI_BASE_URL`, `OPENAI_API_KEY`: the API (the gateway in training, any server otherwise);
- `HARNESSRL_MODEL`: the model name;
- `HARNESSRL_TASK_JSON`: the task, e.g. `{"id": "calc-000", "question": "What is 3 + 4?", ...}`.

Run: the model is asked the question with a `calculator` tool; each tool call it makes is
executed here and its result goes back as a `tool` message; the first reply without a tool call
is the final answer. Writes `answer.txt` (the final answer) and `transcript.jsonl` (one line per
response received: content, tool calls, finish reason) in the working directory. A model that
answers badly (no tool call, broken JSON, wrong tool) still gets a finished run; only an API
error makes the harness exit non-zero.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys
from pathlib import Path
from typing import Any

from openai import OpenAI

SYSTEM_PROMPT = "You are a careful assistant. Use the calculator tool, then give the answer."

TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with integers and + - *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}]

MAX_CALLS = 4
MAX_TOKENS = 64
TEMPERATURE = 1.0

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if max(abs(left), abs(right)) > 10**9:
            raise ValueError("number too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError("only integers and + - * are supported")


def calculator(expression: str) -> str:
    try:
        return str(_eval(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as e:
        return f"error: {e}"


def run_tool(name: str, arguments: str) -> str:
    """The result the model sees for one tool call; a bad call gets an error message."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return "error: arguments are not valid JSON"
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return "error: expected {\"expression\": string}"
    return calculator(args["expression"])


def main() -> int:
    task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
    model = os.environ["HARNESSRL_MODEL"]
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    workdir = Path.cwd()
    transcript = (workdir / "transcript.jsonl").open("a")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]
    answer = ""
    for _ in range(MAX_CALLS):
        response = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS,  # type: ignore[arg-type]
            temperature=TEMPERATURE, max_tokens=MAX_TOKENS)
        choice = response.choices[0]
        message = choice.message
        calls = message.tool_calls or []
        transcript.write(json.dumps({
            "id": response.id, "content": message.content, "finish_reason": choice.finish_reason,
            "tool_calls": [{"id": c.id, "name": c.function.name,
                            "arguments": c.function.arguments} for c in calls],
        }) + "\n")
        transcript.flush()
        if not calls:
            answer = message.content or ""
            break
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls]})
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": run_tool(c.function.name, c.function.arguments)})
    (workdir / "answer.txt").write_text(answer)
    transcript.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
