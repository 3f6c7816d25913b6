"""A cheap pre-check of a warmed-up swe model, before any `harnessrl eval`: the policy's moves
sampled in-process (transformers, temperature 1) on the slice's prompts, each observation the
one the real move gets (the list move's output cached by `learning.py slice`; no mini, no
engine, no grader). Counts per sample: the list move right, then the fix move right (`fix
flip`), wrong (the operator shown, copied) or other. `right / samples` estimates pass@1.

`--exact`: no sampling; per task the probability the model gives the right fix move and the
copied one after the list move's real output (teacher forcing through the chat template, up
to the end of the turn), averaged over the tasks: what pass@1 is when the list move is made,
without sampling noise. Cheap (a minute on two cores) and deterministic, so it shows what a
few RL steps did to a checkpoint (`<output_dir>/checkpoints/step-N`) where a k = 4 evaluation
cannot (its pass@1 moves by about +-0.05 between runs of the same model).

    python -m examples.swe.probe MODEL_DIR --out OUT [--k 4] [--which heldout|train] [--exact]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from examples.swe import policy


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="learning.py's --out (the slice)")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--which", choices=("heldout", "train"), default="heldout")
    ap.add_argument("--exact", action="store_true",
                    help="the right and copied fix moves' probabilities, no sampling")
    a = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(str(a.model.resolve()))
    model = AutoModelForCausalLM.from_pretrained(str(a.model.resolve())).eval()
    torch.manual_seed(0)
    split = json.loads((a.out / "slice-split.json").read_text())
    t = policy.mini_templates()

    def command(msgs: list[dict[str, Any]]) -> str | None:
        ids = tok.apply_chat_template(msgs, tools=[policy.BASH_TOOL], return_tensors="pt",
                                      add_generation_prompt=True, return_dict=True)["input_ids"]
        out = model.generate(ids, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=80, pad_token_id=tok.pad_token_id)
        m = re.search(r'"command": "(.*?)"\}', tok.decode(out[0, ids.shape[1]:]))
        return m.group(1) if m else None

    def after_listing(task: dict[str, Any], first: str) -> list[dict[str, Any]]:
        obs = policy.render(t["observation"], output={
            "output": split["listings"][task["instance_id"]], "returncode": 0,
            "exception_info": ""})
        return [{"role": "system", "content": policy.render(t["system"])},
                {"role": "user", "content": policy.render(t["instance"],
                                                          task=task["problem_statement"])},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "call0", "type": "function", "function": {
                        "name": "bash", "arguments": json.dumps({"command": first})}}]},
                {"role": "tool", "tool_call_id": "call0", "content": obs}]

    def move_logprob(msgs: list[dict[str, Any]], command: str) -> float:
        """log P(the assistant's turn that runs `command` | msgs), up to its <|im_end|>."""
        pre = tok.apply_chat_template(msgs, tools=[policy.BASH_TOOL], tokenize=True,
                                      add_generation_prompt=True, return_dict=True)["input_ids"]
        full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "call1", "type": "function", "function": {
                "name": "bash", "arguments": json.dumps({"command": command})}}]}],
            tools=[policy.BASH_TOOL], tokenize=True, return_dict=True)["input_ids"]
        end = tok.convert_tokens_to_ids("<|im_end|>")
        full = full[:len(full) - full[::-1].index(end)]
        assert full[:len(pre)] == pre, "the chat template does not extend the prompt"
        ids = torch.tensor([full])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        return float(lp[torch.arange(len(full) - 1), ids[0, 1:]][len(pre) - 1:].sum())

    if a.exact:
        import math

        right, copied = [], []
        for task in split[a.which]:
            info = policy.in_slice(task)
            assert info is not None
            msgs = after_listing(task, policy.LIST)
            right.append(math.exp(move_logprob(msgs, policy.fix_move(info.op, True))))
            copied.append(math.exp(move_logprob(msgs, policy.fix_move(info.op, False))))
        print(json.dumps({"which": a.which, "tasks": len(right), "exact": True,
                          "p_right": round(sum(right) / len(right), 4),
                          "p_copied": round(sum(copied) / len(copied), 4)}))
        return 0

    c: Counter[str] = Counter()
    for task in split[a.which]:
        info = policy.in_slice(task)
        assert info is not None
        base = after_listing(task, policy.LIST)[:2]
        for _ in range(a.k):
            c["samples"] += 1
            first = command(base)
            if first != policy.LIST:
                c["list_other"] += 1
                continue
            second = command(after_listing(task, first))
            c["right" if second == policy.fix_move(info.op, True) else
              "wrong" if second == policy.fix_move(info.op, False) else
              "fix_other"] += 1
    print(json.dumps({"which": a.which, **c, "pass@1_estimate": round(c["right"] / c["samples"],
                                                                       3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
