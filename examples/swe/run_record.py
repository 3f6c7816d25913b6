"""What the learning proof reads back from a run's record in the store: the share of
mini-swe-agent's calls that continue a token segment, the prompt length per turn, and the
fix move each run made (`examples/swe/learning.py` eval and train)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from examples.swe import policy
from examples.swe.swe_tasks import load_swe_tasks


def segment_share(res: dict[str, Any], workdir: Path, res_tasks: Path | None = None,
                  ) -> dict[str, Any]:
    """From the store's record of the eval run (a store started on its Redis and key prefix):
    the share of mini's calls that continue a token segment, of all calls and of the calls
    that follow a call whose reply was a valid tool call (mini's history only appends then),
    and the prompt length (tokens) per turn; with `res_tasks` (the full task file), the fix
    moves by the operator the list move showed (`fix_kind`)."""

    from harnessrl import procs
    from harnessrl.clients import StoreClient
    from harnessrl.v1 import common_pb2 as c

    proc, info = procs.start_service(
        "store-readback", "services.store",
        ["--bind", "127.0.0.1:0", "--redis-url", res["store"]["redis_url"], "--key-prefix",
         res["store"]["key_prefix"]], workdir)
    try:
        store = StoreClient.connect(f"127.0.0.1:{info['grpc_port']}")
        rollouts = store.list_rollouts(res["run_id"], include_calls=True).rollouts
        store.close()
    finally:
        proc.stop()
    total = continued = after_valid = continued_after_valid = 0
    prompt_by_turn: dict[int, list[int]] = {}
    shown = {t.instance_id: info.op for t in load_swe_tasks(res_tasks)
             if (info := policy.in_slice(t))} if res_tasks else {}
    moves: dict[str, dict[str, int]] = {}  # the fix move per operator shown: right, copied, ...
    for ro in rollouts:
        calls = sorted(ro.calls, key=lambda x: x.seq)
        prev_valid = False
        if ro.task_id in shown:
            kind = fix_kind(calls, shown[ro.task_id])
            by_op = moves.setdefault(shown[ro.task_id], {})
            by_op[kind] = by_op.get(kind, 0) + 1
        for turn, call in enumerate(calls):
            total += 1
            cont = call.segment_start == c.SEGMENT_START_CONTINUED
            continued += cont
            if turn and prev_valid:
                after_valid += 1
                continued_after_valid += cont
            prompt_by_turn.setdefault(turn, []).append(len(call.prompt_token_ids))
            try:
                msg = json.loads(call.response_message_json)
                prev_valid = bool(msg.get("tool_calls")) and all(
                    "command" in json.loads(t["function"]["arguments"])
                    for t in msg["tool_calls"])
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                prev_valid = False
    return {"calls": total, "continued": continued,
            "share_continued": round(continued / total, 3) if total else None,
            "calls_after_valid_tool_call": after_valid,
            "share_continued_after_valid": round(continued_after_valid / after_valid, 3)
            if after_valid else None,
            "prompt_tokens_by_turn": {t: {"min": min(v), "median": sorted(v)[len(v) // 2],
                                          "max": max(v), "n": len(v)}
                                      for t, v in sorted(prompt_by_turn.items())},
            "fix_moves_by_operator_shown": moves}


def fix_kind(calls: list[Any], op: str) -> str:
    """What a run's fix move was: `right` (`fix flip`, or the flipped operator written out),
    `copied` (the operator shown again), `other` (another operator), `none` (no fix move
    among its commands)."""
    for call in calls:
        try:
            for tc in json.loads(call.response_message_json).get("tool_calls") or []:
                cmd = json.loads(tc["function"]["arguments"]).get("command", "")
                if cmd.startswith("fix "):
                    return {policy.FLIP_MOVE: "right", policy.fix_command(policy.RIGHT[op]):
                            "right", policy.fix_command(op): "copied"}.get(cmd, "other")
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return "none"
