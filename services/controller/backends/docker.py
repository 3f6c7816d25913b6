"""Docker job backend: each job is a container beside the controller's, created through the
Docker Engine API. In Compose that API is the rollout gate's (`services/gate`), which lets
through only containers of this shape.

One job, top to bottom (`launch`, then `_supervise`):
  two volumes of its own (`<name>-ws`, the workspace; `<name>-task`, the task file, written
  through a container that never starts) -> the harness container `<name>-h` (its argv,
  `/workspace` writable, `/var/run/harnessrl/task.json` read-only, the rollout network only,
  read-only root, no capabilities, no new privileges, memory/pids/CPU limits) -> wait for it
  (killed at the timeout or on cancel) -> its stdout and stderr saved into the attempt's
  folder -> with a grader (`JobSpec.grader`) and exit 0: the grader container `<name>-g`, the
  same workspace, its own timeout, its output saved too -> the result. `cleanup` removes the
  containers and both volumes.

As on Kubernetes (`shares_workdir` False, `grades_in_job` True), the job's files stay in its
workspace, the task comes as a file and `HARNESSRL_TASK_JSON`, and no identity reaches the
harness. Unlike a pod, stdout and stderr stay apart, and the grader starts in a fresh
container once the harness's is gone, so nothing the harness left running meets it.

Restart safety: container names are deterministic (`k8s_manifests.job_name`), and each
container carries its deadline as a label, so `adopt` finds the job an earlier controller
launched (running, or ended meanwhile: Docker keeps an exited container and its exit status
until `cleanup`) and follows it on; `close` leaves running containers to the next controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.controller.backends.base import (GraderOutput, JobBackend, JobResult,
                                               JobSpec)
from services.controller.backends.docker_api import DockerAPI, DockerError
from services.controller.backends.k8s_manifests import GRADER, HARNESS, REFUSED_ENV, job_name

log = logging.getLogger(__name__)

EXEC_FAILED_EXIT_CODE = 127
MANAGED = "harnessrl.managed-by=harnessrl"  # the label every container and volume carries
LABEL_PREFIX = "harnessrl."
WORKSPACE, TASK_DIR = "/workspace", "/var/run/harnessrl"


@dataclass(frozen=True)
class DockerSettings:
    """The backend's settings (the controller's `docker_*` config fields)."""
    socket: str  # the Docker API's Unix socket: in Compose the rollout gate's
    image: str  # what harness and grader containers run
    network: str  # the network they join ("none": none at all)
    gateway_url: str  # OPENAI_BASE_URL as rollout containers reach the gateway
    memory_mb: int = 2048  # per container
    pids_limit: int = 512  # per container (a fork bomb stays in its own)
    cpus: float = 1.0  # per container
    log_limit_bytes: int = 16 * 1024 * 1024  # of each output file


@dataclass
class _Job:
    spec: JobSpec
    name: str
    launched_at: float
    deadline: float  # unix time of the harness's timeout
    cancel_reason: str | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Future[JobResult] | None = None


def _env(role: str, env: dict[str, str]) -> list[str]:
    refused = sorted(set(REFUSED_ENV[role]) & set(env))
    if refused:
        raise ValueError(f"the {role} container of a job may not get {', '.join(refused)}")
    env = {**env, "HARNESSRL_WORKDIR": WORKSPACE, "HARNESSRL_TASK_FILE": f"{TASK_DIR}/task.json"}
    return [f"{k}={v}" for k, v in env.items()]


class DockerBackend(JobBackend):
    name = "docker"
    shares_workdir = False
    grades_in_job = True

    def __init__(self, settings: DockerSettings) -> None:
        self.settings = settings
        self.api = DockerAPI(settings.socket)
        self._jobs: dict[str, _Job] = {}

    # -- what a container is -----------------------------------------------------------------
    def _labels(self, job: _Job, role: str, deadline: float) -> dict[str, str]:
        return {"harnessrl.managed-by": "harnessrl", "harnessrl.role": role,
                "harnessrl.job-id": job.spec.job_id, "harnessrl.deadline": f"{deadline:.3f}",
                **{LABEL_PREFIX + "label." + k: v for k, v in job.spec.labels.items()}}

    def _host(self, network: str, mounts: list[dict[str, Any]]) -> dict[str, Any]:
        """What every container of a job is held to (the gate's `policy` checks it)."""
        s = self.settings
        return {"NetworkMode": network, "ReadonlyRootfs": True, "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges"], "Memory": s.memory_mb * 1024 * 1024,
                "MemorySwap": s.memory_mb * 1024 * 1024,  # (no swap on top)
                "PidsLimit": s.pids_limit, "NanoCpus": int(s.cpus * 1e9), "Mounts": mounts}

    def _config(self, job: _Job, role: str, argv: list[str], env: dict[str, str],
                deadline: float) -> dict[str, Any]:
        return {
            "Image": self.settings.image, "Cmd": list(argv), "Env": _env(role, env),
            "WorkingDir": WORKSPACE, "Labels": self._labels(job, role, deadline),
            "HostConfig": {**self._host(self.settings.network, self._mounts(job)),
                           "Init": True, "Tmpfs": {"/tmp": "size=256m"}},
        }

    @staticmethod
    def _mounts(job: _Job, task_writable: bool = False) -> list[dict[str, Any]]:
        # NoCopy: Docker would copy the image's folder (its mode too) onto a volume it sees
        # empty, undoing the workspace's mode.
        return [{"Type": "volume", "Source": f"{job.name}-ws", "Target": WORKSPACE,
                 "VolumeOptions": {"NoCopy": True}},
                {"Type": "volume", "Source": f"{job.name}-task", "Target": TASK_DIR,
                 "ReadOnly": not task_writable, "VolumeOptions": {"NoCopy": True}}]

    def _check_spec(self, spec: JobSpec) -> None:
        super()._check_spec(spec)
        if spec.sandbox is not None:
            raise ValueError("the docker backend's jobs are containers: no sandbox policy")
        _env(HARNESS, spec.env)
        if spec.grader is not None:
            _env(GRADER, spec.grader.env)

    # -- launching and adopting --------------------------------------------------------------
    async def launch(self, spec: JobSpec) -> None:
        self._check_spec(spec)
        now = time.time()
        job = _Job(spec, job_name(spec.job_id), now, now + spec.timeout_s)
        self._jobs[spec.job_id] = job
        try:
            await self._prepare(job)
        except DockerError as exc:
            job.task = asyncio.ensure_future(self._cannot_start(job, str(exc)))
            return
        job.task = asyncio.ensure_future(self._supervise(job))

    async def _prepare(self, job: _Job) -> None:
        """The job's volumes, the task file in its own, the harness container (created)."""
        labels = {"harnessrl.managed-by": "harnessrl", "harnessrl.job-id": job.spec.job_id}
        for volume in (f"{job.name}-ws", f"{job.name}-task"):
            await self.api.create_volume(volume, labels)
        seed = f"{job.name}-seed"
        await self.api.remove(seed)  # (left by a controller that died here)
        await self.api.create(seed, {  # never started: the job's files go in through it
            "Image": self.settings.image, "Cmd": ["true"], "Labels": labels,
            "HostConfig": {**self._host("none", self._mounts(job, task_writable=True)),
                           "ReadonlyRootfs": False}})  # (Docker writes archives only so)
        try:  # the workspace writable by the image's user, whoever it is (as an emptyDir)
            await self.api.put_archive(seed, [
                (WORKSPACE.lstrip("/"), None, 0o777),
                (f"{TASK_DIR.lstrip('/')}/task.json",
                 job.spec.env.get("HARNESSRL_TASK_JSON", "{}").encode(), 0o444)])
        finally:
            await self.api.remove(seed)
        env = {**job.spec.env, "OPENAI_BASE_URL": self.settings.gateway_url} \
            if "OPENAI_BASE_URL" in job.spec.env else dict(job.spec.env)
        await self.api.create(f"{job.name}-h",
                              self._config(job, HARNESS, job.spec.argv, env, job.deadline))

    async def adopt(self, spec: JobSpec) -> bool:
        if self._follows(spec):
            return True
        self._check_spec(spec)
        name = job_name(spec.job_id)
        info = await self.api.inspect(f"{name}-h")
        if info is None:
            return False
        labels = info["Config"]["Labels"] or {}
        deadline = float(labels.get("harnessrl.deadline", 0))
        job = _Job(spec, name, deadline - spec.timeout_s, deadline)
        self._jobs[spec.job_id] = job
        log.info("job %s: adopted from an earlier controller (container %s-h %s)",
                 spec.job_id, name, info["State"]["Status"])
        job.task = asyncio.ensure_future(self._supervise(job))
        return True

    # -- following a job ---------------------------------------------------------------------
    async def _supervise(self, job: _Job) -> JobResult:
        spec = job.spec
        code, why = await self._run(job, f"{job.name}-h", job.deadline)
        await self._save_logs(f"{job.name}-h", spec.workdir, spec.stdout_name, spec.stderr_name)
        if why == "cancelled":
            return self._result(job, -9, cancelled=True, error=job.cancel_reason or "")
        if why == "timed out":
            log.info("job %s: timed out after %gs", spec.job_id, spec.timeout_s)
            return self._result(job, -9, timed_out=True)
        if why:
            return await self._cannot_start(job, why)
        if code == EXEC_FAILED_EXIT_CODE:  # docker-init (tini) could not exec the command
            tail = Path(spec.workdir, spec.stderr_name).read_text(errors="replace")[-500:]
            if "[FATAL tini" in tail:
                return self._result(job, code, error=tail.strip().splitlines()[-1])
        if code != 0 or spec.grader is None:
            return self._result(job, code)
        g = spec.grader
        gname = f"{job.name}-g"
        info = await self.api.inspect(gname)
        if info is None:
            gdeadline = time.time() + g.timeout_s
            try:
                await self.api.create(gname, self._config(job, GRADER, g.argv, g.env, gdeadline))
            except DockerError as exc:
                return await self._cannot_start(job, f"grader: {exc}")
        else:
            gdeadline = float((info["Config"]["Labels"] or {}).get("harnessrl.deadline", 0))
        gcode, gwhy = await self._run(job, gname, gdeadline)
        await self._save_logs(gname, spec.workdir, g.stdout_name,
                              g.stdout_name.replace("stdout", "stderr", 1)
                              if "stdout" in g.stdout_name else g.stdout_name + ".stderr")
        if gwhy == "cancelled":
            return self._result(job, -9, cancelled=True, error=job.cancel_reason or "")
        out = Path(spec.workdir) / g.stdout_name
        if gwhy == "timed out":
            return self._result(job, 0, grader=GraderOutput(-9, out, timed_out=True))
        if gwhy:
            return self._result(job, 0, grader=GraderOutput(EXEC_FAILED_EXIT_CODE, out),
                                error=f"grader: {gwhy}")
        return self._result(job, 0, grader=GraderOutput(gcode, out))

    async def _run(self, job: _Job, name: str, deadline: float) -> tuple[int, str]:
        """Starts container `name` (unless it ran already) and waits for its end: (exit
        status, "") or (-9, "timed out" / "cancelled") or (127, why it could not start)."""
        info = await self.api.inspect(name)
        if info is None:
            return -1, f"container {name} is gone (removed outside the controller)"
        if info["State"]["Status"] == "created":
            try:
                await self.api.start(name)
            except DockerError as exc:
                return EXEC_FAILED_EXIT_CODE, f"cannot start {name}: {exc}"
        waiting = asyncio.ensure_future(self.api.wait(name))
        cancelled = asyncio.ensure_future(job.cancelled.wait())
        try:
            await asyncio.wait({waiting, cancelled}, timeout=max(0.0, deadline - time.time()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if waiting.done():
            try:
                return waiting.result(), ""
            except DockerError as exc:
                return -1, f"container {name} could not be followed: {exc}"
        await self.api.kill(name)
        with contextlib.suppress(DockerError):
            await waiting  # nothing of it runs any more
        return -9, "cancelled" if job.cancelled.is_set() else "timed out"

    async def _save_logs(self, name: str, folder: Path, out_name: str, err_name: str) -> None:
        try:
            out, err = await self.api.logs(name, self.settings.log_limit_bytes)
        except DockerError as exc:
            out, err = b"", f"harnessrl: log of {name} not read: {exc}\n".encode()
        await asyncio.to_thread(Path(folder, out_name).write_bytes, out)
        await asyncio.to_thread(Path(folder, err_name).write_bytes, err)

    async def _cannot_start(self, job: _Job, why: str) -> JobResult:
        log.warning("job %s cannot run: %s", job.spec.job_id, why)
        with open(Path(job.spec.workdir) / job.spec.stderr_name, "a") as f:
            f.write(f"harnessrl: {why}\n")
        Path(job.spec.workdir, job.spec.stdout_name).touch()
        return self._result(job, EXEC_FAILED_EXIT_CODE, error=why)

    def _result(self, job: _Job, exit_code: int, *, timed_out: bool = False,
                cancelled: bool = False, error: str = "",
                grader: GraderOutput | None = None) -> JobResult:
        spec = job.spec
        return JobResult(job_id=spec.job_id, exit_code=exit_code, timed_out=timed_out,
                         cancelled=cancelled, stdout_path=Path(spec.workdir) / spec.stdout_name,
                         stderr_path=Path(spec.workdir) / spec.stderr_name,
                         started_at=job.launched_at, finished_at=time.time(), error=error,
                         grader=grader)

    # -- the interface's other verbs ---------------------------------------------------------
    async def cancel(self, job_id: str, reason: str = "") -> None:
        job = self._jobs.get(job_id)
        if job is None or job.task is None or job.task.done():
            return
        job.cancel_reason = reason or "cancelled"
        job.cancelled.set()
        with contextlib.suppress(Exception):
            await asyncio.shield(job.task)

    async def cleanup(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is None:
            return
        await self.cancel(job_id, "cleaned up")
        for container in (f"{job.name}-h", f"{job.name}-g", f"{job.name}-seed"):
            await self.api.remove(container)
        for volume in (f"{job.name}-ws", f"{job.name}-task"):
            await self.api.remove_volume(volume)
        del self._jobs[job_id]

    async def close(self) -> None:
        """Leaves running containers to the next controller (it adopts them)."""
        for job in self._jobs.values():
            if job.task is not None and not job.task.done():
                job.task.cancel()
        await self.api.close()

