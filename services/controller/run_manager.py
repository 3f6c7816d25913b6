"""The runs a controller knows: creating (or resuming), reading, cancelling and watching them.

Runs executing in this process are held in memory (their live state); every other run is read
from the store. CreateRun with a `run_id` is idempotent: the same spec again returns the run
as it is; a run the store holds as RUNNING that no controller executes (its controller
stopped) or FAILED (say, its store was gone too long) is resumed — attempts left running are
recorded as failed (retried while attempts remain), unfinished rollouts run. A different spec
under an existing run_id is ALREADY_EXISTS.

At start-up (`recover`) the controller resumes, before it takes any request, every run the
store holds as RUNNING: the runs of a controller that died. Their jobs are adopted where they
still run or ended meanwhile (see `run_execution`), so a restart neither orphans a harness nor
launches one twice; the controller serves once they are adopted (a sandbox's door reopened).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from harnessrl.errors import (AlreadyExists, FailedPrecondition, HarnessRLError, InvalidArgument,
                             NotFound)
from harnessrl.statuses import RUN_TERMINAL, TERMINAL
from harnessrl.v1 import common_pb2 as c, controller_pb2 as cpb, store_pb2 as spb
from services.controller import run_spec
from services.controller.run_execution import RunContext, RunExecution
from services.controller.store_calls import StoreUnavailable

log = logging.getLogger("harnessrl.controller")
# How long start-up waits for the resumed runs' running jobs to be adopted (a rollout waiting
# for a job slot or admission is not, so this is a bound, not the usual wait: milliseconds).
TAKE_OVER_WAIT_S = 30.0


def _same_spec(a: c.RunSpec, b: c.RunSpec) -> bool:
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


class RunManager:
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.executions: dict[str, RunExecution] = {}
        self._create_lock = asyncio.Lock()

    @property
    def _request_retry_s(self) -> float:
        return self.ctx.cfg.store_request_retry_s

    async def create(self, spec: c.RunSpec, run_id: str = "") -> c.Run:
        spec = run_spec.normalize(spec, tuple(self.ctx.backends), self.ctx.cfg.default_backend)
        backend = self.ctx.backends[spec.backend]
        env = dict(spec.env)
        for what, argv in (("harness_command", spec.harness_command),
                           ("grader_command", spec.grader_command),
                           ("setup_command", spec.setup_command)):
            problem = backend.check_argv(list(argv), env) if argv else None
            if problem:
                raise InvalidArgument(f"{what}: {problem}")
        tasks = await asyncio.to_thread(run_spec.resolve_tasks, spec)
        async with self._create_lock:
            run: c.Run | None = None
            if run_id:
                run_spec.check_run_id(run_id)
                ex = self.executions.get(run_id)
                if ex is not None:
                    if not _same_spec(ex.spec, spec):
                        raise AlreadyExists(f"run {run_id} exists with a different spec")
                    if ex.run.status != c.RUN_STATUS_FAILED:
                        return ex.snapshot()
                    await ex.done.wait()  # its last attempt to store the failure
                    del self.executions[run_id]  # failed (store outage): resume it below
                    ex.uncount()
                try:
                    stored = await self.ctx.store.get_run(run_id, retry_s=self._request_retry_s)
                except NotFound:
                    stored = None
                if stored is not None:
                    if not _same_spec(stored.spec, spec):
                        raise AlreadyExists(f"run {run_id} exists with a different spec")
                    if stored.status in (c.RUN_STATUS_SUCCEEDED, c.RUN_STATUS_CANCELLED):
                        return stored
                    log.warning("resuming run %s (%s)", run_id,
                                "it had failed" if stored.status == c.RUN_STATUS_FAILED
                                else "left running by a controller that stopped",
                                extra={"run": run_id})
                    run = stored
                    run.status = c.RUN_STATUS_RUNNING
                    run.error = ""
                    run.finished_at = 0.0
            else:
                run_id = f"run-{uuid.uuid4().hex[:12]}"
            if run is None:
                run = c.Run(run_id=run_id, spec=spec, status=c.RUN_STATUS_RUNNING,
                            created_at=time.time())
            ex = RunExecution(run, tasks, self.ctx)
            await ex.prepare(retry_s=self._request_retry_s)
            self.executions[run_id] = ex
            ex.start()
            return ex.snapshot()

    async def recover(self, limit: int = 1000) -> list[str]:
        """Resumes the runs (among the newest `limit`) the store holds as RUNNING that no
        controller executes; returns their ids. A run that cannot be resumed any more (its
        backend is gone from this controller's config, say) is failed with the reason."""
        resumed = []
        for run in await self.ctx.store.list_runs(limit):
            if run.status != c.RUN_STATUS_RUNNING or run.run_id in self.executions:
                continue
            try:
                await self.create(run.spec, run.run_id)
                resumed.append(run.run_id)
            except (InvalidArgument, AlreadyExists) as exc:
                log.error("run %s cannot be resumed: %s", run.run_id, exc,
                          extra={"run": run.run_id})
                run.status = c.RUN_STATUS_FAILED
                run.error = f"could not be resumed after a controller restart: {exc}"
                run.finished_at = time.time()
                await self.ctx.store.put_run(run)
        if resumed:
            log.info("resumed %d run(s) left running by an earlier controller: %s",
                     len(resumed), ", ".join(resumed))
            # Their running jobs adopted before this controller serves: a sandboxed harness's
            # door to the gateway is open again once the controller reports ready.
            waits = [self.executions[r].taken_over.wait() for r in resumed]
            try:
                await asyncio.wait_for(asyncio.gather(*waits), TAKE_OVER_WAIT_S)
            except TimeoutError:
                log.warning("the resumed runs' jobs were not all adopted within %.0f s; "
                            "serving meanwhile", TAKE_OVER_WAIT_S)
        return resumed

    async def get(self, run_id: str) -> c.Run:
        if not run_id:
            raise InvalidArgument("run_id is required")
        ex = self.executions.get(run_id)
        if ex is not None:
            return ex.snapshot()
        return await self.ctx.store.get_run(run_id, retry_s=self._request_retry_s)

    async def list_rollouts(self, run_id: str, include_calls: bool) -> list[c.Rollout]:
        await self.get(run_id)  # NOT_FOUND for an unknown run
        return await self.ctx.store.list_rollouts(run_id, include_calls=include_calls,
                                                  retry_s=self._request_retry_s)

    async def cancel(self, run_id: str, wait_s: float | None = None) -> c.Run:
        """Cancels a run; returns once it ended (or after `wait_s`, its state then)."""
        ex = self.executions.get(run_id)
        if ex is None:
            return await self._cancel_stored(run_id)
        await ex.cancel()
        wait_s = self.ctx.cfg.kill_grace_s + 10.0 if wait_s is None else wait_s
        try:
            await asyncio.wait_for(ex.done.wait(), wait_s)
        except asyncio.TimeoutError:
            log.warning("run %s: still finishing %gs after cancel", run_id, wait_s)
        return ex.snapshot()

    async def _cancel_stored(self, run_id: str) -> c.Run:
        """Cancels a run no controller executes: its unfinished rollouts become CANCELLED."""
        store, retry = self.ctx.store, self._request_retry_s
        run = await self.get(run_id)
        if run.status in RUN_TERMINAL:
            return run
        for ro in await store.list_rollouts(run_id, retry_s=retry):
            if ro.status in TERMINAL:
                continue
            attempt = ro.attempt
            if ro.attempts and ro.attempts[-1].status != c.ROLLOUT_STATUS_RUNNING:
                attempt += 1
                await store.start_attempt(ro.rollout_id, attempt, "")
            await store.finish_attempt(spb.FinishAttemptRequest(
                rollout_id=ro.rollout_id, attempt=attempt, status=c.ROLLOUT_STATUS_CANCELLED,
                error="run cancelled"))
        run.status = c.RUN_STATUS_CANCELLED
        run.finished_at = time.time()
        rollouts = await store.list_rollouts(run_id, retry_s=retry)
        for gid in sorted({r.group_id for r in rollouts
                           if r.group_grading == c.GROUP_GRADING_WAITING}):  # never graded now
            try:
                await store.set_group_rewards(spb.SetGroupRewardsRequest(
                    group_id=gid, error="run cancelled before the group was graded"))
            except HarnessRLError as exc:  # the run is cancelled all the same
                if isinstance(exc, StoreUnavailable):
                    raise
                log.error("run %s: group %s left waiting: %s", run_id, gid, exc)
        rollouts = await store.list_rollouts(run_id, retry_s=retry)
        run.num_succeeded = sum(r.status == c.ROLLOUT_STATUS_SUCCEEDED for r in rollouts)
        run.num_failed = sum(r.status == c.ROLLOUT_STATUS_FAILED for r in rollouts)
        run.num_cancelled = sum(r.status == c.ROLLOUT_STATUS_CANCELLED for r in rollouts)
        run.num_running = 0
        return await store.put_run(run, retry_s=retry)

    async def admission_update(self, req: cpb.AdmissionUpdateRequest) -> cpb.AdmissionStatus:
        ex = self.executions.get(req.run_id)
        if ex is None:
            raise NotFound(f"run {req.run_id} is not executing in this controller")
        if ex.admission is None:
            raise FailedPrecondition(f"run {req.run_id} has no admission control "
                                     f"(RunSpec.admission_batch_groups is 0)")
        if req.groups_consumed < 0:
            raise InvalidArgument("groups_consumed must be >= 0")
        return ex.admission.update(req.groups_consumed, req.policy_version)

    async def watch(self, run_id: str) -> AsyncIterator[cpb.RunEvent]:
        ex = self.executions.get(run_id)
        if ex is not None:
            async for event in ex.watch():
                yield event
            return
        run = await self.get(run_id)
        if run.status not in RUN_TERMINAL:
            raise FailedPrecondition(
                f"run {run_id} is RUNNING in the store but not executing in this controller "
                "(its controller stopped?); CreateRun with this run_id and spec resumes it")
        for ro in await self.ctx.store.list_rollouts(run_id, retry_s=self._request_retry_s):
            yield cpb.RunEvent(kind=cpb.RunEvent.KIND_ROLLOUT, rollout=ro)
        yield cpb.RunEvent(kind=cpb.RunEvent.KIND_RUN_DONE, run=run)

    async def shutdown(self) -> None:
        """Stops every executing run (its jobs killed; the store keeps them RUNNING)."""
        await asyncio.gather(*(ex.abort() for ex in self.executions.values()))
