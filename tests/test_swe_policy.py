"""The swe learning proof's pieces that need no model: the policy's moves on real workspaces
(`examples/swe/policy.py`) and the swe model's warm-up on two dialogues. The learning run
itself is opt-in: `python -m examples.swe.learning all` (examples/swe/LEARNING.md)."""

from __future__ import annotations

import json
from pathlib import Path


from examples.swe import policy

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "examples" / "swe" / "tasks"
MINI = REPO / "examples" / "swe" / "mini.yaml"


def _tasks() -> list[dict]:
    from examples.swe.swe_tasks import load_swe_tasks

    return [t.model_dump() for t in load_swe_tasks(TASKS / "train.jsonl")
            if t.kind == "flip_comparison"]  # type: ignore[attr-defined]


def test_right_fix_inverts_and_wrong_fix_keeps_the_bug() -> None:
    from examples.swe.mutations import _FLIP  # the generator's own flips

    flips = {s.strip() for s in _FLIP.values()}
    assert set(policy.RIGHT) == flips and set(policy.WRONG) == flips
    for op in policy.RIGHT:
        assert policy.RIGHT[policy.RIGHT[op]] == op  # the inverse undoes the mutation
        assert policy.WRONG[op] not in (op, policy.RIGHT[op])
    assert policy.sed_command(12, "<", ">", "pkg/m.py") == "sed -i '12s/ < / > /' pkg/m.py"


def test_moves_fix_a_slice_task_in_its_workspace(tmp_path: Path) -> None:
    tasks = [t for t in _tasks() if policy.in_slice(t) is not None]
    assert tasks, "the slice is empty"
    t = tasks[0]
    info = policy.in_slice(t)
    assert info is not None
    templates = policy.mini_templates(MINI)
    right = policy.dialogue(t, info, True, tmp_path, templates)
    wrong = policy.dialogue(t, info, False, tmp_path, templates)
    assert right is not None and wrong is not None
    assert [m["role"] for m in right] == ["system", "user", "assistant", "tool", "assistant",
                                          "tool", "assistant"]
    listing = right[3]["content"]
    assert f"{info.file}:{info.line}: " in listing
    cmds = [json.loads(m["tool_calls"][0]["function"]["arguments"])["command"]
            for m in right if m["role"] == "assistant"]
    assert cmds[0] == policy.list_command(info.test) and cmds[-1] == policy.SUBMIT
    assert f" {policy.RIGHT[info.op]} /" in cmds[1]
    wcmd = json.loads(wrong[4]["tool_calls"][0]["function"]["arguments"])["command"]
    assert f" {policy.WRONG[info.op]} /" in wcmd


def test_swe_model_warms_up_on_dialogues(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harnessrl.model.build import Recipe
    from harnessrl.model.swe_model import SweRecipe, build_swe_model

    calc_digest = Recipe().digest()
    chat = [{"role": "system", "content": "You fix bugs."},
            {"role": "user", "content": "In `lib`, the test `t.py::test_f` fails."},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
             "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})}}]},
            {"role": "tool", "content": "<returncode>0</returncode>"}]
    out = build_swe_model(tmp_path / "m", [chat, chat], ["def f(x):\n    return x < 1\n"],
                          [policy.BASH_TOOL], SweRecipe(warmup_steps=3, warmup_batch_size=2,
                                                        vocab_size=1500))
    info = json.loads((out / "recipe.json").read_text())
    assert info["kind"] == "swe" and len(info["warmup_losses_every_10"]) == 1
    tok = AutoTokenizer.from_pretrained(out)
    AutoModelForCausalLM.from_pretrained(out)
    assert "<tool_call>" in tok.apply_chat_template(chat, tools=[policy.BASH_TOOL],
                                                    tokenize=False)
    assert Recipe().digest() == calc_digest  # the calc model's recipe is untouched
