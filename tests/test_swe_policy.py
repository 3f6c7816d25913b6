"""The swe learning proof's pieces that need no model: the policy's moves on real workspaces
(`examples/swe/policy.py`) and the swe model's warm-up on two dialogues. The learning run
itself is opt-in: `python -m examples.swe.learning all` (examples/swe/LEARNING.md)."""

from __future__ import annotations

import json
from pathlib import Path


from examples.swe import dialogues, policy

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
    assert policy.fix_command("<") == "fix '<'"
    # the policy's choice is the same words for every operator: flip, or copy what is shown
    assert {policy.fix_move(op, True) for op in policy.RIGHT} == {"fix flip"}
    assert all(policy.fix_move(op, False) == policy.fix_command(op) for op in policy.RIGHT)
    import importlib.util  # the tool (a script beside the harness) flips as the policy says

    spec = importlib.util.spec_from_file_location(
        "suspects", REPO / "examples" / "swe" / "tools" / "suspects.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.FLIP == policy.RIGHT


PINNED = "harnessrl__recq__fields_used__flip_comparison-1"  # suspects prints its broken line


def test_moves_fix_a_slice_task_in_its_workspace(tmp_path: Path) -> None:
    import random

    tasks = [t for t in _tasks() if policy.in_slice(t) is not None]
    assert tasks, "the slice is empty"
    t = next((t for t in tasks if t["instance_id"] == PINNED), tasks[0])
    info = policy.in_slice(t)
    assert info is not None
    templates = policy.mini_templates(MINI)
    right = dialogues.dialogue(t, info, True, tmp_path, templates)
    assert right is not None, "suspects no longer pins the broken line of " + t["instance_id"]
    assert [m["role"] for m in right] == ["system", "user", "assistant", "tool", "assistant",
                                          "tool", "assistant"]
    listing = right[3]["content"]
    assert listing.split("<output>\n")[1].startswith(f"{info.file}:{info.line}: ")
    cmds = [json.loads(m["tool_calls"][0]["function"]["arguments"])["command"]
            for m in right if m["role"] == "assistant"]
    assert cmds == ["suspects", policy.FLIP_MOVE, policy.SUBMIT]
    # the wrong fix on a warm-up variant (another operator, renamed, shifted), its listing
    # run once and renamed/shifted as text: what running the tool in the variant gives
    op = next(o for o in dialogues.family(info.op) if o != info.op)
    out = dialogues.variant_listing(t, info, op, tmp_path, templates)
    names = dialogues.rename_map(info, random.Random(1), ["alpha", "beta", "gamma"])
    wrong = dialogues.dialogue(t, info, False, tmp_path, templates, names, out, op, 7)
    assert wrong == dialogues.dialogue(t, info, False, tmp_path, templates, names, None, op, 7)
    assert wrong is not None and names[info.test] in wrong[1]["content"]
    wcmd = json.loads(wrong[4]["tool_calls"][0]["function"]["arguments"])["command"]
    assert wcmd == policy.fix_command(op)
    new_file = info.file.replace(Path(info.file).stem, names[Path(info.file).stem])
    assert f"{new_file}:{info.line + 7}: " in wrong[3]["content"]


def test_suspects_and_fix_restore_the_working_line(tmp_path: Path) -> None:
    from examples.swe.workspace import prepare_workspace

    t = next(t for t in _tasks() if t["instance_id"] == PINNED)
    info = policy.in_slice(t)
    assert info is not None
    ws = tmp_path / "repo"
    prepare_workspace(t, ws)
    env = policy.command_env(policy.mini_templates(MINI), t["problem_statement"], tmp_path)
    shown = policy.run_like_mini("suspects", ws, env)["output"]
    assert policy.listing_pins(info, shown)
    assert policy.run_like_mini(policy.FLIP_MOVE, ws, env)["returncode"] == 0
    m = t["mutation"]
    assert m["original"] in (ws / info.file).read_text().splitlines()[info.line - 1]


def test_fix_move_writes_every_operator(tmp_path: Path) -> None:
    """The fix move as the shell runs it, for each operator (`<` and `>` unquoted are
    redirections): the first suspect's comparison gets the new operator, and `fix flip` the
    flipped one, which undoes the task family's mutation."""
    env = policy.command_env(policy.mini_templates(MINI), "", tmp_path)
    (tmp_path / "pkg").mkdir()
    moves = [(op, new, cmd) for op, new in policy.RIGHT.items()
             for cmd in (policy.fix_command(new), policy.FLIP_MOVE)]
    for op, new, cmd in moves:
        (tmp_path / "pkg" / "m.py").write_text(f"def f(a, b):\n    return a {op} b\n")
        (tmp_path / "issue.md.suspects").write_text(f"pkg/m.py:2: a {op} b\n")
        out = policy.run_like_mini(cmd, tmp_path, env)
        assert out["returncode"] == 0, out
        assert (tmp_path / "pkg" / "m.py").read_text().splitlines()[1] == f"    return a {new} b"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["issue.md", "issue.md.suspects",
                                                              "pkg"]


def test_rl_forms_mean_what_the_task_means() -> None:
    """Each form of a correct comparison is true exactly when it is, and the form's broken
    comparison (its inner comparison flipped) exactly when the task's broken one is."""
    import itertools

    from examples.swe import rl_forms

    values: list[object] = [-1, 0, 1, 2]
    for op in rl_forms.NEG:
        grid = (itertools.product(values, [[0, 1], [2], []]) if "in" in op
                else itertools.product(values + [None], values + [None]) if "is" in op
                else itertools.product(values, values))
        original, broken = f"a {op} b", f"a {rl_forms.FLIP[op]} b"
        for a, b in grid:
            for name, (text, offset, inner) in rl_forms.correct_forms(original).items():
                left, iop, right = rl_forms.split_compare(inner)
                form_broken = text[:offset] + f"{left} {rl_forms.FLIP[iop]} {right}" + \
                    text[offset + len(inner):]
                env = {"a": a, "b": b}
                assert eval(text, env) == eval(original, env), (name, text, a, b)
                assert eval(form_broken, env) == eval(broken, env), (name, form_broken, a, b)
    assert set(rl_forms.correct_forms("x.end < y.start")) == {"neg", "mirror", "mirror_neg"}
    assert set(rl_forms.correct_forms("v is not None")) == {"neg"}
    import pytest

    with pytest.raises(ValueError, match="operator alone"):
        rl_forms.correct_forms("(a) < b")  # dropped by make_forms, not a crash


def test_rl_form_task_is_checked_on_its_workspace(tmp_path: Path, monkeypatch) -> None:
    """A form of a slice task is a task of its own (snapshot, mutation, gold patch) that the
    list move pins and the policy's right fix solves; a rewrite that changes the meaning is
    dropped by the same check."""
    from examples.swe import rl_forms
    from examples.swe.swe_tasks import SweTask
    from examples.swe.workspace import apply_patch, prepare_workspace
    from examples.swe import grader

    t = next(t for t in _tasks() if t["instance_id"] == PINNED)
    templates = policy.mini_templates(MINI)
    form = rl_forms.form_task(t, "neg", tmp_path / "forms")
    shown, info = policy.in_slice(t), policy.in_slice(form)
    assert shown is not None and info is not None
    correct = rl_forms.FLIP[shown.op]  # `x not in s` -> `not (x in s)`, broken `not (x not in s)`
    assert info.op == rl_forms.FLIP[rl_forms.NEG[correct]]
    assert form["FAIL_TO_PASS"] == t["FAIL_TO_PASS"] and form["base_commit"] != t["base_commit"]
    assert rl_forms.checked(form, tmp_path / "ws", templates) is None
    gold = tmp_path / "gold"
    prepare_workspace(form, gold)
    apply_patch(gold, form["patch"])
    assert grader.grade(SweTask.model_validate(form), gold).reward == 1.0
    monkeypatch.setitem(rl_forms.NEG, correct, correct)  # `not (x not in s)`: not the same
    bad = rl_forms.form_task(t, "neg", tmp_path / "bad")
    assert rl_forms.checked(bad, tmp_path / "ws2", templates) == \
        "the broken workspace does not grade 0"


def test_fix_kind_reads_the_fix_move_from_recorded_calls() -> None:
    from types import SimpleNamespace

    from examples.swe.run_record import fix_kind

    def call(command: str | None) -> SimpleNamespace:
        calls = [{"function": {"name": "bash", "arguments": json.dumps({"command": command})}}]
        return SimpleNamespace(response_message_json=json.dumps(
            {"role": "assistant", "content": "", "tool_calls": calls if command else None}))

    listed = [call("suspects")]
    assert fix_kind([*listed, call("fix flip"), call(policy.SUBMIT)], ">=") == "right"
    assert fix_kind([*listed, call("fix '<='"), call(policy.SUBMIT)], ">=") == "right"
    assert fix_kind([*listed, call("fix '>='")], ">=") == "copied"
    assert fix_kind([*listed, call("fix '<'")], ">=") == "other"
    assert fix_kind([*listed, call(None), call(policy.SUBMIT)], ">=") == "none"


def test_rename_map_and_listing_pins() -> None:
    import random

    info = policy.SliceInfo("test_total_rounds_up", "pkg/m.py", 3, "<", "total")
    rng = random.Random(0)
    for _ in range(50):
        names = dialogues.rename_map(info, rng, ["total", "if", "span", "x1"])
        new_fn = names["total"]
        assert new_fn not in ("total", "span", "x1") and "if" not in new_fn.split("_")
        assert names[info.test].startswith(f"test_{new_fn}_")
    assert policy.listing_pins(info, "pkg/m.py:3: a < b\npkg/m.py:9: c == d\n")
    assert not policy.listing_pins(info, "pkg/m.py:9: c == d\npkg/m.py:3: a < b\n")
    assert not policy.listing_pins(info, "")


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


def test_curve_pairs_each_seed_with_the_warmed_up_model(tmp_path: Path) -> None:
    """examples/swe/curve.py: a seed run without its own step-0 evaluation is paired with
    another seed's (the same warmed-up model); gains per seed and pooled, from the results."""
    import pytest

    from examples.swe import curve

    def result(name: str, rewards: dict[str, list[float]]) -> str:
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"tasks": [{"task_id": t, "rewards": r}
                                           for t, r in rewards.items()]}))
        return str(p)

    before = result("before", {"a": [0, 0, 1, 0], "b": [0, 0, 0, 0]})
    runs = {0: [{"kind": "eval", "step": 0, "pass@1": 0.125, "result": before},
                {"step": 1, "reward_mean": 0.25, "step_time_s": 90.0},
                {"step": 2, "reward_mean": 0.75, "step_time_s": 100.0},
                {"kind": "eval", "step": 2, "pass@1": 0.875,
                 "result": result("s0", {"a": [1, 1, 1, 1], "b": [1, 1, 1, 0]})}],
            1: [{"step": 1, "reward_mean": 0.5, "step_time_s": 95.0},
                {"kind": "eval", "step": 1, "pass@1": 0.5,
                 "result": result("s1", {"a": [1, 1, 0, 0], "b": [1, 0, 0, 1]})}]}
    for seed, rows in runs.items():
        (tmp_path / f"train-seed{seed}").mkdir()
        (tmp_path / f"train-seed{seed}" / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    out = curve.summarize(tmp_path, [0, 1])
    assert out["pass@1_before"] == 0.125
    s0, s1 = out["seeds"][0], out["seeds"][1]
    assert (s0["pass@1_after"], s0["step"], s0["train_s"]) == (0.875, 2, 190)
    assert s0["reward_per_step"] == [0.25, 0.75]
    assert s0["gain"]["gain"] == 0.75 and s0["gain"]["tasks"] == 2
    assert s1["pass@1_after"] == 0.5 and s1["gain"]["gain"] == 0.375
    assert out["pooled_gain"]["gain"] == (0.75 + 0.375) / 2
    (tmp_path / "train-seed0" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in runs[0][1:]))
    with pytest.raises(SystemExit, match="step 0"):
        curve.summarize(tmp_path, [0, 1])
