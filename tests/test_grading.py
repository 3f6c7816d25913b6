"""Grading rules (services/controller/grading.py): reward parsing, and graders run as real
processes through the local backend."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harnessrl.v1 import common_pb2 as c
from services.controller import grading, tampered_rewards
from services.controller.backends import JobResult, JobSpec, LocalBackend

PY = sys.executable


@pytest.mark.parametrize("stdout, reward", [
    ('{"reward": 1}\n', 1.0),
    ('log line\n{"reward": 0.25, "detail": "x"}\n\n  \n', 0.25),
    ('{"reward": -3.5e-1}', -0.35),
])
def test_reward_line_accepted(stdout: str, reward: float) -> None:
    g = grading.parse_reward_line(stdout)
    assert g.ok and g.reward == pytest.approx(reward) and g.error == ""


@pytest.mark.parametrize("stdout, reason", [
    ("", "printed nothing"),
    ("\n \n", "printed nothing"),
    ('{"reward": 1}\nall done\n', "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"score": 1}', 'no "reward"'),
    ('{"reward": "1"}', "not a finite number"),
    ('{"reward": true}', "not a finite number"),
    ('{"reward": NaN}', "not a finite number"),
    ('{"reward": Infinity}', "not a finite number"),
    ('{"reward": null}', "not a finite number"),
])
def test_reward_line_refused_with_quote(stdout: str, reason: str) -> None:
    g = grading.parse_reward_line(stdout)
    assert not g.ok and g.reward is None
    assert reason in g.error
    last = [ln for ln in stdout.splitlines() if ln.strip()]
    if last:
        assert repr(last[-1].strip()) in g.error  # the offending line, quoted


def test_tampered_and_evidence_are_read_from_the_reward_line() -> None:
    g = grading.parse_reward_line('{"reward": 1.0, "reason": "r", "tampered": true, '
                                  '"evidence": "must-fail canary passed"}')
    assert g.ok and g.tampered and g.evidence == "must-fail canary passed"
    assert g.reward == 1.0  # the grader's: the run's tampered_rewards replaces it
    for line in ('{"reward": 0.5}', '{"reward": 0.5, "tampered": false, "evidence": "x"}'):
        g = grading.parse_reward_line(line)
        assert g.ok and not g.tampered and g.evidence == ""  # evidence only with tampered


@pytest.mark.parametrize("extra, reason", [
    ('"tampered": "yes"', 'tampered must be true or false (a JSON bool), not "yes"'),
    ('"tampered": 1', "tampered must be true or false (a JSON bool), not 1"),
    ('"tampered": null', "tampered must be true or false (a JSON bool), not null"),
    ('"tampered": true, "evidence": ["x"]', "evidence is not a string"),
])
def test_a_tampered_field_that_is_not_a_bool_is_refused(extra: str, reason: str) -> None:
    line = '{"reward": 1.0, ' + extra + "}"
    g = grading.parse_reward_line(line)
    assert not g.ok and reason in g.error and repr(line) in g.error, g.error


@pytest.mark.parametrize("policy, penalty, reward, dropped", [
    (c.TAMPERED_REWARDS_UNSPECIFIED, 0.0, 0.0, False),
    (c.TAMPERED_REWARDS_ZERO, 0.0, 0.0, False),
    (c.TAMPERED_REWARDS_PENALTY, 0.0, -1.0, False),
    (c.TAMPERED_REWARDS_PENALTY, 2.5, -2.5, False),
    (c.TAMPERED_REWARDS_DROP, 0.0, 0.0, True),
])
def test_a_tampered_grade_gets_the_runs_reward_never_its_own(
        policy: int, penalty: float, reward: float, dropped: bool) -> None:
    spec = c.RunSpec(tampered_rewards=policy, tampered_penalty=penalty)  # type: ignore[arg-type]
    for claimed in (1.0, 0.0, -7.0):
        g = tampered_rewards.applied(grading.Grade(claimed, tampered=True, evidence="e"), spec)
        assert (g.reward, g.dropped, g.tampered, g.evidence) == (reward, dropped, True, "e")
    honest = grading.Grade(1.0)
    assert tampered_rewards.applied(honest, spec) is honest
    failed = grading.Grade(None, "boom", tampered=True)
    assert tampered_rewards.applied(failed, spec) is failed


def test_long_output_is_truncated_in_the_reason() -> None:
    g = grading.parse_reward_line("x" * 10_000)
    assert not g.ok and "(10000 chars)" in g.error and len(g.error) < 600


def test_exit_code_and_reported_rewards() -> None:
    assert grading.reward_from_exit_code(0).reward == 1.0
    assert grading.reward_from_exit_code(1).reward == 0.0
    for code in (2, -9, 127):
        g = grading.reward_from_exit_code(code)
        assert not g.ok and f"code {code}" in g.error
    ro = c.Rollout(rollout_id="r", attempts=[
        c.Attempt(attempt=1, has_reported_reward=True, reported_reward=0.7),
        c.Attempt(attempt=2)])
    assert grading.reward_from_report(ro, 1).reward == 0.7
    assert "reported no reward" in grading.reward_from_report(ro, 2).error
    assert not grading.reward_from_report(ro, 3).ok


@pytest.fixture
async def backend() -> AsyncIterator[LocalBackend]:
    b = LocalBackend(kill_grace_s=0.3)
    yield b
    await b.close()


async def grade(backend: LocalBackend, tmp_path: Path, body: str, source: int,
                timeout_s: float = 10.0) -> grading.Grade:
    grader = tmp_path / "grader.py"
    grader.write_text(textwrap.dedent(body))
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    harness = JobResult(job_id="h", exit_code=0, timed_out=False, cancelled=False,
                        stdout_path=workdir / "stdout.log", stderr_path=workdir / "stderr.log",
                        started_at=time.time(), finished_at=time.time())

    async def run_job(spec: JobSpec) -> JobResult:
        await backend.launch(spec)
        try:
            return await backend.wait(spec.job_id)
        finally:
            await backend.cleanup(spec.job_id)

    return await grading.run_grader(
        run_job, job_id="g", argv=[PY, str(grader)],
        harness_env={"OPENAI_API_KEY": "hrl1.secret", "OPENAI_BASE_URL": "http://gw/v1",
                     "HARNESSRL_TASK_ID": "t1"},
        workdir=workdir, timeout_s=timeout_s, harness=harness, reward_source=source)


async def test_grader_sees_harness_env_without_credential(backend: LocalBackend,
                                                          tmp_path: Path) -> None:
    g = await grade(backend, tmp_path, """
        import json, os
        keys = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "HARNESSRL_TASK_ID",
                "HARNESSRL_HARNESS_EXIT_CODE", "HARNESSRL_HARNESS_STDOUT")
        open("seen.json", "w").write(json.dumps({k: os.environ.get(k) for k in keys}))
        print(json.dumps({"reward": 0.5}))
    """, c.REWARD_SOURCE_GRADER_JSON)
    assert g.reward == 0.5
    seen = json.loads((tmp_path / "work" / "seen.json").read_text())
    assert seen["OPENAI_API_KEY"] is None and seen["OPENAI_BASE_URL"] is None
    assert seen["HARNESSRL_TASK_ID"] == "t1" and seen["HARNESSRL_HARNESS_EXIT_CODE"] == "0"
    assert seen["HARNESSRL_HARNESS_STDOUT"] == str(tmp_path / "work" / "stdout.log")
    assert (tmp_path / "work" / grading.GRADER_STDOUT).read_text() == '{"reward": 0.5}\n'


async def test_json_grader_crash_quotes_stderr(backend: LocalBackend, tmp_path: Path) -> None:
    g = await grade(backend, tmp_path, """
        import sys
        print('{"reward": 1}')
        sys.exit("grader exploded: missing answer.txt")
    """, c.REWARD_SOURCE_GRADER_JSON)
    assert not g.ok
    assert "exited with code 1" in g.error and "grader exploded: missing answer.txt" in g.error


async def test_exit_code_grader(backend: LocalBackend, tmp_path: Path) -> None:
    for code, reward in ((0, 1.0), (1, 0.0), (4, None)):
        g = await grade(backend, tmp_path, f"import sys; sys.exit({code})",
                        c.REWARD_SOURCE_GRADER_EXIT_CODE)
        assert g.reward == reward, (code, g)


async def test_grader_timeout(backend: LocalBackend, tmp_path: Path) -> None:
    t0 = time.monotonic()
    g = await grade(backend, tmp_path, "import time; time.sleep(60)",
                    c.REWARD_SOURCE_GRADER_JSON, timeout_s=0.5)
    assert not g.ok and "timed out after 0.5s" in g.error
    assert time.monotonic() - t0 < 10
