"""Grading: turning a finished harness run into a reward.

The reward source is the run's `RewardSource`:

- `GRADER_JSON` (and `UNSPECIFIED`): the grader command runs after the harness exited 0, in
  the same working directory, with the harness's environment (minus its model credential, so
  the grader's own model calls, if any, can never be recorded as the policy's) plus
  `HARNESSRL_HARNESS_EXIT_CODE`, `HARNESSRL_HARNESS_STDOUT` and `HARNESSRL_HARNESS_STDERR`
  (paths of the harness's captured output) and `HARNESSRL_STORE_ADDRESS` (the attempt's
  recorded calls are there: the per-attempt judge reads them; a grader inside a pod has none).
  It must exit 0 and its last non-empty stdout line must be a JSON object with a finite numeric
  `"reward"` (and optionally `"parts"`, named numbers, and a `"reason"`). A grader that finds
  the agent's code forged the outcome adds `"tampered": true` (a JSON bool) and optionally
  `"evidence"` (a string): the rollout is marked tampered and its reward is the run's
  `tampered_rewards` (`tampered_rewards.py`), whatever the grader printed.
- `GRADER_EXIT_CODE`: the same grader run; exit 0 gives 1.0, exit 1 gives 0.0, any other exit
  is a failure.
- `HARNESS`: no grader; the reward the harness reported through the gateway (stored on its
  attempt) is the reward; none reported is a failure.

A grader that fails (times out, crashes, prints something that is not a reward) fails the
rollout with the reason, quoting the offending output: the harness is *not* run again for it,
because a broken grader is a bug of the task set, not bad luck of the harness.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from harnessrl.v1 import common_pb2 as c, store_pb2 as spb
from services.controller.backends import JobResult, JobSpec
from services.controller.sandbox.policy import SandboxPolicy

GRADER_STDOUT = "grader.stdout.log"
GRADER_STDERR = "grader.stderr.log"
QUOTE_LIMIT = 300
EVIDENCE_LIMIT = 2000  # characters of a grader's tamper evidence kept on the rollout
STDERR_QUOTE_CHARS = 500  # of a failed harness's stderr, in its attempt's error
_TAIL_BYTES = 64 * 1024
# The grader gets the harness's environment without these (see the module docstring).
CREDENTIAL_ENV = ("OPENAI_API_KEY", "OPENAI_BASE_URL")


# Reward sources whose attempts run no grader of their own.
NO_GRADER = (c.REWARD_SOURCE_HARNESS, c.REWARD_SOURCE_GROUP_GRADER)


@dataclass(frozen=True)
class Grade:
    reward: float | None  # None: grading failed, `error` says why
    error: str = ""
    parts: tuple[tuple[str, float], ...] = ()  # the grader's named parts of the reward
    reason: str = ""  # the grader's reason, if it gave one
    pending: bool = False  # no reward yet: the group grader gives it
    tampered: bool = False  # the grader found the agent's code forged the outcome
    evidence: str = ""  # the grader's evidence of it (only with `tampered`)
    dropped: bool = False  # tampered under TAMPERED_REWARDS_DROP: stored without a reward

    @property
    def ok(self) -> bool:
        return self.reward is not None

    def into(self, req: spb.FinishAttemptRequest) -> spb.FinishAttemptRequest:
        """`req` with this (successful) grade's reward, parts, reason and tamper flag."""
        req.reward, req.reward_reason = self.reward or 0.0, self.reason[:2000]
        req.reward_pending = self.pending
        req.reward_parts.extend(c.RewardPart(name=n, value=v) for n, v in self.parts)
        req.tampered, req.tamper_evidence = self.tampered, self.evidence[:EVIDENCE_LIMIT]
        req.reward_dropped = self.dropped
        return req


def short_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def safe_name(text: str) -> str:
    """A file/job-name-safe form of `text`, unique per text."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", text)[:80]
    return safe if safe == text and safe not in (".", "..") else f"{safe}-{short_hash(text)}"


def quote(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text` as a Python literal, cut to `limit` characters (marked) so reasons stay short."""
    if len(text) > limit:
        return repr(text[:limit]) + f"... ({len(text)} chars)"
    return repr(text)


