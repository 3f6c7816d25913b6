"""Rollout isolation in Compose (issue 41), its mechanism: the docker job backend
(`services/controller/backends/docker.py`) through the rollout gate (`services/gate`), on the
test's real Docker daemon and the example harness image. The red-team harness as a rollout of
a running Compose project is `tests/test_compose_real.py`'s
`test_the_redteam_harness_as_a_rollout_container` (it runs on that module's stack).

The gate first: the backend's own calls go through, and each way out of a rollout container
that a compromised controller could ask for (privileged, a bind mount of /, the host's
network, another image, an added capability, no limits, a container that is not a rollout's,
an unfiltered listing) is refused with its reason; the same requests sent to the daemon
directly are accepted, so each refusal is the gate's.

Then the backend's contract, as the conformance suite holds the others to it: exit status and
output, the environment and a fresh workspace with the task file, an unexecutable command,
the timeout, cancel, the grader after the harness in a fresh container of the same workspace,
adoption by a second backend after the first is gone (kill -9 of a controller), and cleanup
leaving no container or volume behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from harnessrl import procs
from services.controller.backends.base import GraderStep, JobSpec
from services.controller.backends.docker import DockerBackend, DockerSettings
from services.controller.backends.docker_api import DockerAPI, DockerError

pytestmark = [pytest.mark.containers, pytest.mark.timeout(600)]
MANAGED = "harnessrl.managed-by=harnessrl"


@contextlib.contextmanager
def _gate(folder: Path, daemon_socket: str, image: str, uids: list[int]) -> Iterator[str]:
    sock = folder / "docker.sock"
    proc = procs.ServiceProcess("gate", procs.python_module(
        "services.gate", "--listen", str(sock), "--docker-socket", daemon_socket, "--images",
        json.dumps([image]), "--allowed-uids", json.dumps(uids), "--ready-file",
        str(folder / "ready.json")), folder, ready_file=folder / "ready.json").start()
    try:
        proc.wait_ready(30)
        yield str(sock)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def gate(docker_daemon: Any, example_image: str, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[str, str]]:
    """A gate process for the example image (no network) that lets this test's user call:
    (its socket, the daemon's)."""
    daemon_socket = docker_daemon.env["DOCKER_HOST"].removeprefix("unix://")
    with _gate(tmp_path_factory.mktemp("gate"), daemon_socket, example_image,
               [os.getuid()]) as sock:
        yield sock, daemon_socket


async def test_the_gate_answers_its_allowed_users_alone(gate: tuple[str, str],
                                                        example_image: str,
                                                        tmp_path: Path) -> None:
    with _gate(tmp_path, gate[1], example_image, [os.getuid() + 1]) as other:
        api = DockerAPI(other)
        try:
            with pytest.raises(DockerError, match=f"uid {os.getuid()} may not call"):
                await api.ping()
        finally:
            await api.close()
    api = DockerAPI(gate[0])
    await api.ping()
    await api.close()


def _docker(daemon_socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", "-H", f"unix://{daemon_socket}", *args],
                          capture_output=True, text=True, timeout=60)


def _rollout_body(image: str, **host: Any) -> dict[str, Any]:
    return {"Image": image, "Cmd": ["true"], "Labels": {"harnessrl.managed-by": "harnessrl"},
            "HostConfig": {"NetworkMode": "none", "ReadonlyRootfs": True, "CapDrop": ["ALL"],
                           "SecurityOpt": ["no-new-privileges"], "Memory": 64 << 20,
                           "PidsLimit": 64, "NanoCpus": 10**9, **host}}


async def test_the_gate_refuses_every_way_out(gate: tuple[str, str], example_image: str
                                              ) -> None:
    via_gate, direct = DockerAPI(gate[0]), DockerAPI(gate[1])
    try:
        await via_gate.create("hrl-gate-ok", _rollout_body(example_image))  # the allowed shape
        await via_gate.remove("hrl-gate-ok")
        cases: dict[str, dict[str, Any]] = {
            "privileged": _rollout_body(example_image, Privileged=True),
            "bind mount of /": _rollout_body(example_image, Binds=["/:/host"]),
            "host network": _rollout_body(example_image, NetworkMode="host"),
            "added capability": _rollout_body(example_image, CapAdd=["SYS_ADMIN"]),
            "no seccomp": _rollout_body(example_image, SecurityOpt=[
                "no-new-privileges", "seccomp=unconfined"]),
            "no memory limit": _rollout_body(example_image, Memory=0),
            "writable root": _rollout_body(example_image, ReadonlyRootfs=False),
            "host pid namespace": _rollout_body(example_image, PidMode="host"),
            "mount of another volume": _rollout_body(example_image, Mounts=[
                {"Type": "volume", "Source": "pki", "Target": "/workspace"}]),
            "another image": {**_rollout_body(example_image), "Image": "harnessrl/store:0.1.0"},
        }
        refused = {}
        for what, body in cases.items():
            try:
                with pytest.raises(DockerError) as err:
                    await via_gate.create("hrl-gate-bad", body)
                refused[what] = (err.value.status, str(err.value))
                # the daemon itself takes it: the refusal is the gate's
                await direct.create("hrl-gate-bad", body)
            finally:
                await direct.remove("hrl-gate-bad")
        assert {w: s for w, (s, _) in refused.items()} == {w: 403 for w in cases}, refused
        assert all("harnessrl gate" in m for _, m in refused.values()), refused
        # a volume of the right name that the gate did not make (no label), or none at all
        for volume in ("hrl-foreign", "hrl-missing"):
            if volume == "hrl-foreign":
                await direct.create_volume(volume, {})
            try:
                with pytest.raises(DockerError, match="not a rollout's|not made through"):
                    await via_gate.create("hrl-gate-bad", _rollout_body(example_image, Mounts=[
                        {"Type": "volume", "Source": volume, "Target": "/workspace"}]))
            finally:
                await direct.remove("hrl-gate-bad")
                await direct.remove_volume(volume)
        # a container that is not a rollout's: no call on it goes through
        await direct.create("not-a-rollout", {"Image": example_image, "Cmd": ["true"]})
        try:
            for call in (via_gate.start, via_gate.kill, via_gate.remove, via_gate.inspect):
                with pytest.raises(DockerError, match="not a rollout's"):
                    await call("not-a-rollout")
            assert await direct.inspect("not-a-rollout") is not None
        finally:
            await direct.remove("not-a-rollout")
        with pytest.raises(DockerError, match="managed label"):
            await via_gate._call("GET", "/containers/json", params={"all": "true"})
        # a seed (writable root) may be created but never started
        seed = _rollout_body(example_image, ReadonlyRootfs=False)
        await via_gate.create("hrl-gate-seed", seed)
        try:
            with pytest.raises(DockerError, match="writable root"):
                await via_gate.start("hrl-gate-seed")
        finally:
            await via_gate.remove("hrl-gate-seed")
    finally:
        await via_gate.close()
        await direct.close()


@pytest.fixture
async def backend(gate: tuple[str, str], example_image: str) -> AsyncIterator[DockerBackend]:
    b = DockerBackend(DockerSettings(socket=gate[0], image=example_image, network="none",
                                     gateway_url="http://gateway:8080/v1", memory_mb=256,
                                     pids_limit=64, cpus=1.0))
    yield b
    for info in await b.list_jobs():
        await b.cleanup(info.job_id)
    await b.close()


def _spec(tmp_path: Path, job_id: str, code: str, timeout_s: float = 60.0,
          grader: str | None = None, env: dict[str, str] | None = None) -> JobSpec:
    workdir = tmp_path / job_id
    workdir.mkdir(parents=True)
    return JobSpec(job_id=job_id, argv=["python", "-c", code], workdir=workdir,
                   timeout_s=timeout_s, labels={"run": "r1"},
                   env={"HARNESSRL_TASK_JSON": '{"q": 7}', "OPENAI_API_KEY": "the-key",
                        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1", **(env or {})},
                   grader=GraderStep(argv=["python", "-c", grader], env={}, timeout_s=30)
                   if grader else None)


def _leftovers(daemon_socket: str) -> list[str]:
    ps = _docker(daemon_socket, "ps", "-aq", "--filter", f"label={MANAGED}").stdout.split()
    vols = _docker(daemon_socket, "volume", "ls", "-q", "--filter",
                   f"label={MANAGED}").stdout.split()
    return ps + vols


async def test_a_job_its_output_environment_workspace_and_grader(
        backend: DockerBackend, gate: tuple[str, str], tmp_path: Path) -> None:
    # a job id of JobSpec.job_id's form, as the controller makes them (run.hash.role+attempt)
    s = _spec(tmp_path, "r1.t.0.h1", """
import json, os, socket, sys
print(json.dumps({"cwd": os.getcwd(), "found": os.listdir("."), "uid": os.getuid(),
                  "task": open(os.environ["HARNESSRL_TASK_FILE"]).read(),
                  "base": os.environ["OPENAI_BASE_URL"], "key": os.environ["OPENAI_API_KEY"]}))
print("to-err", file=sys.stderr)
open("answer.txt", "w").write("42")
try:
    open(os.environ["HARNESSRL_TASK_FILE"], "w").write("forged")
    print("task writable")
except OSError:
    pass
if not os.statvfs(os.path.dirname(os.environ["HARNESSRL_TASK_FILE"])).f_flag & os.ST_RDONLY:
    print("task mount writable")
if not os.statvfs("/").f_flag & os.ST_RDONLY:
    print("root writable")
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2)
    print("network reached")
except OSError:
    pass
""", grader="import os; print(open('answer.txt').read(), open(os.environ['HARNESSRL_TASK_FILE']).read())")
    await backend.launch(s)
    r = await backend.wait(s.job_id)
    assert r.exit_code == 0 and r.succeeded, (r, r.stderr_path.read_text())
    out, *rest = r.stdout_path.read_text().splitlines()
    seen = json.loads(out)
    assert seen == {"cwd": "/workspace", "found": [], "uid": 10001, "task": '{"q": 7}',
                    "base": "http://gateway:8080/v1", "key": "the-key"}
    assert rest == [], "the task file was writable or the network reachable: " + str(rest)
    assert r.stderr_path.read_text() == "to-err\n"
    assert r.grader is not None and r.grader.exit_code == 0
    assert r.grader.stdout_path.read_text() == '42 {"q": 7}\n'
    await backend.cleanup(s.job_id)
    assert _leftovers(gate[1]) == []


async def test_failure_unexecutable_timeout_and_cancel(backend: DockerBackend,
                                                       tmp_path: Path) -> None:
    fail = _spec(tmp_path, "fail", "import sys; sys.exit(3)")
    nope = JobSpec(job_id="nope", argv=["/no-such-program"], env={}, workdir=tmp_path,
                   timeout_s=30)
    slow = _spec(tmp_path, "slow", "import time; time.sleep(300)", timeout_s=3)
    cancelled = _spec(tmp_path, "cancelled", "import time; time.sleep(300)")
    for s in (fail, nope, slow, cancelled):
        await backend.launch(s)
    t0 = time.monotonic()
    await asyncio.sleep(1)
    await backend.cancel("cancelled", "run cancelled")
    results = {s.job_id: await backend.wait(s.job_id) for s in (fail, nope, slow, cancelled)}
    assert results["fail"].exit_code == 3 and not results["fail"].timed_out
    assert results["nope"].exit_code == 127 and "no-such-program" in results["nope"].error
    assert "no-such-program" in results["nope"].stderr_path.read_text()
    assert results["slow"].timed_out and not results["slow"].succeeded
    assert results["cancelled"].cancelled and results["cancelled"].error == "run cancelled"
    assert time.monotonic() - t0 < 60


async def test_a_second_controller_adopts_the_job(gate: tuple[str, str], example_image: str,
                                                  tmp_path: Path) -> None:
    """A job survives its backend (the controller's kill -9): a new backend adopts it by its
    spec, follows it to its end with the grader, and knows a never-launched job as such."""
    settings = DockerSettings(socket=gate[0], image=example_image, network="none",
                              gateway_url="http://gateway:8080/v1")
    first = DockerBackend(settings)
    s = _spec(tmp_path, "adopt", "import time; time.sleep(3); print('done')", grader="print(1)")
    await first.launch(s)
    await asyncio.sleep(1)
    first._jobs["adopt"].task.cancel()  # type: ignore[union-attr]  # (its follower dies)
    await first.api.close()
    second = DockerBackend(settings)
    try:
        assert await second.adopt(s)
        r = await second.wait("adopt")
        assert r.exit_code == 0 and r.stdout_path.read_text() == "done\n"
        assert r.grader is not None and r.grader.stdout_path.read_text() == "1\n"
        never = _spec(tmp_path, "never", "print(1)")
        assert not await second.adopt(never)
        await second.cleanup("adopt")
        assert _leftovers(gate[1]) == []
    finally:
        await second.close()
