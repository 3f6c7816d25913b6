"""Runs and rollouts kept in Redis, with their calls (`call_log`), the completed-group stream
(`group_stream`) and services' own state (`state_space`) beside them.

Keys (all under the configured prefix P):

- `P run:{run_id}` the `Run` record (protobuf bytes); `P runs` ZSET of run ids by creation time.
- `P ro:{rollout_id}` the `Rollout` record without calls (protobuf bytes).
- `P st:{rollout_id}` the rollout's write state, read by the call-append script:
  `P` pending, `R{k}` attempt k running, `F{k}` attempt k failed (another may start),
  `T` terminal. Updated in the same transaction as the record.
- `P calls:{rollout_id}:{k}` HASH seq -> `Call` bytes of attempt k, and `P gw*:{rollout_id}:{k}`
  the gateway's state of them (`call_log`: appended with them, dropped when the attempt ends).
- `P runro:{run_id}` / `P grp:{group_id}` LISTs of rollout ids, in creation order.
- `P gdone:{group_id}`, `P gpub:{group_id}`, `P stream:{name}`, `P dead:{name}` and
  `P nack:{name}:{group}`: the completed-group stream (`group_stream`; a group held for its
  group grader is published by `group_rewards.py`).
- `P state:{namespace}` HASH key -> bytes: services' own small durable state (`state_space`).

Appends are checked and written by one Lua script per batch, so a call can never land in an
attempt that has finished (scripts touch several keys: a single Redis, not Redis Cluster).
Record updates use optimistic transactions (WATCH/MULTI). Publishing a completed group
happens exactly once, even when the store dies between finishing the last rollout and
publishing (`group_stream`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from harnessrl.errors import FailedPrecondition, InvalidArgument, NotFound
from harnessrl.statuses import TERMINAL
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.store import group_rewards, rewards
from services.store.call_log import CallLog
from services.store.group_stream import GroupStream
from services.store.state_space import StateSpace, require as _require

_CREATE_LUA = """
-- KEYS: ro, st, runro, grp; ARGV: rollout bytes, rollout id
if redis.call('SETNX', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], 'P')
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('RPUSH', KEYS[4], ARGV[2])
return 1
"""


class RolloutStore:
    def __init__(self, redis: aioredis.Redis, prefix: str = "hrl:") -> None:
        self.r = redis
        self.p = prefix
        self._create = redis.register_script(_CREATE_LUA)
        self.state = StateSpace(redis, prefix)  # services' own state (PutState and friends)
        self.calls = CallLog(redis, prefix)  # calls and the gateway's state of them
        self.groups = GroupStream(  # the completed-group stream (ReadGroups and friends)
            redis, prefix, lambda group_id, calls: self.list_rollouts("", group_id, calls))

    # keys -----------------------------------------------------------------------------------
    def _k(self, *parts: str) -> str:
        return self.p + ":".join(parts)

    def _calls_key(self, rollout_id: str, attempt: int) -> str:
        return self.calls.calls_key(rollout_id, attempt)

    # runs -----------------------------------------------------------------------------------
    async def put_run(self, run: c.Run) -> c.Run:
        _require(run.run_id, "run.run_id")
        if not math.isfinite(run.created_at):
            raise InvalidArgument("run.created_at must be a finite number")
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.set(self._k("run", run.run_id), run.SerializeToString())
            pipe.zadd(self._k("runs"), {run.run_id: run.created_at or time.time()}, nx=True)
            await pipe.execute()
        return run

    async def get_run(self, run_id: str) -> c.Run:
        data = await self.r.get(self._k("run", _require(run_id, "run_id")))
        if data is None:
            raise NotFound(f"run {run_id!r} not found")
        return c.Run.FromString(data)

    async def list_runs(self, limit: int = 100) -> list[c.Run]:
        ids = await self.r.zrevrange(self._k("runs"), 0, (limit or 100) - 1)
        if not ids:
            return []
        datas = await self.r.mget([self._k("run", i.decode()) for i in ids])
        return [c.Run.FromString(d) for d in datas if d is not None]

    # rollouts -------------------------------------------------------------------------------
    async def create_rollouts(self, rollouts: Sequence[c.Rollout]) -> tuple[int, int]:
        for ro in rollouts:
            _require(ro.rollout_id, "rollout_id")
            _require(ro.run_id, "run_id")
            _require(ro.group_id, "group_id")
            if ro.group_size < 1:
                raise InvalidArgument(f"rollout {ro.rollout_id}: group_size must be >= 1")
            if ro.calls:
                raise InvalidArgument("calls are appended with AppendCalls, not created")
        created = 0
        async with self.r.pipeline(transaction=False) as pipe:
            for ro in rollouts:
                rec = c.Rollout()
                rec.CopyFrom(ro)
                rec.status = c.ROLLOUT_STATUS_PENDING
                rec.attempt = 0
                rec.max_attempts = max(1, ro.max_attempts)
                rec.created_at = ro.created_at or time.time()
                del rec.attempts[:]
                keys = [self._k("ro", ro.rollout_id), self._k("st", ro.rollout_id),
                        self._k("runro", ro.run_id), self._k("grp", ro.group_id)]
                await self._create(keys=keys, args=[rec.SerializeToString(), ro.rollout_id],
                                   client=pipe)
            results = await pipe.execute()
        created = sum(int(x) for x in results)
        return created, len(rollouts) - created

    async def _load(self, rollout_id: str) -> c.Rollout:
        data = await self.r.get(self._k("ro", _require(rollout_id, "rollout_id")))
        if data is None:
            raise NotFound(f"rollout {rollout_id!r} not found")
        return c.Rollout.FromString(data)

    async def _update(
        self, rollout_id: str,
        change: Callable[[c.Rollout], tuple[c.Rollout, str | None] | None],
        also: Callable[[Pipeline, c.Rollout], Awaitable[object]] | None = None,
    ) -> c.Rollout:
        """Read-modify-write of a rollout under WATCH. `change` returns (new record, new state)
        or None to leave it unchanged (idempotent repeat); it raises on a bad transition.
        `also(pipe, new)` queues more commands in the same transaction as the write."""
        ro_key, st_key = self._k("ro", rollout_id), self._k("st", rollout_id)
        while True:
            async with self.r.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(ro_key)
                    data = await pipe.get(ro_key)
                    if data is None:
                        raise NotFound(f"rollout {rollout_id!r} not found")
                    current = c.Rollout.FromString(data)
                    result = change(current)
                    if result is None:
                        await pipe.unwatch()
                        return current
                    new, state = result
                    pipe.multi()
                    pipe.set(ro_key, new.SerializeToString())
                    if state is not None:
                        pipe.set(st_key, state)
                    if also is not None:
                        await also(pipe, new)
                    await pipe.execute()
                    return new
                except WatchError:
                    continue

    async def start_attempt(self, rollout_id: str, attempt: int, workdir: str) -> c.Rollout:
        def change(ro: c.Rollout) -> tuple[c.Rollout, str] | None:
            if ro.attempt == attempt and ro.status == c.ROLLOUT_STATUS_RUNNING and \
                    ro.attempts and ro.attempts[-1].status == c.ROLLOUT_STATUS_RUNNING:
                return None  # repeated start of the running attempt
            if ro.status in TERMINAL:
                raise FailedPrecondition(
                    f"rollout {rollout_id} is {c.RolloutStatus.Name(ro.status)}")
            if attempt != ro.attempt + 1:
                raise FailedPrecondition(
                    f"rollout {rollout_id}: attempt {attempt} cannot start after attempt "
                    f"{ro.attempt}")
            if ro.attempts and ro.attempts[-1].status == c.ROLLOUT_STATUS_RUNNING:
                raise FailedPrecondition(f"rollout {rollout_id}: attempt {ro.attempt} still runs")
            if attempt > ro.max_attempts:
                raise FailedPrecondition(
                    f"rollout {rollout_id}: attempt {attempt} exceeds max_attempts "
                    f"{ro.max_attempts}")
            ro.attempt = attempt
            ro.status = c.ROLLOUT_STATUS_RUNNING
            ro.attempts.add(attempt=attempt, status=c.ROLLOUT_STATUS_RUNNING,
                            started_at=time.time(), workdir=workdir)
            return ro, f"R{attempt}"

        return await self._update(rollout_id, change)

    async def report_reward(self, rollout_id: str, attempt: int, reward: float) -> c.Rollout:
        if not math.isfinite(reward):
            raise InvalidArgument("reward must be a finite number")

        def change(ro: c.Rollout) -> tuple[c.Rollout, None]:
            if ro.attempt != attempt or not ro.attempts or \
                    ro.attempts[-1].status != c.ROLLOUT_STATUS_RUNNING:
                raise FailedPrecondition(
                    f"rollout {rollout_id}: attempt {attempt} is not running")
            ro.attempts[-1].has_reported_reward = True
            ro.attempts[-1].reported_reward = reward
            return ro, None

        return await self._update(rollout_id, change)

    async def finish_attempt(self, req: spb.FinishAttemptRequest) -> c.Rollout:
        if req.status not in TERMINAL:
            raise InvalidArgument("status must be SUCCEEDED, FAILED or CANCELLED")
        if req.status == c.ROLLOUT_STATUS_SUCCEEDED and not math.isfinite(req.reward):
            raise InvalidArgument("reward must be a finite number")
        rewards.check_finish(req)
        retry = req.status == c.ROLLOUT_STATUS_FAILED and req.will_retry
        num_calls = await self.r.hlen(self._calls_key(req.rollout_id, req.attempt))

        def change(ro: c.Rollout) -> tuple[c.Rollout, str] | None:
            if ro.status in TERMINAL and req.status == c.ROLLOUT_STATUS_CANCELLED:
                return None  # cancelling a finished rollout changes nothing
            if req.attempt != ro.attempt and not (
                    req.status == c.ROLLOUT_STATUS_CANCELLED and ro.attempt == 0):
                if req.attempt < ro.attempt or ro.status in TERMINAL:
                    return None  # an earlier attempt's finish, repeated
                raise FailedPrecondition(
                    f"rollout {req.rollout_id}: attempt {req.attempt} was never started")
            att = ro.attempts[-1] if ro.attempts else None
            if att is not None and att.status != c.ROLLOUT_STATUS_RUNNING:
                if req.status == c.ROLLOUT_STATUS_CANCELLED and ro.status not in TERMINAL:
                    # cancelled between a failed attempt and its retry: ends the rollout
                    ro.status, ro.finished_at = c.ROLLOUT_STATUS_CANCELLED, time.time()
                    ro.error = req.error or ro.error
                    return ro, "T"
                return None  # repeated finish of this attempt: idempotent
            if att is not None:
                att.status = c.ROLLOUT_STATUS_FAILED if req.status == c.ROLLOUT_STATUS_CANCELLED \
                    else req.status
                att.error = req.error
                att.exit_code = req.exit_code
                att.timed_out = req.timed_out
                att.finished_at = time.time()
                att.num_calls = num_calls
            if retry:
                if ro.attempt >= ro.max_attempts:
                    raise FailedPrecondition(
                        f"rollout {req.rollout_id}: no attempts left to retry")
                ro.error = req.error
                return ro, f"F{ro.attempt}"
            ro.status = req.status
            ro.error = req.error
            ro.finished_at = time.time()
            if req.reward_pending and ro.group_grading != c.GROUP_GRADING_WAITING:
                raise FailedPrecondition("reward_pending: the run has no group grader")
            if req.status == c.ROLLOUT_STATUS_SUCCEEDED and not req.reward_pending:
                rewards.record_finish(ro, req)
            return ro, "T"

        ended: list[c.Rollout] = []

        async def end(pipe: Pipeline, new: c.Rollout) -> None:
            """The rollout's end (and its group's publish, once all of it ended) in the same
            transaction as its terminal record: a store that dies (or a caller that goes away)
            right after the write cannot leave a group ended and never published. A group
            with a group grader is published by its answer."""
            if new.status in TERMINAL:
                await self.groups.end(new, [new.rollout_id], pipe=pipe,
                                      publish=new.group_grading == c.GROUP_GRADING_NONE)
                ended.append(new)

        ro = await self._update(req.rollout_id, change, also=end)
        if ro.status in TERMINAL and not any(x is ro for x in ended):  # not written here (a
            # repeated finish, or a retry after WATCH): the end again (idempotent)
            await self.groups.end(ro, [ro.rollout_id],
                                  publish=ro.group_grading == c.GROUP_GRADING_NONE)
        att = next((a for a in ro.attempts if a.attempt == req.attempt), None)
        if att is not None and att.status != c.ROLLOUT_STATUS_RUNNING:
            await self.calls.drop(req.rollout_id, req.attempt)
        return ro

    async def set_group_rewards(self, req: spb.SetGroupRewardsRequest
                                ) -> tuple[list[c.Rollout], bool]:
        return await group_rewards.set_group_rewards(self.r, self.p, self.groups, req)

    async def get_rollout(self, rollout_id: str, include_calls: bool) -> c.Rollout:
        return (await self._with_calls([await self._load(rollout_id)], include_calls))[0]

    async def list_rollouts(self, run_id: str, group_id: str, include_calls: bool
                            ) -> list[c.Rollout]:
        key = self._k("grp", group_id) if group_id else self._k(
            "runro", _require(run_id, "run_id or group_id"))
        ids = [i.decode() for i in await self.r.lrange(key, 0, -1)]
        if not ids:
            return []
        datas = await self.r.mget([self._k("ro", i) for i in ids])
        rollouts = [c.Rollout.FromString(d) for d in datas if d is not None]
        if run_id:
            rollouts = [ro for ro in rollouts if ro.run_id == run_id]
        return await self._with_calls(rollouts, include_calls)

    async def _with_calls(self, rollouts: list[c.Rollout], include_calls: bool
                          ) -> list[c.Rollout]:
        """Fills each attempt's num_calls (and the current attempt's calls when asked)."""
        async with self.r.pipeline(transaction=False) as pipe:
            for ro in rollouts:
                for att in ro.attempts:
                    pipe.hkeys(self._calls_key(ro.rollout_id, att.attempt))
                if include_calls and ro.attempt:
                    pipe.hgetall(self._calls_key(ro.rollout_id, ro.attempt))
            results = iter(await pipe.execute())
        for ro in rollouts:
            for att in ro.attempts:
                seqs = [int(s) for s in next(results)]
                att.num_calls = len(seqs)
                att.next_seq = max(seqs) + 1 if seqs else 0
            if include_calls and ro.attempt:
                calls = next(results)
                for seq in sorted(calls, key=int):
                    ro.calls.add().MergeFromString(calls[seq])
        return rollouts

    # calls ----------------------------------------------------------------------------------
    async def append_calls(self, calls: Sequence[c.Call],
                           states: Sequence[spb.GatewayCallState] = (),
                           data: Sequence[bytes] = ()) -> tuple[list[int], list[str]]:
        """Appends calls (stored as `data`, their bytes, if given) and states: per-call results."""
        results: list[int] = [spb.APPEND_RESULT_UNSPECIFIED] * len(calls)
        reasons = [""] * len(calls)
        todo = []
        for i, call in enumerate(calls):
            if problem := _call_problem(call):
                results[i], reasons[i] = spb.APPEND_RESULT_INVALID, problem
            else:
                todo.append(i)
        if todo:
            outcomes = await self.calls.append(  # one round trip per batch
                [calls[i] for i in todo], [states[i] for i in todo] if len(states) == len(calls)
                else (), [data[i] for i in todo] if len(data) == len(calls) else ())
            for i, out in zip(todo, outcomes):
                results[i], reasons[i] = _APPENDED[out], ""
                if out == -1:
                    reasons[i] = f"unknown rollout {calls[i].rollout_id!r}"
                elif out == -2:
                    reasons[i] = (f"attempt {calls[i].attempt} of rollout {calls[i].rollout_id} "
                                  "is not running")
                elif out == -3:
                    reasons[i] = (f"seq {calls[i].seq} of rollout {calls[i].rollout_id} attempt "
                                  f"{calls[i].attempt} holds another call")
        return results, reasons


_APPENDED = {1: spb.APPEND_RESULT_STORED, 0: spb.APPEND_RESULT_DUPLICATE,
             -1: spb.APPEND_RESULT_REJECTED, -2: spb.APPEND_RESULT_REJECTED,
             -3: spb.APPEND_RESULT_CONFLICT}


def _call_problem(call: c.Call) -> str:
    if not call.rollout_id:
        return "rollout_id is required"
    if call.attempt < 1:
        return "attempt must be >= 1"
    if call.seq < 0:
        return "seq must be >= 0"
    if len(call.logprobs) != len(call.completion_token_ids):
        return (f"{len(call.logprobs)} logprobs for {len(call.completion_token_ids)} completion "
                "tokens: one logprob per token is required")
    return ""

