"""The job-backend interface: how the controller launches a harness (or grader) run.

A backend runs one *job* from a `JobSpec` (argv, environment, working directory, timeout,
labels) and reports its `JobResult` (exit code, whether it timed out or was cancelled, where
its stdout/stderr lie). Implementations: `local` (a process group on this machine) and
`kubernetes` (one `batch/v1` Job per spec). Every implementation passes the conformance suite
in `tests/test_job_backends.py`.

Contract every backend keeps:
- `launch` returns once the job was submitted; the timeout counts from then.
- `wait` returns the job's result once it ended and nothing of it runs any more (for the local
  backend: its whole process group is gone); it may be awaited by several callers.
- A job past `timeout_s` is killed (everything it started, not only its main process) and
  reported with `timed_out=True`.
- `cancel` kills a running job; its result has `cancelled=True`. Cancelling a finished or
  unknown job is a no-op.
- stdout and stderr of the job end up in the files named by `JobResult.stdout_path` and
  `stderr_path` (for Kubernetes: copied from the pod's log once it ends).
- A job that cannot start at all (no such executable, image pull failure) is a finished job
  with `exit_code` 127 and `error` saying why, not an exception: the caller treats it like a
  crash of the program.
- Restart safety: jobs outlive a controller that is killed (kill -9). A new controller calls
  `adopt(spec)` with the spec it would launch: when the backend finds that job (still running,
  or ended while nobody watched), it takes it over and `wait` reports its result as if it had
  launched it; when it finds none, the job was never launched and the caller launches it.
  So a job is launched once, whatever the restarts.
- A backend whose jobs run apart from the controller's file system (`shares_workdir` False:
  Kubernetes) runs the grader inside the job, after the harness (`JobSpec.grader`,
  `grades_in_job` True); its output comes back in `JobResult.grader`.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.controller.sandbox.policy import SandboxPolicy

_JOB_ID = re.compile(r"^[A-Za-z0-9._-]{1,200}$")  # JobSpec.job_id's form

@dataclass(frozen=True)
class JobSpec:
    job_id: str  # unique among the backend's jobs; [A-Za-z0-9._-], at most 200 characters
    argv: list[str]
    env: dict[str, str]  # environment the job gets on top of the backend's base environment
    workdir: Path  # working directory; also where stdout/stderr files are kept
    timeout_s: float  # wall clock from launch; then the job is killed and reported timed out
    labels: dict[str, str] = field(default_factory=dict)  # run/rollout/attempt ids, for listing
    stdout_name: str = "stdout.log"  # file name of the captured stdout inside `workdir`
    stderr_name: str = "stderr.log"
    # Backends with `grades_in_job`: a grader to run after the job's command exited 0, in the
    # same working directory (`timeout_s` stays the command's; the grader has its own).
    grader: "GraderStep | None" = None
    # The folder the command runs in (default `workdir`). A sandboxed job's is its work folder
    # below `workdir`, so that its records (`workdir`) are out of its reach.
    cwd: Path | None = None
    # Local backend: run the command in this sandbox (services/controller/sandbox); None:
    # unsandboxed, with the backend's base environment.
    sandbox: "SandboxPolicy | None" = None


@dataclass(frozen=True)
class GraderStep:
    argv: list[str]
    env: dict[str, str]  # the grader's whole job environment (replaces JobSpec.env for it)
    timeout_s: float = 60.0  # from the moment the job's command ended
    stdout_name: str = "grader.stdout.log"


@dataclass(frozen=True)
class GraderOutput:
    exit_code: int
    stdout_path: Path  # on Kubernetes: the grader container's log (stdout and stderr merged)
    timed_out: bool = False  # killed at its timeout (then exit_code is negative)


class JobState(enum.Enum):
    RUNNING = "running"
    DONE = "done"


@dataclass(frozen=True)
class JobResult:
    job_id: str
    exit_code: int  # the main process's exit status; negative: killed by that signal number
    timed_out: bool
    cancelled: bool
    stdout_path: Path
    stderr_path: Path
    started_at: float  # unix seconds
    finished_at: float
    error: str = ""  # why the job could not run, or was ended (then exit_code is 127 or <0)
    grader: GraderOutput | None = None  # JobSpec.grader's outcome, when it ran

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.cancelled


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: JobState
    labels: dict[str, str]


class JobBackend(abc.ABC):
    """Runs jobs. All methods are coroutines on the controller's event loop."""

    name: str
    # False where jobs run on another file system (a pod): files they write in their working
    # directory stay there, and the grader must run inside the job (`grades_in_job`).
    shares_workdir: bool = True
    grades_in_job: bool = False
    # True where stdout and stderr come back as one log (Kubernetes container logs): both
    # result paths then name the same file.
    merged_output: bool = False

    @abc.abstractmethod
    async def launch(self, spec: JobSpec) -> None:
        """Submits a job; raises `ValueError` for a spec it cannot accept (duplicate job_id)."""

    async def wait(self, job_id: str) -> JobResult:
        """The job's result once it has ended; raises `KeyError` for an unknown job. (Here: a
        backend that follows each job with one task in `_jobs`, as every one so far does.)"""
        return await self._wait_tracked(job_id)

    @abc.abstractmethod
    async def cancel(self, job_id: str, reason: str = "") -> None:
        """Kills a running job (its `wait` then reports `cancelled`, with `reason` as its
        `error`); no-op when not running."""

    async def list_jobs(self, labels: dict[str, str] | None = None) -> list[JobInfo]:
        """Jobs the backend knows of (not yet cleaned up) whose labels include `labels`.
        (Here: from `_jobs`, as `wait`.)"""
        return self._list_tracked(labels)

    @abc.abstractmethod
    async def cleanup(self, job_id: str) -> None:
        """Forgets a finished job and frees what the backend holds for it (a Kubernetes Job
        object, say); its stdout/stderr files stay. Cancels it first when still running."""

    async def adopt(self, spec: JobSpec) -> bool:
        """Takes over the job an earlier controller launched from `spec`, if there is one
        (running or ended); True when found (`wait` then reports it), False when that job was
        never launched. See the module docstring."""
        return False

    def _follows(self, spec: JobSpec) -> bool:
        """Whether this backend follows `spec`'s job already. A run resumed in this process
        (its execution stopped: its store was gone too long) finds the jobs it launched still
        followed here: adopting one is then taking it as it is (`wait` reports it). One whose
        launch was cut short (no task follows it yet) is forgotten, to be adopted anew."""
        job = self._jobs.get(spec.job_id)
        if job is not None and getattr(job, "task", None) is None:
            del self._jobs[spec.job_id]
            return False
        return job is not None

    def _check_spec(self, spec: JobSpec) -> None:
        """Raises `ValueError` for a spec that no backend launches or adopts: a job id not of
        `JobSpec.job_id`'s form or one it follows already, an empty argv, a timeout not above
        0. A backend extends it with what it cannot run."""
        if not _JOB_ID.match(spec.job_id):
            raise ValueError(f"invalid job id {spec.job_id!r}: use [A-Za-z0-9._-], 1-200 chars")
        if spec.job_id in self._jobs:
            raise ValueError(f"job {spec.job_id} exists already")
        if not spec.argv:
            raise ValueError("empty argv")
        if not spec.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {spec.timeout_s}")

    def check_argv(self, argv: list[str], env: dict[str, str]) -> str | None:
        """Why `argv` (with `env`) cannot run on this backend, or None; lets a run with a typo
        in its command be refused up front. Backends that cannot tell return None."""
        return None

    # -- bookkeeping shared by backends that follow each job with one asyncio task, kept in
    # `self._jobs[job_id]` (an object with `spec: JobSpec` and `task: Future[JobResult]`)
    _jobs: dict[str, Any]

    def _job(self, job_id: str) -> Any:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise KeyError(f"unknown job {job_id}") from None

    async def _wait_tracked(self, job_id: str) -> JobResult:
        job = self._job(job_id)
        assert job.task is not None
        return await asyncio.shield(job.task)  # type: ignore[no-any-return]

    def _list_tracked(self, labels: dict[str, str] | None) -> list[JobInfo]:
        want = labels or {}
        return [JobInfo(job_id, JobState.DONE if job.task is not None and job.task.done()
                        else JobState.RUNNING, dict(job.spec.labels))
                for job_id, job in self._jobs.items()
                if all(job.spec.labels.get(k) == v for k, v in want.items())]

    async def close(self) -> None:
        """Controller shutdown: kills every running job (a backend whose jobs a next
        controller adopts may leave them running instead, and says so)."""
        for info in await self.list_jobs():
            if info.state is JobState.RUNNING:
                await self.cancel(info.job_id, "the controller shut down")
