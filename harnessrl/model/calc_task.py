"""The example task's world, as the tiny model's warm-up sees it: arithmetic questions answered
with a `calculator` tool (the harness in `examples/calc/harness.py` sends exactly these prompts
and tools; `tests/test_example.py` checks they agree).

A task is a JSON object `{"id", "question", "expression", "answer"}` with an integer answer in
[0, 999]; a dialogue is system prompt -> user question -> assistant tool call -> tool result ->
assistant final answer.
"""

from __future__ import annotations

import random
from typing import Any

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

MAX_ANSWER = 999

# The two ways the warm-up policy finishes a dialogue: it copies the tool's result (right), or
# it ignores the tool and states a number of its own (wrong, except by chance).
COPY_TEMPLATE = "The answer is {n}."
GUESS_TEMPLATE = "I estimate {n}."


def question(expression: str) -> str:
    return f"What is {expression}?"


def make_task(rng: random.Random, task_id: str) -> dict[str, Any]:
    """One question whose answer lies in [0, MAX_ANSWER]."""
    op = rng.choice("+-*")
    if op == "+":
        a = rng.randint(0, MAX_ANSWER)
        b = rng.randint(0, MAX_ANSWER - a)
        answer = a + b
    elif op == "-":
        a = rng.randint(0, MAX_ANSWER)
        b = rng.randint(0, a)
        answer = a - b
    else:
        a = rng.randint(2, 99)
        b = rng.randint(2, MAX_ANSWER // a)
        answer = a * b
    expression = f"{a} {op} {b}"
    return {"id": task_id, "question": question(expression), "expression": expression,
            "answer": answer}


def dialogue(task: dict[str, Any], copy: bool, rng: random.Random) -> list[dict[str, Any]]:
    """The full chat of one run: the final answer copies the tool result when `copy`, else it
    is a number drawn uniformly from [0, MAX_ANSWER] other than the right one."""
    if copy:
        final = COPY_TEMPLATE.format(n=task["answer"])
    else:
        guess = rng.randint(0, MAX_ANSWER - 1)
        guess += guess >= task["answer"]
        final = GUESS_TEMPLATE.format(n=guess)
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_0", "type": "function",
            "function": {"name": "calculator",
                         "arguments": {"expression": task["expression"]}}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(task["answer"])},
        {"role": "assistant", "content": final},
    ]