def read_tail(path: Path, limit: int = _TAIL_BYTES) -> str:
    """The last `limit` bytes of a file, decoded leniently ("" when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def parse_reward_line(stdout: str) -> Grade:
    """The reward of a GRADER_JSON grader's stdout: its last non-empty line must be a JSON
    object with a finite number under "reward"."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        return Grade(None, "grader printed nothing on stdout; its last line must be a JSON "
                           'object like {"reward": 1.0}')
    last = lines[-1]
    try:
        obj = json.loads(last)
    except ValueError as exc:
        return Grade(None, f"grader's last stdout line is not JSON ({exc}): {quote(last)}")
    if not isinstance(obj, dict):
        return Grade(None, f"grader's last stdout line is not a JSON object: {quote(last)}")
    if "reward" not in obj:
        return Grade(None, f'grader\'s JSON has no "reward": {quote(last)}')
    grade = reward_fields(obj)
    return grade if grade.ok else Grade(None, f"grader's {grade.error}: {quote(last)}")


def reward_fields(obj: dict[str, object]) -> Grade:
    """The reward of a grader's JSON object — `reward` (a finite number), optional `parts`
    (named finite numbers), `reason` (a string), `tampered` (a bool) and `evidence` (a
    string, kept only with `tampered`) — or what is wrong with it; the per-attempt grader's
    line and each of a group grader's rewards. The reward is the grader's: the run's
    `tampered_rewards` replaces a tampered one's later."""
    reward, parts, reason = obj.get("reward"), obj.get("parts") or {}, obj.get("reason") or ""
    tampered, evidence = obj.get("tampered", False), obj.get("evidence") or ""
    if not finite(reward):
        return Grade(None, "reward is not a finite number")
    if not isinstance(parts, dict) or not all(k and finite(v) for k, v in parts.items()):
        return Grade(None, "parts must be an object of named finite numbers")
    if not isinstance(reason, str):
        return Grade(None, "reason is not a string")
    if not isinstance(tampered, bool):
        return Grade(None, f"tampered must be true or false (a JSON bool), not "
                           f"{json.dumps(tampered)[:40]}")
    if not isinstance(evidence, str):
        return Grade(None, "evidence is not a string")
    return Grade(float(reward), parts=tuple((str(k), float(v)) for k, v in parts.items()),
                 reason=reason, tampered=tampered, evidence=evidence if tampered else "")


def finite(value: object) -> TypeGuard[int | float]:
    """A JSON number (not a bool) that is a finite float."""
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def reward_from_exit_code(exit_code: int) -> Grade:
    if exit_code == 0:
        return Grade(1.0)
    if exit_code == 1:
        return Grade(0.0)
    return Grade(None, f"grader exited with code {exit_code} (GRADER_EXIT_CODE takes 0 -> 1.0, "
                       f"1 -> 0.0; anything else is a failure)")


def reward_from_report(rollout: c.Rollout, attempt: int) -> Grade:
    """REWARD_SOURCE_HARNESS: the reward the harness reported for `attempt`."""
    for att in rollout.attempts:
        if att.attempt == attempt:
            if att.has_reported_reward:
                return Grade(att.reported_reward)
            return Grade(None, "the harness reported no reward (REWARD_SOURCE_HARNESS expects "
                               "a POST to /v1/harnessrl/reward through the gateway)")
    return Grade(None, f"attempt {attempt} of rollout {rollout.rollout_id} not in the store")


def grader_env(harness_env: dict[str, str], harness: JobResult) -> dict[str, str]:
    env = {k: v for k, v in harness_env.items() if k not in CREDENTIAL_ENV}
    env["HARNESSRL_HARNESS_EXIT_CODE"] = str(harness.exit_code)
    env["HARNESSRL_HARNESS_STDOUT"] = str(harness.stdout_path)
    env["HARNESSRL_HARNESS_STDERR"] = str(harness.stderr_path)
    return env


