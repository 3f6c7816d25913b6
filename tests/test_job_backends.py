"""Conformance suite of the job-backend interface (`services.controller.backends.base`).

Every backend runs the same tests: add it to `BACKENDS` (a name and a factory taking the test's
tmp dir and the fixtures it needs) and it is held to the same contract. The local backend runs
real process groups; the Kubernetes backend runs against its test double, a fake API server in
its own process (`harnessrl.testing.fake_kube`) that runs each pod's containers as local
processes, driven through the real `kubernetes` client and a kubeconfig.

Where the backends differ by design, the tests say so through the backend's own flags: a pod's
working directory is its own, not the controller's (`shares_workdir`), and a container log
holds stdout and stderr together (`merged_output`).
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
from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings

PY = sys.executable
K8S_IMAGE = "harnessrl/harness:dev"  # an image the fake API server's node "has"
K8S_TEMPLATE = {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
    "containers": [{"name": "harness", "image": K8S_IMAGE}]}}}}


def kubernetes_backend(kubeconfig: str, template: dict | None = None,  # type: ignore[type-arg]
                       **kw: object) -> KubernetesBackend:
    settings = dict(job_template=template or K8S_TEMPLATE, gateway_url="http://127.0.0.1:9/v1",
                    kubeconfig=kubeconfig, creates_per_s=200.0, relist_s=5.0, kill_grace_s=0.5)
    settings.update(kw)
    return KubernetesBackend(KubernetesSettings(**settings))  # type: ignore[arg-type]


BACKENDS: dict[str, Callable[[pytest.FixtureRequest], JobBackend]] = {
    "local": lambda request: LocalBackend(kill_grace_s=0.5),
    "kubernetes": lambda request: kubernetes_backend(
        request.getfixturevalue("fake_kube").kubeconfig),
}


REQUEST: list[pytest.FixtureRequest] = []  # the current test's, for a second instance


@pytest.fixture(params=sorted(BACKENDS))
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[JobBackend]:
    REQUEST[:] = [request]
    b = BACKENDS[request.param](request)
    yield b
    for info in await b.list_jobs():
        await b.cleanup(info.job_id)
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
    if backend.merged_output:  # one container log
        assert r.stdout_path == r.stderr_path
        assert sorted(r.stdout_path.read_text().splitlines()) == ["to-err", "to-out"]
    else:
        assert r.stdout_path.read_text() == "to-out\n"
        assert r.stderr_path.read_text() == "to-err\n"
    assert r.stdout_path.parent == s.workdir
    assert r.started_at <= r.finished_at


async def test_failure_exit_code(backend: JobBackend, tmp_path: Path) -> None:
    await backend.launch(spec(tmp_path, "fail", [PY, "-c", "import sys; sys.exit(3)"]))
    r = await backend.wait("fail")
    assert r.exit_code == 3 and not r.succeeded and not r.timed_out


async def test_env_and_workdir_visible(backend: JobBackend, tmp_path: Path) -> None:
    s = spec(tmp_path, "env", [PY, "-c", textwrap.dedent("""
        import json, os
        print(json.dumps({"cwd": os.getcwd(), "a": os.environ.get("JOB_A"),
                          "b": os.environ.get("JOB_B"), "found": sorted(os.listdir(".")),
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
    assert (out["a"], out["b"]) == ("alpha", "b e t a")
    assert out["secret"] is None
    if backend.shares_workdir:
        assert Path(out["cwd"]).resolve() == s.workdir.resolve()
        assert (s.workdir / "made-here.txt").exists()
    else:  # a pod starts in a fresh, empty directory of its own
        assert Path(out["cwd"]).resolve() != s.workdir.resolve()
        assert out["found"] == [] and not (s.workdir / "made-here.txt").exists()


async def test_unexecutable_command_is_a_failed_job(backend: JobBackend, tmp_path: Path) -> None:
    await backend.launch(spec(tmp_path, "nope", [str(tmp_path / "no-such-program")]))
    r = await backend.wait("nope")
    assert r.exit_code == 127 and not r.succeeded
    assert "no-such-program" in r.error
    assert "no-such-program" in r.stderr_path.read_text()


async def test_adopted_after_the_controller_died(backend: JobBackend, tmp_path: Path) -> None:
    """A new backend instance (the restarted controller's) adopts a job the first one
    launched and then lost track of (kill -9): running ones are followed to their end, ended
    ones report their exit status; a job never launched is not found."""
    marker = tmp_path / "go"
    body = ("import os, sys, time\n"
            f"while not os.path.exists({str(marker)!r}): time.sleep(0.02)\n"
            "print('finished'); sys.exit(int(sys.argv[1]))")
    specs = {name: spec(tmp_path, name, [PY, "-c", body, code], timeout_s=60)
             for name, code in (("runs-on", "4"), ("ends-unseen", "5"))}
    for s in specs.values():
        await backend.launch(s)
    for job in backend._jobs.values():  # type: ignore[attr-defined]
        job.task.cancel()  # the controller is gone: nothing watches the jobs any more
    successor = BACKENDS[backend.name](REQUEST[0])
    try:
        assert not await successor.adopt(spec(tmp_path, "never", [PY, "-c", "pass"]))
        marker.write_text("")
        await asyncio.sleep(1.0)  # "ends-unseen" ends now, with no backend following it
        assert await successor.adopt(specs["ends-unseen"])
        assert await successor.adopt(specs["runs-on"])
        for name, code in (("runs-on", 4), ("ends-unseen", 5)):
            r = await successor.wait(name)
            assert r.exit_code == code and not r.timed_out and not r.cancelled, r
            assert "finished" in r.stdout_path.read_text()
    finally:
        for name in specs:
            await successor.cleanup(name)
        await successor.close()


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
    body = ("import sys, time; t0 = time.time(); time.sleep(2.0); "
            "print(t0, time.time()); sys.exit({i} % 3)")
    await asyncio.gather(*(backend.launch(spec(tmp_path, f"job-{i}", [PY, "-c", body.format(i=i)]))
                           for i in range(n)))  # as the controller does: side by side
    results = await asyncio.gather(*(backend.wait(f"job-{i}") for i in range(n)))
    spans = []
    for i, r in enumerate(results):
        assert r.exit_code == i % 3 and r.job_id == f"job-{i}"
        start, end = map(float, r.stdout_path.read_text().split())
        spans.append((start, end))
    # the jobs ran side by side: most of them were running at the same moment
    most_at_once = max(sum(1 for s, e in spans if s <= t <= e) for t, _ in spans)
    assert most_at_once >= n // 2, spans


# -- Kubernetes only: what a pod can run into, and what the API server is sent -------------
def k8s_template(**container: object) -> dict:  # type: ignore[type-arg]
    return {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
        "containers": [{"name": "harness", "image": K8S_IMAGE, **container}]}}}}


