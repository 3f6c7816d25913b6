"""The completed-group stream: publishing a group once all of it has ended, and the stream's
reading, acknowledging, redelivery, dead letters and trimming (`Store.ReadGroups` and friends).

Keys (under the store's prefix P):

- `P gdone:{group_id}` SET of the group's ended rollouts; `P gpub:{group_id}` published flag.
- `P stream:{name}` the Redis Stream of completed groups, read through consumer groups.
- `P dead:{name}` its dead-letter stream: groups delivered `max_deliveries` times without being
  acknowledged (`dead_letter`); `P nack:{name}:{group}` HASH entry id -> last failure reason.

Publishing (`end`) is a Lua script guarded by the flag, so a group is published exactly once,
even when the store dies between ending the last rollout and publishing (the idempotent retry
of FinishAttempt publishes then). Both publishers call it: FinishAttempt (`redis_store`) for a
group without a group grader, SetGroupRewards (`group_rewards`) for one held for its grader.
A group's rollouts are read by the function the store gives (`group_rollouts`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from harnessrl.errors import InvalidArgument
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb

NO_STREAM = ("", "-")  # streams of runs that publish nothing

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

GroupRollouts = Callable[[str, bool], Awaitable[list[c.Rollout]]]
"""(group id, include calls) -> the group's rollouts, as `RolloutStore.list_rollouts` reads them."""


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


class GroupStream:
    def __init__(self, redis: aioredis.Redis, prefix: str, group_rollouts: GroupRollouts
                 ) -> None:
        self.r = redis
        self.p = prefix
        self._rollouts = group_rollouts
        self._publish = redis.register_script(_PUBLISH_LUA)
        self._dead_letter = redis.register_script(_DEAD_LETTER_LUA)

    def _k(self, *parts: str) -> str:
        return self.p + ":".join(parts)

    def _key(self, stream: str) -> str:
        return self._k("stream", stream or "train")

    # publishing -----------------------------------------------------------------------------
    async def end(self, ro: c.Rollout, rollout_ids: Sequence[str], publish: bool = True,
                  pipe: Pipeline | None = None) -> bool:
        """Counts `rollout_ids` of `ro`'s group as ended and, with `publish`, publishes the
        group if every rollout of it has ended now (exactly once); a run with no stream
        publishes nothing. On `pipe` (a transaction after MULTI) both are queued, and the
        publish script's answer is the pipeline's last result. True when the script ran (or
        was queued)."""
        gdone = self._k("gdone", ro.group_id)
        if pipe is not None:
            pipe.sadd(gdone, *rollout_ids)
        else:
            await self.r.sadd(gdone, *rollout_ids)
        if not publish or ro.stream in NO_STREAM:
            return False
        await self._publish(keys=[gdone, self._k("gpub", ro.group_id), self._key(ro.stream)],
                            args=[ro.group_size, ro.group_id, ro.run_id, ro.task_id],
                            client=pipe)
        return True

    # reading --------------------------------------------------------------------------------
    async def _ensure_consumer_group(self, stream_key: str, group: str) -> None:
        try:
            await self.r.xgroup_create(stream_key, group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, stream: str, group: str, consumer: str, max_groups: int,
                   block_ms: int, include_calls: bool, max_deliveries: int = 0,
                   new_only: bool = False) -> list[c.Group]:
        key = self._key(stream)
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
            g.rollouts.extend(await self._rollouts(g.group_id, include_calls))
            groups.append(g)
        return groups

    async def stats(self) -> list[tuple[str, int, list[tuple[str, int, int]]]]:
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
            keys=[self._key(stream), self._k("dead", stream or "train"),
                  self._k("nack", stream or "train", group)],
            args=[group, entry_id, deliveries, time.time(),
                  f"delivered {deliveries} times without being acknowledged"])
        return bool(moved)

    async def nack(self, stream: str, group: str, consumer: str, entry_ids: list[str],
                   reason: str, max_deliveries: int, redeliver: bool,
                   include_calls: bool) -> tuple[list[c.Group], list[str]]:
        """A failed delivery of `entry_ids`: keeps the reason; dead-letters the entries
        delivered `max_deliveries` times; with `redeliver`, delivers the others again (XCLAIM
        counts a delivery). Returns (redelivered groups, dead-lettered entry ids)."""
        key = self._key(stream)
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

    async def dead_letters(self, stream: str, limit: int) -> list[spb.DeadLetter]:
        """The newest `limit` entries of the stream's dead-letter stream, newest first."""
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

    async def trim(self, stream: str, below_entry_id: str) -> tuple[int, str]:
        """Trims the stream below `below_entry_id` (empty: no bound of the caller's), and never
        past the first entry any consumer group has pending or has not read yet."""
        key = self._key(stream)
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

    async def ack(self, stream: str, group: str, entry_ids: Iterable[str]) -> int:
        ids = _check_entry_ids(entry_ids)
        return int(await self.r.xack(self._key(stream), group, *ids)) if ids else 0


def _entries(resp: list) -> list[tuple[str, dict[str, str]]]:  # type: ignore[type-arg]
    out = []
    for _stream, items in resp or []:
        for entry_id, fields in items:
            if fields:  # an entry deleted from the stream shows as empty: skip it
                out.append((entry_id.decode(),
                            {k.decode(): v.decode() for k, v in fields.items()}))
    return out
