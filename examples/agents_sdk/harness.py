"""The calculator task as an agent of the OpenAI Agents SDK (`openai-agents`), a framework
harnessrl did not write, run as it is under the controller.

Nothing here knows about harnessrl: the SDK is configured by the environment only.

- `OPENAI_BASE_URL`, `OPENAI_API_KEY`: read by the SDK's OpenAI client (the controller sets
  them to the gateway and the rollout's credential);
- `OPENAI_DEFAULT_MODEL`: the SDK's model name (a name the gateway does not serve is mapped to
  the run's model, so this may be left out);
- `OPENAI_AGENTS_DISABLE_TRACING=1`: no traces are exported (they would go to api.openai.com);
- `HARNESSRL_TASK_JSON`: the task, e.g. `{"question": "What is 3 + 4?", "answer": 7, ...}`.

The SDK speaks the Responses API (`POST /v1/responses`, the full conversation each turn,
function tools). The agent has one function tool, `calculator` (the calc example's tool and
evaluator), and at most 4 turns. Writes
`answer.txt` (the final output, read by `examples/calc/grader.py`) and `transcript.jsonl`: one
line per model response as the SDK received it (a run hook), with its text and function calls.
A model that answers badly (too many turns, a call to an unknown tool, broken arguments) still
ends the run with exit code 0; an API error exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from agents import Agent, AgentsException, FunctionTool, RunHooks, Runner

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.calc.harness import SYSTEM_PROMPT, TOOLS, run_tool  # noqa: E402

MAX_TURNS = 4
SPEC = TOOLS[0]["function"]


async def _invoke(context: Any, arguments: str) -> str:
    return run_tool(SPEC["name"], arguments)


# The calculator harness's own tool declaration, as an Agents SDK function tool. (The SDK's
# `@function_tool` would derive the schema from a Python signature, adding "title" fields and
# "additionalProperties": false; the tiny model was warmed up on exactly this declaration and
# rarely calls a tool declared otherwise.)
calculator = FunctionTool(name=SPEC["name"], description=SPEC["description"],
                          params_json_schema=SPEC["parameters"], on_invoke_tool=_invoke,
                          strict_json_schema=False)


class Transcript(RunHooks):  # type: ignore[type-arg]
    """Writes each model response, as the SDK received it, to transcript.jsonl."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a")

    async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
        text, calls = "", []
        for item in response.output:
            if item.type == "message":
                text += "".join(c.text for c in item.content if c.type == "output_text")
            elif item.type == "function_call":
                calls.append({"name": item.name, "arguments": item.arguments})
        self.file.write(json.dumps({"response_id": response.response_id, "text": text,
                                    "function_calls": calls}) + "\n")
        self.file.flush()


def main() -> int:
    task = json.loads(os.environ["HARNESSRL_TASK_JSON"])
    agent = Agent(name="calculator", instructions=SYSTEM_PROMPT, tools=[calculator])
    hooks = Transcript(Path.cwd() / "transcript.jsonl")
    try:
        result = Runner.run_sync(agent, task["question"], max_turns=MAX_TURNS, hooks=hooks)
        answer = str(result.final_output)
    except AgentsException as exc:  # the model's fault, not the API's: a finished, bad run
        print(f"agent gave no answer: {type(exc).__name__}: {exc}", file=sys.stderr)
        answer = ""
    (Path.cwd() / "answer.txt").write_text(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