@pytest.fixture
async def k8s(fake_kube) -> AsyncIterator[Callable[..., KubernetesBackend]]:  # type: ignore[no-untyped-def]
    made: list[KubernetesBackend] = []

    def make(template: dict | None = None, **kw: object) -> KubernetesBackend:  # type: ignore[type-arg]
        made.append(kubernetes_backend(fake_kube.kubeconfig, template, **kw))
        return made[-1]
    yield make
    for b in made:
        for info in await b.list_jobs():
            await b.cleanup(info.job_id)
        await b.close()


@pytest.mark.parametrize("template, settings, reason", [
    (k8s_template(image="registry.example.com/does-not-exist:1"), {}, "cannot be pulled"),
    (k8s_template(resources={"requests": {"cpu": "512"}}), {"pending_timeout_s": 1.0},
     "unschedulable"),
    (k8s_template(envFrom=[{"secretRef": {"name": "never-created"}}]),
     {"secret_timeout_s": 1.0}, "never-created"),
], ids=["image-pull", "unschedulable", "secret-missing"])
async def test_pod_that_cannot_start_ends_the_job_with_the_reason(
        k8s, tmp_path: Path, template: dict, settings: dict,  # type: ignore[no-untyped-def,type-arg]
        reason: str) -> None:
    b = k8s(template, **settings)
    t0 = time.monotonic()
    await b.launch(spec(tmp_path, "stuck", [PY, "-c", "pass"], timeout_s=60))
    r = await b.wait("stuck")
    assert r.exit_code == 127 and not r.succeeded and reason in r.error, r
    assert time.monotonic() - t0 < 20
    assert not await kube_jobs(b)  # the Job was deleted


async def kube_jobs(b: KubernetesBackend) -> list[str]:
    jobs = await asyncio.to_thread(b.batch.list_namespaced_job, b.namespace,
                                   label_selector="app.kubernetes.io/managed-by=harnessrl")
    return [j.metadata.name for j in jobs.items]


