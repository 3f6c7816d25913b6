"""Conformance suite of the job-backend interface (`services.controller.backends.base`).

Every backend runs the same tests: add it to `BACKENDS` (a name and a factory taking the test's
tmp dir) and it is held to the same contract. The local backend runs real process groups; a
Kubernetes backend joins with its test double (a fake API server driven through the real
client library) the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from services.controller.backends import JobBackend, JobSpec, JobState, LocalBackend

PY = sys.executable

BACKENDS: dict[str, Callable[[Path], JobBackend]] = {
    "local": lambda tmp: LocalBackend(kill_grace_s=0.5),
}


@pytest.fixture(params=sorted(BACKENDS))
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[JobBackend]:
    b = BACKENDS[request.param](tmp_path)
    yield b
    await b.close()


def script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def spec(tmp_path: Path, job_id: str, argv: list[str], env: dict[str, str] | None = None,
         timeout_s: float = 30.0, labels: dict[str, str] | None = None) -> JobSpec:
    return JobSpec(job_id=job_id, argv=argv, env=env or {}, workdir=tmp_path / "jobs" / job_id,
                   timeout_s=timeout_s, labels=labels or {})


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


async def test_success_exit_code_and_output(backend: JobBackend, tmp_path: Path) -> None:
    s = spec(tmp_path, "ok", [PY, "-c",
                              "import sys; print('to-out'); print('to-err', file=sys.stderr)"])
    await backend.launch(s)
    r = await backend.wait("ok")
    assert r.exit_code == 0 and r.succeeded
    assert not r.timed_out and not r.cancelled and r.error == ""
    assert r.stdout_path.read_text() == "to-out\n"
    assert r.stderr_path.read_text() == "to-err\n"
    assert r.started_at <= r.finished_at


async def test_failure_exit_code(backend: JobBackend, tmp_path: Path) -> None:
    await backend.launch(spec(tmp_path, "fail", [PY, "-c", "import sys; sys.exit(3)"]))
    r = await backend.wait("fail")
    assert r.exit_code == 3 and not r.succeeded and not r.timed_out


async def test_env_and_workdir_visible(backend: JobBackend, tmp_path: Path) -> None:
    s = spec(tmp_path, "env", [PY, "-c", textwrap.dedent("""
        import json, os
        print(json.dumps({"cwd": os.getcwd(), "a": os.environ.get("JOB_A"),
                          "b": os.environ.get("JOB_B"),
                          "secret": os.environ.get("HARNESSRL_CONTROLLER_SECRET")}))
        open("made-here.txt", "w").write("x")
    """)], env={"JOB_A": "alpha", "JOB_B": "b e t a"})
    os.environ["HARNESSRL_CONTROLLER_SECRET"] = "must-not-leak"
    try:
        await backend.launch(s)
    finally:
        del os.environ["HARNESSRL_CONTROLLER_SECRET"]
    r = await backend.wait("env")
    assert r.exit_code == 0, r.stderr_path.read_text()
    out = json.loads(r.stdout_path.read_text())
    assert Path(out["cwd"]).resolve() == s.workdir.resolve()
    assert (out["a"], out["b"]) == ("alpha", "b e t a")
    assert out["secret"] is None
    assert (s.workdir / "made-here.txt").exists()


async def test_unexecutable_command_is_a_failed_job(backend: JobBackend, tmp_path: Path) -> None:
    await backend.launch(spec(tmp_path, "nope", [str(tmp_path / "no-such-program")]))
    r = await backend.wait("nope")
    assert r.exit_code == 127 and not r.succeeded
    assert "no-such-program" in r.error
    assert "no-such-program" in r.stderr_path.read_text()


async def test_timeout_kills_grandchild_ignoring_sigterm(backend: JobBackend,
                                                         tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    grandchild = script(tmp_path, "grandchild.py", f"""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(pidfile)!r} + ".tmp", "w").write(str(os.getpid()))
        os.replace({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
        time.sleep(600)
    """)
    harness = script(tmp_path, "harness.py", f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, {str(grandchild)!r}])
        time.sleep(600)
    """)
    t0 = time.monotonic()
    await backend.launch(spec(tmp_path, "hang", [PY, str(harness)], timeout_s=1.5))
    # wait for the grandchild to be up before the deadline hits
    while not pidfile.exists() and time.monotonic() - t0 < 1.4:
        await asyncio.sleep(0.02)
    assert pidfile.exists(), "grandchild did not start in time"
    gpid = int(pidfile.read_text())
    assert process_alive(gpid)
    r = await backend.wait("hang")
    elapsed = time.monotonic() - t0
    assert r.timed_out and not r.cancelled and not r.succeeded
    assert 1.4 < elapsed < 10, elapsed
    assert not process_alive(gpid), "grandchild survived the job's timeout"


async def test_leftover_background_process_is_killed_at_exit(backend: JobBackend,
                                                             tmp_path: Path) -> None:
    pidfile = tmp_path / "daemon.pid"
    daemon = script(tmp_path, "daemon.py", f"""
        import os, time
        open({str(pidfile)!r} + ".tmp", "w").write(str(os.getpid()))
        os.replace({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
        time.sleep(600)
    """)
    harness = script(tmp_path, "harness.py", f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, {str(daemon)!r}])
        while not os.path.exists({str(pidfile)!r}):
            time.sleep(0.01)
    """)
    await backend.launch(spec(tmp_path, "leaves", [PY, str(harness)]))
    r = await backend.wait("leaves")
    assert r.exit_code == 0 and not r.timed_out
    assert not process_alive(int(pidfile.read_text()))


async def test_cancel_kills_running_job(backend: JobBackend, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    harness = script(tmp_path, "harness.py", f"""
        import os, subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pidfile)!r} + ".tmp", "w").write(str(p.pid))
        os.replace({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
        time.sleep(600)
    """)
    await backend.launch(spec(tmp_path, "long", [PY, str(harness)], labels={"run": "r1"}))
    while not pidfile.exists():
        await asyncio.sleep(0.02)
    [info] = await backend.list_jobs({"run": "r1"})
    assert info.job_id == "long" and info.state is JobState.RUNNING
    t0 = time.monotonic()
    await backend.cancel("long")
    r = await backend.wait("long")
    assert r.cancelled and not r.timed_out and not r.succeeded
    assert time.monotonic() - t0 < 5
    assert not process_alive(int(pidfile.read_text()))
    [info] = await backend.list_jobs({"run": "r1"})
    assert info.state is JobState.DONE
    await backend.cancel("long")  # cancelling a finished job is a no-op
    assert (await backend.wait("long")).cancelled


async def test_list_filter_cleanup_and_errors(backend: JobBackend, tmp_path: Path) -> None:
    await backend.launch(spec(tmp_path, "a", [PY, "-c", "pass"], labels={"run": "x", "i": "1"}))
    await backend.launch(spec(tmp_path, "b", [PY, "-c", "pass"], labels={"run": "y"}))
    await backend.wait("a")
    await backend.wait("b")
    assert [j.job_id for j in await backend.list_jobs({"run": "x"})] == ["a"]
    assert sorted(j.job_id for j in await backend.list_jobs()) == ["a", "b"]
    with pytest.raises(ValueError):
        await backend.launch(spec(tmp_path, "a", [PY, "-c", "pass"]))
    await backend.cleanup("a")
    assert [j.job_id for j in await backend.list_jobs()] == ["b"]
    with pytest.raises(KeyError):
        await backend.wait("a")
    assert (tmp_path / "jobs" / "a" / "stdout.log").exists()  # files outlive cleanup
    with pytest.raises(ValueError):
        await backend.launch(spec(tmp_path, "bad/id", [PY, "-c", "pass"]))


async def test_many_concurrent_jobs(backend: JobBackend, tmp_path: Path) -> None:
    n = 24
    body = ("import sys, time; t0 = time.time(); time.sleep(1.0); "
            "print(t0, time.time()); sys.exit({i} % 3)")
    for i in range(n):
        await backend.launch(spec(tmp_path, f"job-{i}", [PY, "-c", body.format(i=i)]))
    results = await asyncio.gather(*(backend.wait(f"job-{i}") for i in range(n)))
    spans = []
    for i, r in enumerate(results):
        assert r.exit_code == i % 3 and r.job_id == f"job-{i}"
        start, end = map(float, r.stdout_path.read_text().split())
        spans.append((start, end))
    # the jobs ran side by side: most of them were running at the same moment
    most_at_once = max(sum(1 for s, e in spans if s <= t <= e) for t, _ in spans)
    assert most_at_once >= n // 2, spans
