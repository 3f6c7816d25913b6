"""Group graders: rewards that need the whole group (a judge ranking a group's rollouts
relative to each other, as GRPO's advantage does).

A run that names `group_grader_command` has its rollouts created GROUP_GRADING_WAITING: the
store holds the group back when its last rollout ends (it is not published). The controller
then runs the command here, in its own environment (whatever the job backend; pods never
need the store), once per group:

  input   $HARNESSRL_GROUP_INPUT, a JSON file written from the store, not from the harness's
          files: {"run_id", "group_id", "task_id", "task": {...},
                  "rollouts": [{"rollout_id", "index_in_group", "calls", "transcript":
                               [messages], "grader": {"reward", "parts", "reason"} or null}],
                  "failed": [{"rollout_id", "index_in_group", "status", "error"}]}
          `rollouts` are those that SUCCEEDED (the others have no reward to give); the
          transcript is the attempt's last recorded call rendered as messages (its request's
          conversation, then the answer).
  output  $HARNESSRL_GROUP_OUTPUT, a JSON file: {"rewards": [{"rollout_id", "reward",
          "reason"?, "parts"?: {"name": number}, "tampered"?: bool, "evidence"?}]}, one per
          rollout of the input. A tampered rollout's reward is the run's `tampered_rewards`
          (tampered_rewards.py), also one the per-attempt grader found tampered before.

It runs with the run's `env`, `HARNESSRL_RUN_ID`, `HARNESSRL_GROUP_ID`, `HARNESSRL_TASK_JSON`
and `HARNESSRL_STORE_ADDRESS` (the judge caches its answers there), in
`<workdir_root>/<run>/groups/<group>/try-<n>` with its stdout/stderr logs. The answer goes to
the store in one transaction (Store.SetGroupRewards), which publishes the group. Failures
follow the per-attempt grader's rules: exit code other than 0, a timeout (its process group is
killed), an output that is not one reward per rollout — the group FAILS with the reason
(quoting the grader's stderr). A failed group is published with every rollout
failed (the trainer counts it and learns nothing from it), never with some of its rewards. A
group with no succeeded rollout is published without running the grader; a cancelled run's
unanswered groups fail ("run cancelled"). The grader dies with the controller (PR_SET_PDEATHSIG); a restarted controller
runs it again for every group still waiting, in a new try directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from harnessrl.v1 import common_pb2 as c, store_pb2 as spb
from services.controller.grading import (EVIDENCE_LIMIT, QUOTE_LIMIT, quote, read_tail,
                                         reward_fields, safe_name)
from harnessrl.transcripts import last_call_transcript
from services.controller.grader_access import GraderAccess, without_identity
from services.controller.tampered_rewards import group_rewards
from services.controller.store_calls import ResilientStore

log = logging.getLogger("harnessrl.controller")

KILL_GRACE_S = 2.0


def _grader_part(ro: c.Rollout) -> dict[str, Any] | None:
    if not ro.has_reward:
        return None
    return {"reward": ro.reward, "parts": {p.name: p.value for p in ro.reward_parts},
            "reason": ro.reward_reason}


def group_input(rollouts: list[c.Rollout], task: c.Task) -> dict[str, Any]:
    ro0 = rollouts[0]
    done = [ro for ro in rollouts if ro.status == c.ROLLOUT_STATUS_SUCCEEDED]
    return {
        "run_id": ro0.run_id, "group_id": ro0.group_id, "task_id": task.task_id,
        "task": json.loads(task.data_json),
        "rollouts": [{"rollout_id": ro.rollout_id, "index_in_group": ro.index_in_group,
                      "calls": len(ro.calls),
                      "transcript": last_call_transcript(ro.calls),
                      "grader": _grader_part(ro)} for ro in done],
        "failed": [{"rollout_id": ro.rollout_id, "index_in_group": ro.index_in_group,
                    "status": c.RolloutStatus.Name(ro.status), "error": ro.error}
                   for ro in rollouts if ro not in done],
    }


def parse_output(text: str, want: list[str]) -> list[spb.GroupReward]:
    """The rewards of a group grader's output file; ValueError says what is wrong."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"output is not JSON ({exc}): {quote(text)}") from None
    items = obj.get("rewards") if isinstance(obj, dict) else None
    if not isinstance(items, list):
        raise ValueError(f'output has no "rewards" list: {quote(text)}')
    out: dict[str, spb.GroupReward] = {}
    for it in items:
        rid = it.get("rollout_id") if isinstance(it, dict) else None
        if rid not in want or rid in out:
            raise ValueError(f"a reward for {rid!r}: not a rollout of the input, or repeated")
        grade = reward_fields(it)
        if grade.reward is None:
            raise ValueError(f"{rid}: {grade.error}")
        out[rid] = spb.GroupReward(
            rollout_id=rid, reward=grade.reward, reason=grade.reason,
            parts=[c.RewardPart(name=n, value=v) for n, v in grade.parts],
            tampered=grade.tampered, tamper_evidence=grade.evidence[:EVIDENCE_LIMIT])
    if missing := [r for r in want if r not in out]:
        raise ValueError(f"no reward for {missing}")
    return [out[r] for r in want]