async def run_grader(run_job: Callable[[JobSpec], Awaitable[JobResult]], *, job_id: str,
                     argv: list[str], harness_env: dict[str, str], workdir: Path,
                     timeout_s: float, harness: JobResult, reward_source: int,
                     labels: dict[str, str] | None = None, cwd: Path | None = None,
                     sandbox: SandboxPolicy | None = None) -> Grade:
    """Runs the grader as a job (`run_job` launches a spec on a backend and waits for it) and
    reads the reward from it; its output goes to `workdir`, it runs in `cwd` (in `sandbox`)."""
    spec = JobSpec(job_id=job_id, argv=list(argv), env=grader_env(harness_env, harness),
                   workdir=workdir, timeout_s=timeout_s, labels=dict(labels or {}),
                   stdout_name=GRADER_STDOUT, stderr_name=GRADER_STDERR, cwd=cwd,
                   sandbox=sandbox)
    return grade_result(await run_job(spec), reward_source, timeout_s)


def in_job_grader_env(harness_env: dict[str, str]) -> dict[str, str]:
    """The environment of a grader that runs inside the harness's job (Kubernetes: a container
    after the harness's): the harness's without its credential. It runs only after the
    harness exited 0; the harness's output is in the job's log, not in files it can read."""
    env = {k: v for k, v in harness_env.items() if k not in CREDENTIAL_ENV}
    env["HARNESSRL_HARNESS_EXIT_CODE"] = "0"
    return env


def grade_in_job(result: JobResult, reward_source: int) -> Grade:
    """The reward of a harness job whose grader ran inside it (`JobSpec.grader`)."""
    if result.grader is None:
        return Grade(None, "the grader did not run in the harness's job")
    out = result.grader
    if out.timed_out:
        return Grade(None, "grader timed out (killed)")
    if reward_source == c.REWARD_SOURCE_GRADER_EXIT_CODE:
        grade = reward_from_exit_code(out.exit_code)
    elif out.exit_code != 0:
        grade = Grade(None, f"grader exited with code {out.exit_code}")
    else:
        grade = parse_reward_line(read_tail(out.stdout_path))
    if not grade.ok:
        log_tail = read_tail(out.stdout_path, 2048).strip()
        if log_tail:
            grade = Grade(None, f"{grade.error}; grader log: {quote(log_tail[-QUOTE_LIMIT:])}")
    return grade


def grade_result(result: JobResult, reward_source: int, timeout_s: float) -> Grade:
    if result.cancelled:
        return Grade(None, "grader cancelled")
    if result.timed_out:
        return Grade(None, f"grader timed out after {timeout_s:g}s (killed)")
    if result.error:
        return Grade(None, f"grader could not run: {result.error}")
    if reward_source == c.REWARD_SOURCE_GRADER_EXIT_CODE:
        grade = reward_from_exit_code(result.exit_code)
    elif result.exit_code != 0:
        grade = Grade(None, f"grader exited with code {result.exit_code}")
    else:
        grade = parse_reward_line(read_tail(result.stdout_path))
    if not grade.ok:
        stderr = read_tail(result.stderr_path, 2048).strip()
        if stderr:
            grade = Grade(None, f"{grade.error}; grader stderr: {quote(stderr[-QUOTE_LIMIT:])}")
    return grade


def harness_failure(result: JobResult, timeout_s: float) -> str:
    """Why a harness job that did not succeed failed, for the attempt's record."""
    if result.cancelled:  # not by this run: the controller shut down, say
        return f"harness job cancelled ({result.error or 'outside this run'})"
    if result.timed_out:
        return (f"harness timed out after {timeout_s:g}s; its job was killed"
                + (f" ({result.error})" if result.error else ""))
    error = f"harness exited with code {result.exit_code}"
    if result.error:
        error += f" ({result.error})"
    what = "log" if result.stderr_path == result.stdout_path else "stderr"
    stderr = read_tail(result.stderr_path, 4096).strip()
    if stderr:
        error += f"; {what}: {quote(stderr[-STDERR_QUOTE_CHARS:])}"
    return error
