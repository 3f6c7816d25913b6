"""Rollouts, calls, runs and the completed-group stream, kept in Redis.

Keys (all under the configured prefix P):

- `P run:{run_id}` the `Run` record (protobuf bytes); `P runs` ZSET of run ids by creation time.
- `P ro:{rollout_id}` the `Rollout` record without calls (protobuf bytes).
- `P st:{rollout_id}` the rollout's write state, read by the call-append script:
  `P` pending, `R{k}` attempt k running, `F{k}` attempt k failed (another may start),
  `T` terminal. Updated in the same transaction as the record.
- `P calls:{rollout_id}:{k}` HASH seq -> `Call` bytes of attempt k, and `P gw*:{rollout_id}:{k}`
  the gateway's state of them (`call_log`: appended with them, dropped when the attempt ends).
- `P runro:{run_id}` / `P grp:{group_id}` LISTs of rollout ids, in creation order.
- `P gdone:{group_id}` SET of terminal rollouts; `P gpub:{group_id}` published flag (a group
  held for its group grader is published by `group_rewards.py`).
- `P stream:{name}` the Redis Stream of completed groups, read through consumer groups.
- `P dead:{name}` its dead-letter stream: groups delivered `max_deliveries` times without being
  acknowledged (`dead_letter`); `P nack:{name}:{group}` HASH entry id -> last failure reason.
- `P state:{namespace}` HASH key -> bytes: services' own small durable state (`state_space`).

Appends are checked and written by one Lua script per batch, so a call can never land in an
attempt that has finished (scripts touch several keys: a single Redis, not Redis Cluster).
Record updates use optimistic transactions (WATCH/MULTI). Publishing a completed group is a
Lua script guarded by a flag, so it happens exactly once even when the store dies between
finishing the last rollout and publishing (the idempotent retry of FinishAttempt publishes
then).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import ResponseError, WatchError

from harnessrl.errors import FailedPrecondition, InvalidArgument, NotFound
from harnessrl.statuses import TERMINAL
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.store import group_rewards
from services.store.group_rewards import NO_STREAM
from services.store.call_log import CallLog
from services.store.state_space import StateSpace, require as _require

_CREATE_LUA = """
-- KEYS: ro, st, runro, grp; ARGV: rollout bytes, rollout id
if redis.call('SETNX', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], 'P')
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('RPUSH', KEYS[4], ARGV[2])
return 1
"""

_PUBLISH_LUA = """
-- KEYS: gdone, gpub, stream; ARGV: group size, group id, run id, task id
if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[1]) then return 0 end
if redis.call('SETNX', KEYS[2], '1') == 0 then return 0 end
redis.call('XADD', KEYS[3], '*', 'group_id', ARGV[2], 'run_id', ARGV[3], 'task_id', ARGV[4])
return 1
"""

_DEAD_LETTER_LUA = """
-- KEYS: stream, dead stream, reasons hash; ARGV: consumer group, entry id, deliveries,
-- dead_at, default reason. Acknowledges the entry and copies it to the dead-letter stream,
-- once (an entry acknowledged already is left alone). 1 when moved, 0 otherwise.
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
local reason = redis.call('HGET', KEYS[3], ARGV[2]) or ARGV[5]
local fields = {'original_entry_id', ARGV[2], 'consumer_group', ARGV[1],
                'deliveries', ARGV[3], 'reason', reason, 'dead_at', ARGV[4]}
