"""Kubernetes job backend: each job is a `batch/v1` Job in the controller's namespace, talked to
through the official `kubernetes` client (kubeconfig or in-cluster service account).

One job, top to bottom (`launch`, then `_supervise`):
  render the Job from the user's template (`k8s_manifests`) -> create it suspended (rate
  limited) -> create its Secret, owned by the Job -> un-suspend it -> follow the Job and its
  pod through two watches (`k8s_watches`) -> the pod ends: save the harness's log (and the
  grader's) into the attempt's workdir -> the result. At the timeout, on cancel, or when the pod cannot start (image pull
  error; unschedulable past `pending_timeout_s`; its Secret missing past `secret_timeout_s`)
  the logs are saved and the Job is deleted with its pods (propagation Background; its Secret
  is garbage-collected). While the API refuses a watch (403: the Role lacks list or watch),
  launch and adopt fail with the API's message.

Restart safety: Job names are deterministic, so `adopt` finds a Job an earlier controller
created (running, suspended before its Secret existed, or finished within its TTL) and
follows it on; `close` leaves running Jobs alone for the next controller to adopt (their
`activeDeadlineSeconds` bounds them meanwhile).

The client library is synchronous: its calls run in worker threads (`asyncio.to_thread`), the
two watches in threads of their own (`k8s_watches`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from aiolimiter import AsyncLimiter
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from services.controller.backends import k8s_manifests as manifests
from services.controller.backends.k8s_api import api_client, why as _why
from services.controller.backends.k8s_watches import JobWatches
from services.controller.backends.base import (GraderOutput, JobBackend, JobResult,
                                               JobSpec)

log = logging.getLogger(__name__)

EXEC_FAILED_EXIT_CODE = 127
_IMAGE_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")


@dataclass(frozen=True)
class KubernetesSettings:
    """The backend's settings (from the controller config's `k8s` section and kill_grace_s)."""
    job_template: dict[str, Any]
    gateway_url: str
    namespace: str = ""  # "" : the service account's namespace in-cluster, else kubeconfig's
    kubeconfig: str = ""  # "" : in-cluster config when running in a pod, else ~/.kube/config
    creates_per_s: float = 10.0
    relist_s: float = 30.0
    pending_timeout_s: float = 300.0
    secret_timeout_s: float = 60.0
    ttl_after_finished_s: int = 3600
    deadline_margin_s: float = 30.0
    kill_grace_s: float = 2.0
    log_limit_bytes: int = 16 * 1024 * 1024


@dataclass
class _Job:
    spec: JobSpec
    name: str
    deadline: float  # unix time of the timeout
    launched_at: float
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_reason: str | None = None
    grading: bool = False  # the harness exited 0 and the grader runs: `deadline` is its
    task: asyncio.Future[JobResult] | None = None


def _ts(value: Any) -> float:
    return value.timestamp() if isinstance(value, datetime) else time.time()


def _condition(obj: Any, kind: str) -> Any:
    for cond in (obj.status.conditions or []) if obj.status else []:
        if cond.type == kind and cond.status == "True":
            return cond
    return None


class KubernetesBackend(JobBackend):
    name = "kubernetes"
    shares_workdir = False
    grades_in_job = True
    merged_output = True

    def __init__(self, settings: KubernetesSettings) -> None:
        manifests.check_template(settings.job_template)
        self.settings = settings
        self.api, default_ns = api_client(settings.kubeconfig)
        self.namespace = settings.namespace or default_ns
        self.batch = k8s.BatchV1Api(self.api)
        self.core = k8s.CoreV1Api(self.api)
        self._limiter = AsyncLimiter(max(settings.creates_per_s, 0.001), 1.0)
        self._jobs: dict[str, _Job] = {}  # job id ->
        self._by_name: dict[str, _Job] = {}  # Job name ->
        # what the API says of the Jobs and pods (its tables: Job name -> V1Job / V1Pod)
        self.watches = JobWatches(self.batch, self.core, self.namespace, settings.relist_s,
                                  self._wake)

    def _wake(self, name: str) -> None:
        """What the API says of Job `name` changed: its job (if ours) looks again."""
        job = self._by_name.get(name)
        if job is not None:
            job.changed.set()

    async def _ensure_watching(self, resume_from: str | None = None) -> None:
        """Starts the watches, once (`JobWatches.start`)."""
        await self.watches.start(resume_from)

    # -- launching ---------------------------------------------------------------------------
    def _render(self, spec: JobSpec) -> dict[str, Any]:
        s = self.settings
        return manifests.render_job(
            s.job_template, spec, namespace=self.namespace, gateway_url=s.gateway_url,
            ttl_after_finished_s=s.ttl_after_finished_s, deadline_margin_s=s.deadline_margin_s,
            termination_grace_s=max(1, math.ceil(s.kill_grace_s)))

    def _register(self, spec: JobSpec, name: str, launched_at: float) -> _Job:
        job = _Job(spec, name, launched_at + spec.timeout_s, launched_at)
        self._jobs[spec.job_id] = job
        self._by_name[name] = job
        Path(spec.workdir).mkdir(parents=True, exist_ok=True)
        return job

    async def launch(self, spec: JobSpec) -> None:
        self._check_spec(spec)
        manifest = self._render(spec)  # TemplateError (a ValueError) for a bad placeholder
        await self._ensure_watching()
        name = manifest["metadata"]["name"]
        job = self._register(spec, name, time.time())
        try:
            async with self._limiter:
                created = await asyncio.to_thread(
                    self.batch.create_namespaced_job, self.namespace, manifest)
            await self._start(job, created.metadata.uid)
        except ApiException as exc:
            self._forget(job)
            if exc.status == 409:
                raise ValueError(f"job {spec.job_id} exists already (Job {name})") from None
            raise
        job.task = asyncio.ensure_future(self._supervise(job))

    async def _start(self, job: _Job, uid: str) -> None:
        """Creates the Job's Secret (if missing), then lets its pod start."""
        secret = manifests.render_secret(job.spec, self._render(job.spec), uid)
        try:
            await asyncio.to_thread(self.core.create_namespaced_secret, self.namespace, secret)
        except ApiException as exc:
            if exc.status != 409:  # 409: an earlier controller created it
                raise
        await asyncio.to_thread(self.batch.patch_namespaced_job, job.name, self.namespace,
                                {"spec": {"suspend": False}})

    async def adopt(self, spec: JobSpec) -> bool:
        if self._follows(spec):
            return True
        self._check_spec(spec)
        await self._ensure_watching()
        name = manifests.job_name(spec.job_id)
        try:
            obj = await asyncio.to_thread(self.batch.read_namespaced_job, name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        job = self._register(spec, name, _ts(obj.metadata.creation_timestamp))
        self.watches.jobs.setdefault(name, obj)
        if obj.spec.suspend:  # its controller died before it started it
            await self._start(job, obj.metadata.uid)
        log.info("job %s: adopted Job %s from an earlier controller", spec.job_id, name)
        job.task = asyncio.ensure_future(self._supervise(job))
        return True

    def _forget(self, job: _Job) -> None:
        self._jobs.pop(job.spec.job_id, None)
        self._by_name.pop(job.name, None)

    # -- following a job ---------------------------------------------------------------------
    async def _supervise(self, job: _Job) -> JobResult:
        pending_since: dict[str, float] = {}
        while True:
            job.changed.clear()
            if job.cancel_reason is not None:
                return await self._end(job, cancelled=True, error=job.cancel_reason)
            if time.time() >= job.deadline:
                if job.grading:
                    return await self._end(job, exit_code=0, grader=GraderOutput(
                        -9, Path(job.spec.workdir) / job.spec.grader.stdout_name,  # type: ignore[union-attr]
                        timed_out=True))
                return await self._end(job, timed_out=True)
            ended = self._ended(job, pending_since)
            if ended is not None:
                return await ended
            wait = min(job.deadline - time.time(), self.settings.relist_s)
            try:
                await asyncio.wait_for(job.changed.wait(), max(0.05, min(wait, 1.0)))
            except asyncio.TimeoutError:
                pass

    def _ended(self, job: _Job, pending_since: dict[str, float]) -> Any:
        """A coroutine giving the job's result when what the API says ends it, else None."""
        obj, pod = self.watches.jobs.get(job.name), self.watches.pods.get(job.name)
        if obj is None and self.watches.synced["jobs"].is_set() and \
                time.time() - job.launched_at > 5.0:
            return self._end(job, exit_code=-1, error=f"Job {job.name} was deleted outside "
                                                      "the controller")
        if pod is not None:
            harness = self._container_status(pod, manifests.HARNESS)
            if pod.status.phase in ("Succeeded", "Failed"):
                return self._finished(job, pod)
            term = harness.state.terminated if harness is not None and harness.state else None
            if term is not None and term.exit_code != 0:
                return self._finished(job, pod)
            if term is not None and job.spec.grader is not None and not job.grading:
                job.grading = True  # the grader's own timeout counts from here
                job.deadline = _ts(term.finished_at) + job.spec.grader.timeout_s
            problem = self._cannot_start(pod, pending_since)
            if problem:
                return self._end(job, exit_code=EXEC_FAILED_EXIT_CODE, error=problem)
        if obj is not None and pod is None:
            failed = _condition(obj, "Failed")
            if failed is not None:
                if failed.reason == "DeadlineExceeded":
                    return self._end(job, timed_out=True)
                return self._end(job, exit_code=-1, error=f"Job failed: {failed.reason}: "
                                                          f"{failed.message}")
            if _condition(obj, "Complete") is not None:  # ended unwatched, pod since gone
                return self._end(job, exit_code=-1, error=f"Job {job.name} completed while "
                                 "no controller watched it, and its pod (with the exit status "
                                 "and log) is gone")
        return None

    @staticmethod
    def _container_status(pod: Any, name: str) -> Any:
        st = pod.status
        for cs in (st.init_container_statuses or []) + (st.container_statuses or []) \
                if st else []:
            if cs.name == name:
                return cs
        return None

    def _cannot_start(self, pod: Any, pending_since: dict[str, float]) -> str:
        """Why the pod cannot start, once that is final (or past its bound); else ""."""
        now = time.time()
        st = pod.status
        if st is None or st.phase != "Pending":
            return ""
        for cs in (st.init_container_statuses or []) + (st.container_statuses or []):
            waiting = cs.state.waiting if cs.state else None
            if waiting is None:
                continue
            if waiting.reason in _IMAGE_ERRORS:
                return f"image {cs.image!r} cannot be pulled: {waiting.reason}: " \
                       f"{waiting.message or ''}".rstrip(": ")
            if waiting.reason == "CreateContainerConfigError":
                since = pending_since.setdefault("config", now)
                if now - since > self.settings.secret_timeout_s:
                    return f"container {cs.name} cannot be created for " \
                           f"{self.settings.secret_timeout_s:g}s: {waiting.message}"
        for cond in st.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False" and \
                    cond.reason == "Unschedulable":
                since = pending_since.setdefault("unschedulable", now)
                if now - since > self.settings.pending_timeout_s:
                    return f"pod unschedulable for {self.settings.pending_timeout_s:g}s: " \
                           f"{cond.message}"
        return ""

    async def _finished(self, job: _Job, pod: Any) -> JobResult:
        """The pod ended: the harness's exit status (and the grader's), with their logs."""
        harness = self._container_status(pod, manifests.HARNESS)
        term = harness.state.terminated if harness is not None and harness.state else None
        await self._save_logs(job, pod)
        if term is None:
            return self._result(job, -1, error=f"pod {pod.metadata.name} ended "
                                                 f"({pod.status.phase}) without its harness")
        error = ""
        exit_code = int(term.exit_code)
        if term.reason == "StartError" or exit_code == 128 and term.reason != "Error":
            exit_code, error = EXEC_FAILED_EXIT_CODE, \
                f"cannot execute {job.spec.argv[0]!r}: {term.message or term.reason}"
            with open(Path(job.spec.workdir) / job.spec.stdout_name, "a") as f:
                f.write(f"harnessrl: {error}\n")
        grader = None
        if job.spec.grader is not None and exit_code == 0:
            gs = self._container_status(pod, manifests.GRADER)
            gterm = gs.state.terminated if gs is not None and gs.state else None
            if gterm is not None:
                grader = GraderOutput(int(gterm.exit_code),
                                      Path(job.spec.workdir) / job.spec.grader.stdout_name)
        return self._result(job, exit_code, error=error, grader=grader)

    async def _save_logs(self, job: _Job, pod: Any) -> None:
        spec = job.spec
        targets = [(manifests.HARNESS, spec.stdout_name)]
        if spec.grader is not None:
            targets.append((manifests.GRADER, spec.grader.stdout_name))
        for container, fname in targets:
            path = Path(spec.workdir) / fname
            try:
                text = await asyncio.to_thread(
                    self.core.read_namespaced_pod_log, pod.metadata.name, self.namespace,
                    container=container, limit_bytes=self.settings.log_limit_bytes)
            except ApiException as exc:  # not started, or gone already
                text = "" if exc.status in (400, 404) else \
                    f"harnessrl: log of {container} not read: {_why(exc)}\n"
            await asyncio.to_thread(path.write_text, text or "")

    async def _end(self, job: _Job, *, timed_out: bool = False, cancelled: bool = False,
                   exit_code: int = -9, error: str = "",
                   grader: GraderOutput | None = None) -> JobResult:
        """Ends the job from our side: its logs saved, the Job deleted with its pods."""
        pod = self.watches.pods.get(job.name)
        if pod is not None:
            await self._save_logs(job, pod)
        else:
            Path(job.spec.workdir, job.spec.stdout_name).touch()
        if timed_out:
            log.info("job %s: timed out after %gs; deleting Job %s", job.spec.job_id,
                     job.spec.timeout_s, job.name)
        await self._delete(job.name)
        await self._wait_pod_gone(job)
        return self._result(job, exit_code, timed_out=timed_out, cancelled=cancelled,
                            error=error, grader=grader)

    async def _delete(self, name: str) -> None:
        try:
            await asyncio.to_thread(
                self.batch.delete_namespaced_job, name, self.namespace,
                body=k8s.V1DeleteOptions(propagation_policy="Background"))
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def _wait_pod_gone(self, job: _Job) -> None:
        """Waits (bounded) until the Job's pod is gone: nothing of the job runs then."""
        bound = time.monotonic() + self.settings.kill_grace_s + 30.0
        while job.name in self.watches.pods and time.monotonic() < bound:
            job.changed.clear()
            try:
                await asyncio.wait_for(job.changed.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        if job.name in self.watches.pods:
            log.warning("job %s: pod of Job %s still there after deletion", job.spec.job_id,
                        job.name)

    def _result(self, job: _Job, exit_code: int, *, timed_out: bool = False,
                cancelled: bool = False, error: str = "",
                grader: GraderOutput | None = None) -> JobResult:
        path = Path(job.spec.workdir) / job.spec.stdout_name
        return JobResult(job_id=job.spec.job_id, exit_code=exit_code, timed_out=timed_out,
                         cancelled=cancelled, stdout_path=path, stderr_path=path,
                         started_at=job.launched_at, finished_at=time.time(), error=error,
                         grader=grader)

    # -- the interface's other verbs ---------------------------------------------------------

    async def cancel(self, job_id: str, reason: str = "") -> None:
        job = self._jobs.get(job_id)
        if job is None or job.task is None or job.task.done():
            return
        job.cancel_reason = reason or "cancelled"
        job.changed.set()
        await asyncio.shield(job.task)

    async def cleanup(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is None:
            return
        await self.cancel(job_id, "cleaned up")
        await self._delete(job.name)
        self._forget(job)

    async def close(self) -> None:
        """Leaves running Jobs to the next controller (it adopts them); stops watching."""
        running = [j.spec.job_id for j in self._jobs.values()
                   if j.task is not None and not j.task.done()]
        if running:
            log.info("leaving %d running Job(s) for the next controller to adopt",
                     len(running))
        for job in self._jobs.values():
            if job.task is not None and not job.task.done():
                job.task.cancel()
        self.watches.stop()
        await asyncio.to_thread(self.api.close)
