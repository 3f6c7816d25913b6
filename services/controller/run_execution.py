"""Executes one run: its rollouts, each over up to `max_attempts` attempts, at most
`concurrency` at once.

One attempt, top to bottom (`RunExecution._attempt`):
  mint a credential for (rollout, attempt) -> StartAttempt in the store -> launch the harness
  job with the task and the credential in its environment -> wait (timeout kills its process
  group) -> crashed or timed out: FinishAttempt FAILED (will_retry while attempts remain; the
  next attempt gets a new credential) -> else grade -> FinishAttempt SUCCEEDED with the
  reward (a tampered one's: `tampered_rewards`), or FAILED with the grader's failure (not
  retried: see `grading`). On a backend whose jobs run apart from this machine's files
  (Kubernetes) the grader runs inside the harness's job, after it; its output comes back.

Restart safety: a run resumed after its controller died (kill -9) finds attempts the store
holds as RUNNING. Each is picked up where it was: the backend adopts its job (still running,
or ended meanwhile) by the same deterministic job id, and the attempt goes on from there
(grading included); only a job that was never launched is launched now. No attempt's job is
launched twice, and no result that still exists is thrown away.

The store is the record: every transition is written there first, and the run's `Run` record
(status, counts, mean reward) is kept current with PutRun. Store calls survive a store restart
(`store_calls.ResilientStore`); a store gone for longer than the bound fails the run loudly,
its running jobs left to the backend: CreateRun resumes it (in this controller they are still
followed, and taken as they are). A rollout that hits an unexpected error is failed on its own, with the
error as its reason; other rollouts go on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.credentials import CredentialSigner
from harnessrl.errors import HarnessRLError
from harnessrl.statuses import TERMINAL
from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb, store_pb2 as spb
from services.controller import grading, metrics, run_summary, tampered_rewards
from services.controller.group_grading import GroupGrader
from services.controller.admission import Admission, started_and_done_groups
from services.controller.attempt_jobs import AttemptJobs
from services.controller.backends import GraderStep, JobBackend, JobResult, JobSpec
from services.controller.config import ControllerConfig
from services.controller.grader_access import GraderAccess
from services.controller.run_events import RunEvents
from services.controller.store_calls import ResilientStore, StoreUnavailable

log = logging.getLogger("harnessrl.controller")


@dataclass
class RunContext:
    """What every run of a controller shares."""
    cfg: ControllerConfig
    store: ResilientStore
    backends: dict[str, JobBackend]
    signer: CredentialSigner
    job_slots: asyncio.Semaphore  # harness runs at once over all runs (cfg.max_jobs)
    graders: GraderAccess  # what a grader job may read of the store
    task_files: set[str] = field(default_factory=set)  # every run's: hidden from sandboxes


def group_id_of(run_id: str, task_id: str) -> str:
    return f"{run_id}/{task_id}"


def rollout_id_of(run_id: str, task_id: str, index: int) -> str:
    return f"{run_id}/{task_id}/{index}"


class RunExecution:
    def __init__(self, run: c.Run, tasks: list[c.Task], ctx: RunContext) -> None:
        self.run = run
        self.spec = run.spec
        self.tasks = {t.task_id: t for t in tasks}
        self.ctx = ctx
        self.backend = ctx.backends[self.spec.backend]
        if self.spec.tasks_file:
            ctx.task_files.add(str(Path(self.spec.tasks_file).resolve()))
        self.jobs = AttemptJobs(run, self.tasks, ctx.cfg, self.backend, ctx.task_files)
        self.rollouts: dict[str, c.Rollout] = {ro.rollout_id: ro for ro in self._planned()}
        for ro in self.rollouts.values():
            metrics.rollout_state_changed(None, ro.status)
        self.cancelled = False
        self.done = asyncio.Event()
        self.taken_over = asyncio.Event()  # set once the jobs a dead controller left are adopted
        self._to_take_over: set[str] = set()
        self._cancel_ev = asyncio.Event()
        self._run_slots = asyncio.Semaphore(self.spec.concurrency)
        self._jobs: dict[str, str] = {}  # rollout_id -> id of its running job
        self.events = RunEvents()
        self._run_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._extra = {"run": run.run_id}
        self.admission = Admission(run.run_id, self.spec.admission_max_staleness,
                                   self.spec.admission_batch_groups) \
            if self.spec.admission_batch_groups > 0 else None
        self.group_grader = GroupGrader(self.spec, ctx.store, Path(ctx.cfg.workdir_root).resolve()
                                        / run.run_id, ctx.graders) \
            if self.spec.group_grader_command else None
        self._group_rids = {group_id_of(run.run_id, t): [rollout_id_of(run.run_id, t, i) for i in
                            range(self.spec.group_size)] for t in self.tasks}  # (as _planned)
        self._group_ended = {g: asyncio.Event() for g in self._group_rids} \
            if self.group_grader else {}
        self._grade_slots = asyncio.Semaphore(self.spec.concurrency)  # group graders at once

    # -- the run's rollouts and its record ---------------------------------------------------
    def _planned(self) -> list[c.Rollout]:
        s = self.spec
        return [
            c.Rollout(rollout_id=rollout_id_of(self.run.run_id, t.task_id, i),
                      run_id=self.run.run_id, task_id=t.task_id,
                      group_id=group_id_of(self.run.run_id, t.task_id), index_in_group=i,
                      group_size=s.group_size, max_attempts=s.max_attempts,
                      task_json=t.data_json, stream=s.stream,
                      status=c.ROLLOUT_STATUS_PENDING, group_grading=c.GROUP_GRADING_WAITING
                      if s.group_grader_command else c.GROUP_GRADING_NONE)
            for t in self.tasks.values() for i in range(s.group_size)
        ]

    def uncount(self) -> None:
        """Takes this execution's rollouts out of the rollouts-by-state metric (replaced)."""
        for ro in self.rollouts.values():
            metrics.rollout_state_changed(ro.status, None)

    def snapshot(self) -> c.Run:
        return run_summary.summary(self.run, self.rollouts.values())

    async def _save_run(self, retry_s: float | None = None) -> None:
        async with self._run_lock:  # one writer at a time, each writing the newest state
            await self.ctx.store.put_run(self.snapshot(), retry_s=retry_s)

    async def prepare(self, retry_s: float) -> None:
        """Stores the run record and its rollouts (idempotent: existing ones are kept)."""
        await self.ctx.store.put_run(self.snapshot(), retry_s=retry_s)
        planned = list(self.rollouts.values())
        for i in range(0, len(planned), 500):
            await self.ctx.store.create_rollouts(planned[i:i + 500], retry_s=retry_s)

    async def _changed(self, ro: c.Rollout) -> None:
        """Records a rollout's new state (as the store returned it) and tells the watchers."""
        old = self.rollouts.get(ro.rollout_id)
        metrics.rollout_state_changed(old.status if old is not None else None, ro.status)
        if ro.tampered and not (old is not None and old.tampered):
            metrics.TAMPERED.labels(tampered_rewards.policy_name(self.spec)).inc()
        self.rollouts[ro.rollout_id] = ro
        self.events.publish(cpb.RunEvent(kind=cpb.RunEvent.KIND_ROLLOUT, rollout=ro))
        if ro.status in TERMINAL and (self.admission or self._group_ended) and all(
                self.rollouts[r].status in TERMINAL for r in self._group_rids[ro.group_id]):
            if self.admission is not None:
                self.admission.group_done(ro.group_id)
            self._group_ended.get(ro.group_id, asyncio.Event()).set()  # (a group grader)
        if ro.status in TERMINAL:
            run_summary.log_finished(ro, self.snapshot(), self._extra)
        await self._save_run()

    # -- running -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._execute(), name=f"run {self.run.run_id}")

    async def _execute(self) -> None:
        log.info("run started: %d tasks x %d, concurrency %d, backend %s",
                 len(self.tasks), self.spec.group_size, self.spec.concurrency,
                 self.spec.backend, extra=self._extra)
        if self.backend.shares_workdir and not self.jobs.sandboxed:
            log.warning("run %s: its harnesses run UNSANDBOXED (%s): they can read the "
                        "controller's secret and files and reach every service", self.run.run_id,
                        "the run's sandbox.disabled" if self.spec.sandbox.disabled
                        else "the controller's --sandbox false", extra=self._extra)
        try:
            # The store's view wins: a resumed run continues where the store says it is.
            for ro in await self.ctx.store.list_rollouts(self.run.run_id):
                if ro.rollout_id in self.rollouts:
                    metrics.rollout_state_changed(self.rollouts[ro.rollout_id].status, ro.status)
                    self.rollouts[ro.rollout_id] = ro
            started, done = started_and_done_groups(self.rollouts.values())
            if self.admission is not None:
                self.admission.restore(started, done)
            for gid in done & self._group_ended.keys():  # ended before a restart: grade now
                self._group_ended[gid].set()
            await self._save_run()
            # Attempts a dead controller left running go first: their jobs may be running.
            todo = sorted((rid for rid, ro in self.rollouts.items() if ro.status not in TERMINAL),
                          key=lambda rid: not _attempt_running(self.rollouts[rid]))
            self._to_take_over = {rid for rid in todo if _attempt_running(self.rollouts[rid])}
            self._took_over()
            try:
                async with asyncio.TaskGroup() as rollouts:  # one error stops them all
                    rollouts.create_task(self._rollouts(todo))
                    for gid in self._group_ended:  # (a group grader) each group's, once it ends
                        rollouts.create_task(self._grade_group(gid))
            except BaseExceptionGroup as group:
                raise group.exceptions[0] from None
            self.run.status = c.RUN_STATUS_CANCELLED if self.cancelled \
                else c.RUN_STATUS_SUCCEEDED
        except asyncio.CancelledError:
            log.warning("run interrupted (controller stopping); its rollouts stay as they are "
                        "in the store, CreateRun with this run_id resumes it", extra=self._extra)
            raise
        except Exception as exc:  # noqa: BLE001 - the run fails with the reason
            log.error("run FAILED: %s", exc, extra=self._extra,
                      exc_info=not isinstance(exc, StoreUnavailable))
            self.run.status = c.RUN_STATUS_FAILED
            self.run.error = str(exc)
        self.run.finished_at = time.time()
        try:
            await self._save_run(retry_s=self.ctx.cfg.store_retry_s)
        except StoreUnavailable as exc:
            log.error("final run record not stored: %s", exc, extra=self._extra)
        run = self.snapshot()
        log.info("run %s: %d succeeded, %d failed, %d cancelled of %d, mean reward %.3f",
                 c.RunStatus.Name(run.status), run.num_succeeded, run.num_failed,
                 run.num_cancelled, run.num_rollouts, run.mean_reward, extra=self._extra)
        self.taken_over.set()
        self.done.set()
        self.events.publish(cpb.RunEvent(kind=cpb.RunEvent.KIND_RUN_DONE, run=run))

    async def abort(self) -> None:
        """Stops executing (controller shutdown): jobs are killed, the store left as it is."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def cancel(self) -> None:
        """Cancels the run: running jobs are killed, rollouts not finished become CANCELLED."""
        if self.done.is_set() or self.cancelled:
            return
        log.info("cancelling run", extra=self._extra)
        self.cancelled = True
        self._cancel_ev.set()
        await asyncio.gather(*(self.backend.cancel(j, "run cancelled")
                               for j in list(self._jobs.values())))

    async def _unless_cancelled(self, aw: Awaitable[object]) -> bool:
        """Awaits `aw` unless the run is cancelled first (then `aw` is cancelled): whether
        `aw` completed."""
        task = asyncio.ensure_future(aw)
        cancel = asyncio.ensure_future(self._cancel_ev.wait())
        try:
            await asyncio.wait({task, cancel}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancel.cancel()
            if not task.done():
                task.cancel()
        return task.done() and not task.cancelled()

    async def _acquire(self, sem: asyncio.Semaphore) -> bool:
        """Takes a slot of `sem`, or returns False when the run is cancelled first."""
        got = not self.cancelled and await self._unless_cancelled(sem.acquire())
        if got and self.cancelled:  # acquired, but the run was cancelled meanwhile
            sem.release()
        return got and not self.cancelled

    async def _admitted(self, rid: str) -> bool:
        """Waits until the rollout's group is admitted (`admission`); False when the run is
        cancelled first."""
        return self.admission is None or (await self._unless_cancelled(
            self.admission.admit(self.rollouts[rid].group_id)) and not self.cancelled)

    async def _rollout(self, rid: str) -> None:
        try:
            if not await self._admitted(rid) or not await self._acquire(self._run_slots):
                await self._cancel_in_store(rid)
                return
            try:
                if not await self._acquire(self.ctx.job_slots):
                    await self._cancel_in_store(rid)
                    return
                try:
                    if _attempt_running(self.rollouts[rid]):  # left running by a dead controller
                        await self._attempt(rid, self.rollouts[rid].attempt, resumed=True)
                    while self.rollouts[rid].status not in TERMINAL:
                        if self.cancelled:
                            await self._cancel_in_store(rid)
                            return
                        await self._attempt(rid, self.rollouts[rid].attempt + 1)
                finally:
                    self.ctx.job_slots.release()
            finally:
                self._run_slots.release()
        except (StoreUnavailable, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - this rollout fails alone, with the reason
            log.exception("rollout %s: controller error", rid,
                          extra={**self._extra, "rollout": rid})
            ro = self.rollouts[rid]
            if ro.status not in TERMINAL:
                try:
                    await self._finish(rid, ro.attempt, c.ROLLOUT_STATUS_FAILED,
                                       error=f"controller error: {type(exc).__name__}: {exc}",
                                       may_retry=False)
                except HarnessRLError as exc2:
                    if isinstance(exc2, StoreUnavailable):
                        raise
                    log.error("rollout %s: could not record its failure: %s", rid, exc2,
                              extra={**self._extra, "rollout": rid})
        finally:
            self._took_over(rid)

    def _took_over(self, rid: str = "") -> None:
        """Rollout `rid`'s job left by a dead controller is adopted (its door open again)."""
        self._to_take_over.discard(rid)
        if not self._to_take_over:
            self.taken_over.set()

    async def _rollouts(self, rids: list[str]) -> None:
        try:  # one error cancels the rest: none goes on beside a resumed run's
            async with asyncio.TaskGroup() as group:
                for rid in rids:
                    group.create_task(self._rollout(rid))
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None
        for ended in self._group_ended.values():  # (a rollout left unended: a verdict still)
            ended.set()

    async def _grade_group(self, gid: str) -> None:
        """Runs the group grader once every rollout of the group has ended (group_grading);
        an error of the controller's own fails the group with it, not the run."""
        assert self.group_grader is not None
        await self._group_ended[gid].wait()
        task = self.tasks[self.rollouts[self._group_rids[gid][0]].task_id]
        async with self._grade_slots:
            try:
                job = asyncio.ensure_future(self.group_grader.settle(gid, task, self.cancelled))
                if self.cancelled or await self._unless_cancelled(job):  # (cancelled before:
                    graded = await job  # settle fails the group itself)
                else:  # cancelled while its grader ran: killed, then the group fails
                    await asyncio.gather(job, return_exceptions=True)
                    graded = await self.group_grader.fail(gid, "run cancelled while its grader ran")
            except (StoreUnavailable, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - the group fails alone, with the reason
                log.exception("group %s: grading failed", gid, extra=self._extra)
                try:
                    graded = await self.group_grader.fail(gid, f"controller error: {exc!r}"[:500])
                except HarnessRLError as exc2:  # (StoreUnavailable is one: the run fails)
                    if isinstance(exc2, StoreUnavailable):
                        raise
                    log.error("group %s: its failure not recorded: %s", gid, exc2)
                    return
        for ro in graded:
            await self._changed(ro)

    async def _finish(self, rid: str, attempt: int, status: int, *,
                      grade: grading.Grade | None = None, error: str = "", exit_code: int = 0,
                      timed_out: bool = False, may_retry: bool = True) -> None:
        will_retry = (status == c.ROLLOUT_STATUS_FAILED and may_retry and not self.cancelled
                      and attempt < self.spec.max_attempts)
        req = spb.FinishAttemptRequest(
            rollout_id=rid, attempt=attempt, status=status,  # type: ignore[arg-type]
            error=error, exit_code=exit_code, timed_out=timed_out, will_retry=will_retry)
        if grade is not None:
            grade = tampered_rewards.applied(grade, self.spec,
                                             {**self._extra, "rollout": rid, "attempt": attempt})
        ro = await self.ctx.store.finish_attempt(grade.into(req) if grade else req)
        if status == c.ROLLOUT_STATUS_FAILED:
            log.warning("attempt %d failed%s: %s", attempt,
                        " (will retry)" if will_retry else "", error,
                        extra={**self._extra, "rollout": rid, "attempt": attempt})
        await self._changed(ro)

    async def _cancel_in_store(self, rid: str) -> None:
        ro = self.rollouts[rid]
        if ro.status in TERMINAL:
            return
        attempt = ro.attempt
        if ro.attempts and ro.attempts[-1].status != c.ROLLOUT_STATUS_RUNNING:
            # Between a failed attempt and its retry: the store ends a rollout through its
            # current attempt, so the retry is started and cancelled at once.
            attempt += 1
            await self._changed(await self.ctx.store.start_attempt(rid, attempt, ""))
        await self._finish(rid, attempt, c.ROLLOUT_STATUS_CANCELLED, error="run cancelled")

    async def _run_job(self, rid: str, spec: JobSpec, adopt: bool = False) -> JobResult:
        """Runs a job of this rollout (with `adopt`: takes over the one an earlier controller
        launched from this spec, launching it only if there is none); killed if the run is
        cancelled (or this task is)."""
        self._jobs[rid] = spec.job_id
        try:
            if not (adopt and await self.backend.adopt(spec)):
                await self._launch(spec)
            if adopt:
                self._took_over(rid)
            if self.cancelled:  # cancelled while launching: cancel() did not see this job
                await self.backend.cancel(spec.job_id, "run cancelled")
            result = await self.backend.wait(spec.job_id)
        except asyncio.CancelledError:
            # The controller is stopping: the job is left to the backend's close() (the local
            # backend kills it, Kubernetes leaves it for the next controller to adopt).
            self._jobs.pop(rid, None)
            raise
        except BaseException:
            self._jobs.pop(rid, None)
            await asyncio.shield(self.backend.cleanup(spec.job_id))
            raise
        self._jobs.pop(rid, None)
        await asyncio.shield(self.backend.cleanup(spec.job_id))
        return result

    async def _launch(self, spec: JobSpec) -> None:
        """`backend.launch`, timed and counted (`metrics.py`)."""
        backend = self.spec.backend
        t0 = time.perf_counter()
        try:
            await self.backend.launch(spec)
        except BaseException:
            metrics.JOB_LAUNCHES.labels(backend, "failed").inc()
            raise
        metrics.JOB_LAUNCH.labels(backend).observe(time.perf_counter() - t0)
        metrics.JOB_LAUNCHES.labels(backend, "ok").inc()

    async def _attempt(self, rid: str, attempt: int, resumed: bool = False) -> None:
        """Runs attempt `attempt` of a rollout to its end in the store; `resumed`: the store
        holds it as RUNNING already (its controller died), its jobs are adopted."""
        ro, spec, ctx, jobs = self.rollouts[rid], self.spec, self.ctx, self.jobs
        extra = {**self._extra, "rollout": rid, "attempt": attempt}
        workdir, work = jobs.prepare(ro, attempt)
        token = ctx.signer.mint(rid, attempt,
                                ttl_s=spec.timeout_s + ctx.cfg.credential_ttl_margin_s)
        env = jobs.harness_env(ro, attempt, token, work)
        if resumed:
            log.info("attempt %d: resuming it (its controller stopped)", attempt, extra=extra)
        else:
            await self._changed(await ctx.store.start_attempt(rid, attempt, str(workdir)))
            log.info("attempt %d started in %s", attempt, workdir, extra=extra)
        labels = {"run": self.run.run_id, "rollout": grading.short_hash(rid),
                  "attempt": str(attempt)}
        setup = jobs.setup(rid, attempt, env, workdir, labels)
        if setup is not None:
            done = await self._run_job(rid, setup, adopt=resumed)
            if not done.succeeded:
                await self._finish(rid, attempt, c.ROLLOUT_STATUS_FAILED, may_retry=False,
                                   error="setup failed: " + grading.harness_failure(
                                       done, spec.setup_timeout_s))
                return
        in_job = self.backend.grades_in_job and spec.reward_source not in grading.NO_GRADER
        grader = GraderStep(argv=list(spec.grader_command), env=grading.in_job_grader_env(env),
                            timeout_s=spec.grader_timeout_s) if in_job else None
        result = await self._run_job(rid, JobSpec(
            job_id=jobs.job_id(rid, "h", attempt), argv=list(spec.harness_command), env=env,
            workdir=workdir, cwd=work if self.backend.shares_workdir else None,
            labels={**labels, "role": "harness"}, grader=grader, timeout_s=spec.timeout_s,
            sandbox=jobs.harness_sandbox(work)), adopt=resumed)
        if self.cancelled:
            await self._finish(rid, attempt, c.ROLLOUT_STATUS_CANCELLED, error="run cancelled",
                               exit_code=result.exit_code)
            return
        if not result.succeeded:
            await self._finish(rid, attempt, c.ROLLOUT_STATUS_FAILED,
                               error=grading.harness_failure(result, self.spec.timeout_s),
                               exit_code=result.exit_code, timed_out=result.timed_out)
            return
        if spec.reward_source == c.REWARD_SOURCE_GROUP_GRADER:
            grade = grading.Grade(0.0, pending=True)  # its group grader gives the reward
        elif spec.reward_source == c.REWARD_SOURCE_HARNESS:
            grade = grading.reward_from_report(await ctx.store.get_rollout(rid), attempt)
        elif in_job:
            grade = grading.grade_in_job(result, spec.reward_source)
        else:
            grade = await grading.run_grader(
                lambda job: self._run_job(rid, job, adopt=resumed),
                job_id=jobs.job_id(rid, "g", attempt),
                argv=list(spec.grader_command), workdir=workdir, cwd=work,
                sandbox=jobs.grader_sandbox(work, [result.stdout_path, result.stderr_path]),
                harness_env={**env, "HARNESSRL_STORE_ADDRESS": ctx.store.address,
                             **ctx.graders.env(self.run.run_id, ro.group_id, [rid],
                                               spec.grader_timeout_s + 300)},
                timeout_s=spec.grader_timeout_s, harness=result,
                reward_source=spec.reward_source, labels={**labels, "role": "grader"})
        if self.cancelled:
            await self._finish(rid, attempt, c.ROLLOUT_STATUS_CANCELLED, error="run cancelled")
        elif grade.ok:
            await self._finish(rid, attempt, c.ROLLOUT_STATUS_SUCCEEDED, grade=grade)
        else:
            await self._finish(rid, attempt, c.ROLLOUT_STATUS_FAILED,
                               error=f"grading failed: {grade.error}", may_retry=False)

    def watch(self) -> AsyncIterator[cpb.RunEvent]:
        """Every rollout's current state, then live events, ending with KIND_RUN_DONE."""
        return self.events.watch(self.rollouts.values,
                                 lambda: self.snapshot() if self.done.is_set() else None)


def _attempt_running(ro: c.Rollout) -> bool:
    """The store holds the rollout's current attempt as running."""
    return ro.status == c.ROLLOUT_STATUS_RUNNING and bool(ro.attempts) and \
        ro.attempts[-1].status == c.ROLLOUT_STATUS_RUNNING