if entry[1] then
  for _, v in ipairs(entry[1][2]) do fields[#fields + 1] = v end
end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('HDEL', KEYS[3], ARGV[2])
return 1
"""

_ENTRY_ID = re.compile(r"^([0-9]{1,20})(?:-([0-9]{1,20}))?$")


def _id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq" or "ms") as a sortable pair; ValueError when it is none."""
    m = _ENTRY_ID.match(entry_id)
    if m is None or int(m.group(1)) >= 2**64 or int(m.group(2) or 0) >= 2**64:
        raise ValueError(f"not a stream entry id: {entry_id!r}")
    return int(m.group(1)), int(m.group(2) or 0)


def _check_entry_ids(entry_ids: Iterable[str]) -> list[str]:
    ids = list(entry_ids)
    for entry_id in ids:
        try:
            _id_key(entry_id)
        except ValueError as exc:
            raise InvalidArgument(f"bad stream entry id {entry_id[:100]!r}") from exc
    return ids


class RolloutStore:
    def __init__(self, redis: aioredis.Redis, prefix: str = "hrl:") -> None:
        self.r = redis
        self.p = prefix
        self._create = redis.register_script(_CREATE_LUA)
        self._publish = redis.register_script(_PUBLISH_LUA)
        self._dead_letter = redis.register_script(_DEAD_LETTER_LUA)
        self.state = StateSpace(redis, prefix)  # services' own state (PutState and friends)
        self.calls = CallLog(redis, prefix)  # calls and the gateway's state of them

    # keys -----------------------------------------------------------------------------------
    def _k(self, *parts: str) -> str:
        return self.p + ":".join(parts)

    def _calls_key(self, rollout_id: str, attempt: int) -> str:
        return self.calls.calls_key(rollout_id, attempt)

    def _stream_key(self, stream: str) -> str:
        return self._k("stream", stream or "train")

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
    ) -> c.Rollout:
        """Read-modify-write of a rollout under WATCH. `change` returns (new record, new state)
        or None to leave it unchanged (idempotent repeat); it raises on a bad transition."""
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
        group_rewards.check_parts(list(req.reward_parts), "reward_parts")
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
                ro.has_reward, ro.reward, ro.reward_reason = True, req.reward, req.reward_reason
                ro.reward_parts.extend(req.reward_parts)
            return ro, "T"

        ro = await self._update(req.rollout_id, change)
        att = next((a for a in ro.attempts if a.attempt == req.attempt), None)
        if att is not None and att.status != c.ROLLOUT_STATUS_RUNNING:
            await self.calls.drop(req.rollout_id, req.attempt)
        if ro.status in TERMINAL:
            await self._mark_done_and_publish(ro)
        return ro

    async def _mark_done_and_publish(self, ro: c.Rollout) -> None:
        gdone = self._k("gdone", ro.group_id)
        await self.r.sadd(gdone, ro.rollout_id)
        if ro.stream in NO_STREAM or ro.group_grading != c.GROUP_GRADING_NONE:
            return  # a group with a group grader is published by set_group_rewards only
        await self._publish(
            keys=[gdone, self._k("gpub", ro.group_id), self._stream_key(ro.stream)],
            args=[ro.group_size, ro.group_id, ro.run_id, ro.task_id],
        )

    async def set_group_rewards(self, req: spb.SetGroupRewardsRequest
                                ) -> tuple[list[c.Rollout], bool]:
        return await group_rewards.set_group_rewards(self, req)

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
                           states: Sequence[spb.GatewayCallState] = ()
                           ) -> tuple[list[int], list[str]]:
        """Appends calls with the gateway's state of them (`call_log`): per-call results."""
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
                [calls[i] for i in todo],
                [states[i] for i in todo] if len(states) == len(calls) else ())
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

    # the completed-group stream -------------------------------------------------------------
    async def _ensure_consumer_group(self, stream_key: str, group: str) -> None:
        try:
            await self.r.xgroup_create(stream_key, group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_groups(self, stream: str, group: str, consumer: str, max_groups: int,
                          block_ms: int, include_calls: bool, max_deliveries: int = 0,
                          new_only: bool = False) -> list[c.Group]:
        key = self._stream_key(stream)
        await self._ensure_consumer_group(key, group)
        count = max(1, max_groups)
        entries: list[tuple[str, dict[str, str]]] = []
        if not new_only:
            if max_deliveries > 0:  # exhausted entries go to the dead-letter stream first
                pending = await self.r.xpending_range(key, group, min="-", max="+",
                                                      count=count + 1000, consumername=consumer)
                for p in pending:
                    delivered = int(p["times_delivered"])
                    if delivered >= max_deliveries:
                        await self.dead_letter(stream, group, p["message_id"].decode(), delivered)
            # Entries given to this consumer earlier and never acknowledged come first (each
            # such read counts as a delivery).
            entries = _entries(await self.r.xreadgroup(group, consumer, {key: "0"},
                                                       count=count))
        if len(entries) < count:
            fresh = await self.r.xreadgroup(group, consumer, {key: ">"},
                                            count=count - len(entries),
                                            block=block_ms if block_ms > 0 and not entries
                                            else None)
            entries += _entries(fresh)
        return await self._groups(entries, include_calls)

    async def _groups(self, entries: list[tuple[str, dict[str, str]]], include_calls: bool
                      ) -> list[c.Group]:
        groups = []
        for entry_id, fields in entries:
            g = c.Group(entry_id=entry_id, group_id=fields["group_id"], run_id=fields["run_id"],
                        task_id=fields["task_id"])
            g.rollouts.extend(await self.list_rollouts("", g.group_id, include_calls))
            groups.append(g)
        return groups

    async def stream_stats(self) -> list[tuple[str, int, list[tuple[str, int, int]]]]:
        """(stream name, entries, [(consumer group, lag, pending)]) of every stream: lag is
        entries not yet delivered to the group, pending delivered and not acknowledged."""
        head = self._k("stream", "")
        pattern = "".join("\\" + ch if ch in "*?[]\\" else ch for ch in head) + "*"
        out = []
        async for key in self.r.scan_iter(match=pattern, count=1000):
            key = key.decode() if isinstance(key, bytes) else key
            try:
                length = int(await self.r.xlen(key))
                groups = await self.r.xinfo_groups(key)
            except ResponseError:  # not a stream (a foreign key under the prefix)
                continue
            stats = []
            for g in groups:
                name = g["name"].decode() if isinstance(g["name"], bytes) else str(g["name"])
                lag = g.get("lag")
                stats.append((name, int(lag) if lag is not None else length,
                              int(g.get("pending") or 0)))
            out.append((key[len(head):], length, stats))
        return out

    # bounded redelivery -------------------------------------------------------------------
    async def dead_letter(self, stream: str, group: str, entry_id: str, deliveries: int) -> bool:
        """Moves a pending entry to the dead-letter stream (acknowledging it); idempotent."""
        moved = await self._dead_letter(
            keys=[self._stream_key(stream), self._k("dead", stream or "train"),
                  self._k("nack", stream or "train", group)],
            args=[group, entry_id, deliveries, time.time(),
                  f"delivered {deliveries} times without being acknowledged"])
        return bool(moved)

    async def nack_groups(self, stream: str, group: str, consumer: str, entry_ids: list[str],
                          reason: str, max_deliveries: int, redeliver: bool,
                          include_calls: bool) -> tuple[list[c.Group], list[str]]:
        """A failed delivery of `entry_ids`: keeps the reason; dead-letters the entries
        delivered `max_deliveries` times; with `redeliver`, delivers the others again (XCLAIM
        counts a delivery). Returns (redelivered groups, dead-lettered entry ids)."""
        key = self._stream_key(stream)
        ids = list(dict.fromkeys(_check_entry_ids(entry_ids)))
        if not ids:
            return [], []
        if reason:
            await self.r.hset(self._k("nack", stream or "train", group),
                              mapping={i: reason[:4000] for i in ids})
        async with self.r.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.xpending_range(key, group, min=entry_id, max=entry_id, count=1)
            try:
                infos = await pipe.execute()
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    return [], []  # no such stream or consumer group: nothing is pending
                raise
        dead, keep = [], []
        for entry_id, info in zip(ids, infos):
            if not info:
                continue  # not pending (acknowledged, unknown): nothing to do
            delivered = int(info[0]["times_delivered"])
            if max_deliveries > 0 and delivered >= max_deliveries:
                if await self.dead_letter(stream, group, entry_id, delivered):
                    dead.append(entry_id)
            else:
                keep.append(entry_id)
        redelivered: list[c.Group] = []
        if redeliver and keep:
            claimed = await self.r.xclaim(key, group, consumer, min_idle_time=0,
                                          message_ids=keep)
            redelivered = await self._groups(_entries([(key, claimed)]), include_calls)
        return redelivered, dead

    async def list_dead_letters(self, stream: str, limit: int) -> list[spb.DeadLetter]:
        entries = await self.r.xrevrange(self._k("dead", stream or "train"),
                                         count=max(1, min(limit or 100, 10_000)))
        out = []
        for entry_id, raw in entries:
            f = {k.decode(): v.decode("utf-8", "replace") for k, v in raw.items()}
            out.append(spb.DeadLetter(
                entry_id=entry_id.decode(), original_entry_id=f.get("original_entry_id", ""),
                stream=stream or "train", consumer_group=f.get("consumer_group", ""),
                group_id=f.get("group_id", ""), run_id=f.get("run_id", ""),
                task_id=f.get("task_id", ""), deliveries=int(f.get("deliveries", 0)),
                reason=f.get("reason", ""), dead_at=float(f.get("dead_at", 0))))
        return out

    async def trim_groups(self, stream: str, below_entry_id: str) -> tuple[int, str]:
        """Trims the stream below `below_entry_id` (empty: no bound of the caller's), and never
        past the first entry any consumer group has pending or has not read yet."""
        key = self._stream_key(stream)
        floor = None
        if below_entry_id:
            floor = _id_key(_check_entry_ids([below_entry_id])[0])
        try:
            groups = await self.r.xinfo_groups(key)
        except ResponseError:
            return 0, ""  # no such stream
        for g in groups:
            name = g["name"].decode() if isinstance(g["name"], bytes) else str(g["name"])
            summary = await self.r.xpending(key, name)
            if summary["pending"]:
                cand = _id_key(summary["min"].decode() if isinstance(summary["min"], bytes)
                               else str(summary["min"]))
            else:
                last = g["last-delivered-id"]
                ms, seq = _id_key(last.decode() if isinstance(last, bytes) else str(last))
                cand = (ms, seq + 1)  # entries after the last delivered one are unread
            floor = cand if floor is None else min(floor, cand)
        if floor is None:
            return 0, ""
        min_id = f"{floor[0]}-{floor[1]}"
        trimmed = await self.r.xtrim(key, minid=min_id, approximate=False)
        return int(trimmed), min_id

    async def ack_groups(self, stream: str, group: str, entry_ids: Iterable[str]) -> int:
        ids = _check_entry_ids(entry_ids)
        return int(await self.r.xack(self._stream_key(stream), group, *ids)) if ids else 0


def _entries(resp: list) -> list[tuple[str, dict[str, str]]]:  # type: ignore[type-arg]
    out = []
    for _stream, items in resp or []:
        for entry_id, fields in items:
            if fields:  # an entry deleted from the stream shows as empty: skip it
                out.append((entry_id.decode(),
                            {k.decode(): v.decode() for k, v in fields.items()}))
    return out


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