async def test_timeout_deletes_the_job_and_keeps_its_log(k8s, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = k8s()
    await b.launch(spec(tmp_path, "slow", [PY, "-c", "import time; print('started', flush=True);"
                                           " time.sleep(600)"], timeout_s=2.0))
    r = await b.wait("slow")
    assert r.timed_out and not r.succeeded
    assert "started" in r.stdout_path.read_text()  # the log was saved before the deletion
    assert not await kube_jobs(b)


async def test_credential_only_in_the_secret_and_grader_in_the_pod(
        k8s, fake_kube, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from services.controller.backends import GraderStep

    token = "hrl1.credential-under-test-0123456789"
    harness = ("import hashlib, os; print('key seen:', hashlib.sha256("
               "os.environ['OPENAI_API_KEY'].encode()).hexdigest()); "
               "open('answer.txt', 'w').write('42')")
    grader = "print('graded'); print(open('answer.txt').read())"
    b = k8s()
    s = JobSpec(job_id="cred", argv=[PY, "-c", harness],
                env={"OPENAI_API_KEY": token, "OPENAI_BASE_URL": "http://x/v1"},
                workdir=tmp_path / "cred", timeout_s=60,
                grader=GraderStep(argv=[PY, "-c", grader], env={}))
    await b.launch(s)
    r = await b.wait("cred")
    assert r.succeeded, r
    import hashlib
    assert f"key seen: {hashlib.sha256(token.encode()).hexdigest()}" in \
        r.stdout_path.read_text()
    assert r.grader is not None and r.grader.exit_code == 0
    assert r.grader.stdout_path.read_text().split() == ["graded", "42"]
    sent = fake_kube.requests()
    jobs = [q for q in sent if q["path"].endswith("/jobs") and q["method"] == "POST"]
    secrets = [q for q in sent if q["path"].endswith("/secrets") and q["method"] == "POST"]
    assert len(jobs) >= 1 and len(secrets) >= 1
    for q in sent:
        if "/secrets" not in q["path"]:
            assert token not in json.dumps(q), q["path"]
    pods = await asyncio.to_thread(b.core.list_namespaced_pod, b.namespace)
    assert token not in json.dumps(b.api.sanitize_for_serialization(pods))


async def test_watch_recovers_from_410_gone(k8s, fake_kube, tmp_path: Path,  # type: ignore[no-untyped-def]
                                            caplog: pytest.LogCaptureFixture) -> None:
    """A watch resumed from a resourceVersion the API server has compacted away (as after a
    broken connection) gets 410 Gone: the backend lists afresh and follows its jobs on."""
    caplog.set_level("INFO", logger="services.controller.backends.kubernetes")
    b = k8s(relist_s=600.0)
    stale = str(fake_kube.stats()["resourceVersion"])
    await b.launch(spec(tmp_path, "before", [PY, "-c", "pass"]))  # moves the history on
    await b.wait("before")
    fake_kube.compact()
    successor = k8s(relist_s=600.0)
    await successor._ensure_watching(resume_from=stale)
    await successor.launch(spec(tmp_path, "w", [PY, "-c", "print('ok')"], timeout_s=60))
    r = await asyncio.wait_for(successor.wait("w"), 30)
    assert r.exit_code == 0 and "ok" in r.stdout_path.read_text()
    assert "410 Gone" in caplog.text


async def test_job_creation_is_rate_limited(k8s, fake_kube, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = k8s(creates_per_s=4.0)
    names = [f"burst-{i}" for i in range(8)]
    await asyncio.gather(*(b.launch(spec(tmp_path, n, [PY, "-c", "pass"])) for n in names))
    await asyncio.gather(*(b.wait(n) for n in names))
    times = sorted(q["time"] for q in fake_kube.requests()
                   if q["method"] == "POST" and q["path"].endswith("/jobs") and
                   q["body"]["metadata"]["annotations"]["harnessrl.dev/job-id"] in names)
    assert len(times) == 8
    # a leaky bucket of 4 per second: the first 4 at once, the next 4 over about a second
    assert times[-1] - times[0] >= 0.7, times


async def test_local_jobs_run_at_the_configured_priority_and_cpus(tmp_path: Path) -> None:
    """`local_job_nice` / `local_job_cpus`: the harness and what it starts run lower in CPU
    priority and on those CPUs only (the engine's and trainer's cores left to them)."""
    import os

    from services.controller.backends.local import parse_cpu_list

    cpu = max(os.sched_getaffinity(0))
    base_nice = os.nice(0)
    b = LocalBackend(kill_grace_s=0.5, nice=7, cpus=str(cpu))
    probe = ("import os, subprocess, sys; print(os.nice(0), sorted(os.sched_getaffinity(0))); "
             "subprocess.run([sys.executable, '-c', 'import os; print(os.nice(0), "
             "sorted(os.sched_getaffinity(0)))'])")
    await b.launch(spec(tmp_path, "placed", [PY, "-c", probe]))
    r = await b.wait("placed")
    assert r.succeeded, r.stderr_path.read_text()
    want = f"{min(base_nice + 7, 19)} [{cpu}]"
    assert r.stdout_path.read_text().splitlines() == [want, want]  # the job and its child
    await b.close()
    plain = LocalBackend(kill_grace_s=0.5)
    await plain.launch(spec(tmp_path, "plain", [PY, "-c", probe]))
    r = await plain.wait("plain")
    assert r.stdout_path.read_text().splitlines()[0].split()[0] == str(base_nice)
    await plain.close()
    assert parse_cpu_list("0") == {0}
    with pytest.raises(ValueError, match="use numbers and ranges"):
        parse_cpu_list("a-b")
    with pytest.raises(ValueError, match="not available here"):
        parse_cpu_list("4096")
