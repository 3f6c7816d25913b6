"""Local process backend: each job is a process group on this machine.

The job's main process starts in a new session (`start_new_session=True`), so it leads its own
process group and everything it spawns stays in that group. A timeout or a cancel sends
SIGTERM to the whole group, then SIGKILL after `kill_grace_s`; when the main process has
ended (for any reason) whatever is left of the group is killed too, so no grandchild outlives
its job. (An unsandboxed process that leaves the group with `setsid` escapes this; a
sandboxed job's processes end with its pid namespace, whatever group they are in.)

Environment: the controller's own environment without its `HARNESSRL_*` variables (they hold
the controller's config and may hold the credential secret), plus the spec's `env`. A
sandboxed job (`JobSpec.sandbox`) gets the spec's `env` only (and a few basics): its command
runs as `wrapper -> bwrap -> sandbox init -> command` (services/controller/sandbox), with the
wrapper, the job record and the exit file outside the sandbox.

Restart safety: the group's leader is `job_wrapper.py`, which runs the command as its child
and writes how it ended to `<workdir>/.<job_id>.exit.json`; the backend records the group
(`<workdir>/.<job_id>.job.json`: leader pid, its start time, launch time, timeout) before the
job can run long. A controller restarted after a kill -9 `adopt`s the job from that record:
a group still running is supervised again (its timeout counted from the original launch), an
ended one reports the exit status its wrapper wrote. A job is never started twice. A job whose
controller never comes back ends anyway: its wrapper kills its group a few seconds after the
timeout (`--deadline`), so no harness outlives its attempt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

from services.controller.backends.base import JobBackend, JobResult, JobSpec
from services.controller.backends.process_group import group_members, signal_group, start_ticks
from services.controller.sandbox import Sandbox

log = logging.getLogger(__name__)

EXEC_FAILED_EXIT_CODE = 127
_WRAPPER = str(Path(__file__).with_name("job_wrapper.py"))
_POLL_S = 0.1  # how often an adopted job's leader is checked (it is not our child to wait for)


def base_environment() -> dict[str, str]:
    """The controller's environment minus `HARNESSRL_*` (its config, possibly its secret)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HARNESSRL_")}


def parse_cpu_list(text: str) -> set[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8}; every CPU must be one this process may run on."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"CPU list {text!r}: use numbers and ranges, e.g. 2-7,12") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(f"CPU list {text!r}: CPUs {sorted(cpus - allowed) or '(none)'} are "
                         f"not available here (this process may use {sorted(allowed)})")
    return cpus


def _write_json(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, object] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


@dataclass
class _Job:
    spec: JobSpec
    started_at: float
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Future[JobResult] | None = None
    cancel_reason: str = ""

    @property
    def record_path(self) -> Path:
        return Path(self.spec.workdir) / f".{self.spec.job_id}.job.json"

    @property
    def exit_path(self) -> Path:
        return Path(self.spec.workdir) / f".{self.spec.job_id}.exit.json"