# Execs argv[1:] with PR_SET_PDEATHSIG set to SIGKILL (kept across exec): the grader dies with
# the controller, and a restarted controller runs it again. Set in a fresh process rather than
# in a preexec_fn, which would make the controller fork() (running gRPC's fork handlers, which
# crash the child) instead of spawning.
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
                    "os.execvp(sys.argv[1], sys.argv[1:])")


class GroupGrader:
    def __init__(self, spec: c.RunSpec, store: ResilientStore, workdir: Path,
                 graders: GraderAccess) -> None:
        self.spec = spec
        self.argv = list(spec.group_grader_command)
        self.graders = graders
        self.timeout_s = spec.group_grader_timeout_s  # run_spec.normalize fills it in
        self.env = dict(spec.env)
        self.store, self.workdir = store, workdir

    async def settle(self, group_id: str, task: c.Task, cancelled: bool) -> list[c.Rollout]:
        """Grades a group whose rollouts have all ended (unless answered before) and hands
        the answer to the store; the group's rollouts as stored after it."""
        rollouts = await self.store.list_group(group_id)
        if all(ro.group_grading != c.GROUP_GRADING_WAITING for ro in rollouts):
            return [_without_calls(ro) for ro in rollouts]
        req = spb.SetGroupRewardsRequest(group_id=group_id)
        if cancelled:
            req.error = "run cancelled before the group was graded"
        elif any(ro.status == c.ROLLOUT_STATUS_SUCCEEDED for ro in rollouts):
            try:
                req.rewards.extend(group_rewards(await self._run(group_input(rollouts, task)),
                                                 rollouts, self.spec))
            except GroupGraderFailed as exc:
                req.error = str(exc)
                log.warning("group %s: group grader failed: %s", group_id, exc,
                            extra={"run": rollouts[0].run_id})
        return list((await self.store.set_group_rewards(req)).rollouts)

    async def fail(self, group_id: str, error: str) -> list[c.Rollout]:
        """Fails the group with `error` (the controller's own failure to grade it)."""
        return list((await self.store.set_group_rewards(spb.SetGroupRewardsRequest(
            group_id=group_id, error=error))).rollouts)

    async def _run(self, data: dict[str, Any]) -> list[spb.GroupReward]:
        base = self.workdir / "groups" / safe_name(data["task_id"])
        base.mkdir(parents=True, exist_ok=True)
        wd = base / f"try-{len(list(base.glob('try-*'))) + 1}"
        wd.mkdir()
        (wd / "input.json").write_text(json.dumps(data))
        scope = self.graders.env(data["run_id"], data["group_id"],
                                 [r["rollout_id"] for r in data["rollouts"]], self.timeout_s + 300)
        env = {**without_identity(os.environ), **self.env, **scope,
               "HARNESSRL_RUN_ID": data["run_id"],
               "HARNESSRL_GROUP_ID": data["group_id"],
               "HARNESSRL_TASK_JSON": json.dumps(data["task"]),
               "HARNESSRL_GROUP_INPUT": str(wd / "input.json"),
               "HARNESSRL_GROUP_OUTPUT": str(wd / "output.json"),
               "HARNESSRL_STORE_ADDRESS": self.store.address}
        with open(wd / "stdout.log", "wb") as out, open(wd / "stderr.log", "wb") as err:
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", _DIE_WITH_PARENT, *self.argv, cwd=wd, env=env,
                    stdout=out, stderr=err, start_new_session=True)
            except OSError as exc:
                raise GroupGraderFailed(f"group grader could not start: {exc}") from None
        try:
            code = await asyncio.wait_for(proc.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            await _kill(proc)
            raise GroupGraderFailed(f"group grader timed out after {self.timeout_s:g}s "
                                    "(killed)") from None
        except asyncio.CancelledError:
            await _kill(proc)
            raise
        await _kill(proc)  # whatever it left running in its process group
        try:
            if code != 0:
                raise ValueError(f"group grader exited with code {code}")
            if not (wd / "output.json").exists():
                raise ValueError("group grader wrote no $HARNESSRL_GROUP_OUTPUT")
            return parse_output((wd / "output.json").read_text(errors="replace"),
                                [r["rollout_id"] for r in data["rollouts"]])
        except ValueError as exc:
            stderr = read_tail(wd / "stderr.log", 2048).strip()
            why = f"{exc}; stderr: {quote(stderr[-QUOTE_LIMIT:])}" if stderr else str(exc)
            raise GroupGraderFailed(why) from None


class GroupGraderFailed(Exception):
    pass


def _without_calls(ro: c.Rollout) -> c.Rollout:
    del ro.calls[:]
    return ro


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM to the grader's process group, then (after the grace) SIGKILL to what is left
    of it: members that ignore SIGTERM, or outlive their leader, die too."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_GRACE_S)
    except (ProcessLookupError, PermissionError, asyncio.TimeoutError):
        pass
    finally:  # also when this task is cancelled during the grace
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    await proc.wait()