class LocalBackend(JobBackend):
    name = "local"

    def __init__(self, kill_grace_s: float = 2.0, base_env: dict[str, str] | None = None,
                 reap_timeout_s: float = 5.0, nice: int = 0, cpus: str = "",
                 sandbox: Sandbox | None = None) -> None:
        """`kill_grace_s`: between SIGTERM and SIGKILL. `base_env`: environment every job
        starts from (default `base_environment()`). `reap_timeout_s`: how long to wait for a
        SIGKILLed group to disappear before reporting the job done anyway (with a warning).
        `nice` / `cpus` (a CPU list such as "2-7,12"): each job runs that much lower in CPU
        priority / on those CPUs only, everything it starts too. `sandbox`: makes the sandbox
        of each job whose spec has one (checked already); None: such jobs are refused."""
        self.kill_grace_s = kill_grace_s
        self._placement = ([f"--nice={nice}"] if nice else []) + (
            [f"--cpus={','.join(map(str, sorted(parse_cpu_list(cpus))))}"] if cpus else [])
        self.base_env = base_environment() if base_env is None else dict(base_env)
        self.reap_timeout_s = reap_timeout_s
        self._jobs: dict[str, _Job] = {}
        self.sandbox = sandbox

    def check_argv(self, argv: list[str], env: dict[str, str]) -> str | None:
        exe = argv[0] if argv else ""
        if not exe:
            return "empty command"
        if "/" in exe and not os.path.isabs(exe):
            return (f"{exe!r} is a relative path, but jobs run in their own working directory: "
                    "give an absolute path")
        path = env.get("PATH", self.base_env.get("PATH", os.defpath))
        if shutil.which(exe, path=path) is None:
            return f"{exe!r} is not an executable file" + ("" if "/" in exe else " on PATH")
        return None

    def _check_spec(self, spec: JobSpec) -> None:
        super()._check_spec(spec)
        if spec.grader is not None:
            raise ValueError("the local backend runs graders as jobs of their own")
        if spec.sandbox is not None and self.sandbox is None:
            raise ValueError("a sandboxed job, but this backend makes no sandbox (the "
                             "controller's sandbox is off)")

    async def launch(self, spec: JobSpec) -> None:
        self._check_spec(spec)
        workdir = Path(spec.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        job = _Job(spec, time.time())
        self._jobs[spec.job_id] = job
        job.exit_path.unlink(missing_ok=True)
        argv, env, flags = list(spec.argv), {**self.base_env, **spec.env}, list(self._placement)
        if spec.sandbox is not None:
            assert self.sandbox is not None
            argv, env, more = await self.sandbox.prepare(spec.job_id, spec.sandbox, argv,
                                                         dict(spec.env))
            flags += more
        deadline = time.monotonic() + spec.timeout_s
        with open(workdir / spec.stdout_name, "wb") as out, \
                open(workdir / spec.stderr_name, "wb") as err:
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-I", "-S", _WRAPPER, str(job.exit_path),
                    f"--deadline={job.started_at + spec.timeout_s + self.kill_grace_s + 5:.3f}",
                    *flags, *argv,
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    cwd=spec.cwd or workdir, env=env, start_new_session=True,
                )
            except OSError as exc:
                reason = f"cannot start the job wrapper: {exc}"
                err.write(f"harnessrl: {reason}\n".encode())
                done: asyncio.Future[JobResult] = asyncio.get_running_loop().create_future()
                done.set_result(self._result(job, EXEC_FAILED_EXIT_CODE, False, False, reason))
                job.task = done
                self._release(spec)
                return
        ticks = start_ticks(proc.pid)
        _write_json(job.record_path, {"pgid": proc.pid, "start_ticks": ticks,
                                      "launched_at": job.started_at,
                                      "timeout_s": spec.timeout_s})
        job.task = asyncio.ensure_future(self._supervise(job, proc.pid, proc.wait(), deadline))

    async def adopt(self, spec: JobSpec) -> bool:
        if self._follows(spec):
            return True
        self._check_spec(spec)
        record = await asyncio.to_thread(_read_json,
                                         Path(spec.workdir) / f".{spec.job_id}.job.json")
        if record is None:
            return False
        job = _Job(spec, float(record["launched_at"]))  # type: ignore[arg-type]
        self._jobs[spec.job_id] = job
        if spec.sandbox is not None and self.sandbox is not None:
            await self.sandbox.reopen(spec.sandbox)
        pgid = int(record["pgid"])  # type: ignore[call-overload]
        left = job.started_at + float(record["timeout_s"]) - time.time()  # type: ignore[arg-type]
        deadline = time.monotonic() + max(0.0, left)
        alive = record.get("start_ticks") is not None and \
            start_ticks(pgid) == record["start_ticks"]
        log.info("job %s: adopted from an earlier controller (%s)", spec.job_id,
                 "still running" if alive else "ended meanwhile")
        job.task = asyncio.ensure_future(self._supervise(
            job, pgid, self._leader_gone(pgid, record.get("start_ticks")) if alive else None,
            deadline))
        return True

    @staticmethod
    async def _leader_gone(pid: int, ticks: object) -> None:
        while start_ticks(pid) == ticks:
            await asyncio.sleep(_POLL_S)

    def _result(self, job: _Job, exit_code: int, timed_out: bool, cancelled: bool,
                error: str = "") -> JobResult:
        spec = job.spec
        return JobResult(
            job_id=spec.job_id, exit_code=exit_code, timed_out=timed_out, cancelled=cancelled,
            stdout_path=Path(spec.workdir) / spec.stdout_name,
            stderr_path=Path(spec.workdir) / spec.stderr_name,
            started_at=job.started_at, finished_at=time.time(), error=error,
        )

    async def _supervise(self, job: _Job, pgid: int, leader_exit: Awaitable[object] | None,
                         deadline: float) -> JobResult:
        """Watches the job's group (led by `pgid`) until nothing of it runs. `leader_exit`
        ends when the leader has: our child's `wait()`, or a poll for an adopted job's leader
        (None: it had ended before we looked)."""
        timed_out = cancelled = False
        if leader_exit is not None:
            exited = asyncio.ensure_future(leader_exit)
            cancelled_ev = asyncio.ensure_future(job.cancel.wait())
            try:
                done, _ = await asyncio.wait(
                    {exited, cancelled_ev}, timeout=max(0.0, deadline - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if exited not in done:
                    cancelled = cancelled_ev in done
                    timed_out = not cancelled
                    log.info("job %s: %s, terminating its process group", job.spec.job_id,
                             "cancelled" if cancelled
                             else f"timed out after {job.spec.timeout_s}s")
                    _write_json(job.record_path, {
                        **(_read_json(job.record_path) or {}),
                        "ended_by": "cancel" if cancelled else "timeout",
                        "cancel_reason": job.cancel_reason})
                    signal_group(pgid, signal.SIGTERM)
                    try:
                        await asyncio.wait_for(asyncio.shield(exited), self.kill_grace_s)
                    except asyncio.TimeoutError:
                        pass
            finally:
                cancelled_ev.cancel()
        else:  # ended while no controller watched: how, the record and the exit file say
            record = _read_json(job.record_path) or {}
            timed_out, cancelled = record.get("ended_by") == "timeout", \
                record.get("ended_by") == "cancel"
            job.cancel_reason = str(record.get("cancel_reason", ""))
        # Whatever is left of the group (the leader past its grace period, or children it
        # left behind) is killed now.
        if signal_group(pgid, signal.SIGKILL):
            await self._wait_group_gone(job.spec.job_id, pgid)
        if leader_exit is not None:
            await exited
        await asyncio.to_thread(self._release, job.spec)
        outcome = _read_json(job.exit_path)
        if outcome is not None:
            return self._result(job, int(outcome["exit_code"]), timed_out,  # type: ignore[call-overload]
                                cancelled, str(outcome.get("error", "")) or job.cancel_reason)
        # The wrapper itself was killed (SIGKILL past the grace period) or vanished unseen.
        error = job.cancel_reason if cancelled else \
            "" if timed_out else "the job ended without recording its exit status"
        return self._result(job, -signal.SIGKILL, timed_out, cancelled, error)

    async def _wait_group_gone(self, job_id: str, pgid: int) -> None:
        deadline = time.monotonic() + self.reap_timeout_s
        while True:
            members = await asyncio.to_thread(group_members, pgid)
            if not members:
                return
            if time.monotonic() > deadline:
                log.warning("job %s: processes %s of its group survive SIGKILL", job_id, members)
                return
            signal_group(pgid, signal.SIGKILL)
            await asyncio.sleep(0.02)


    def _release(self, spec: JobSpec) -> None:
        """Frees the job's sandbox (its cgroup) once nothing of it runs."""
        if spec.sandbox is not None and self.sandbox is not None:
            self.sandbox.release(spec.job_id)

    async def cancel(self, job_id: str, reason: str = "") -> None:
        job = self._jobs.get(job_id)
        if job is None or job.task is None or job.task.done():
            return
        job.cancel_reason = reason
        job.cancel.set()
        await asyncio.shield(job.task)

    async def close(self) -> None:
        """Kills every running job: local jobs do not outlive a controller that stops on
        purpose (after a crash they do, and the next controller adopts them)."""
        await asyncio.gather(*(self.cancel(job_id, "the controller shut down")
                               for job_id in list(self._jobs)))
        if self.sandbox is not None:
            await self.sandbox.close()

    async def cleanup(self, job_id: str) -> None:
        await self.cancel(job_id)
        self._jobs.pop(job_id, None)
