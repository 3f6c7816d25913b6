"""The chaos run's accounting: every rollout the run should have made, checked against what
Redis holds and what the trainer claims, with each drop tied to a kill. It trusts none of the
services under test for the figures it checks; each source is read directly:

- **expected** (from outside the stack): the rule the trainer documents for its tasks
  (`services/trainer/rollouts.py`), recomputed here: sync step s draws
  `random.Random(f"{seed}:{s}").sample(tasks, min(k, len(tasks)))` from the task file (ids by
  `harnessrl.tasks`), its run is `<prefix>-step<s:06d>` and rollout i of task t is
  `<run>/<t>/<i>` (i < group_size). Async: one run `<prefix>-async` of the steps' tasks in step
  order, `pool_factor x steps x k + (max_staleness + 1) x k` of them, ids `s<step:06d>-<id>`.
  The prefix is the one name the trainer draws (`run.json`). Kept steps: 1 .. the step of the
  final checkpoint (`checkpoints/latest`), i.e. the steps the final model contains.
- **in the store**: the rollout records (`<P>ro:<id>`), the completed-group stream
  (`<P>stream:train`), its consumer group (`trainer`: last-delivered id, pending entries) and
  the dead-letter stream (`<P>dead:train`), read from Redis with redis-py, not through the store
  service. An entry is *acknowledged* when the group has delivered it (id <= last-delivered-id)
  and it is not pending; a dead-lettered entry is acknowledged too, and counts as dropped.
- **the trainer's claims**: `trained_rollouts` / `dropped_rollouts` of `metrics.jsonl` (the
  lines of the kept steps).
- **when each attempt ran**: the chaos harness's own log (`chaos_harness.py`), written by the
  harness processes, outside the stack's state.

A rollout is **lost** when it is expected and its record is not in the store. **trained**: the
trainer claims it trained and its group's entry is acknowledged (not dead-lettered); a claim
without that acknowledgement fails ("claimed, never acknowledged"), and so does an
acknowledged entry whose rollouts the trainer claims neither trained nor dropped. **trained
twice**: claimed by two kept steps. A group published twice, an entry left pending or never
delivered (sync), a rollout or run of the trainer's prefix that is not expected, all fail.

**Drops only where a kill explains them.** A kill's window is [kill, back]: from the kill -9
(wall clock, `time.time()`) until the driver saw that service serving again (engine: until the
trainer, which the supervisor restarts to push its weights into the engine, serves again). An
attempt is in flight over [its start, its end] from the harness log (an attempt with a start
but no end line, its wrapper killed, is in flight until the run ended). A dropped rollout is
explained when every attempt the store records for it has a start line in the harness log and
was in flight during some kill's window; a succeeded rollout dropped with its group ("group
too_few_rollouts") is explained by the kills that explain its group's failed rollouts; a
dead-lettered group by the trainer's deaths (it needs deliveries - 1 of them). Each drop is
reported with its kill(s); any other drop fails, but one: a group whose succeeded rollouts all
have the same reward in the store ("group zero_variance") is dropped by design, and counted. In async mode two drops are the mode's own:
"stale" (bounded staleness) and the surplus (groups not taken when training ended: cancelled,
pending or never delivered); they are counted, not tied to kills.

**A step redone after a trainer crash** (the trainer died after the step's run, before its
checkpoint) reuses its run: run ids are deterministic and CreateRun is idempotent, so the redo
re-attaches to the same run and the same rollouts; their groups, delivered before the crash and
not acknowledged, are delivered again and trained by the redo, and the first life's
metrics.jsonl line is dropped on resume. So its rollouts are expected exactly once, like any
other kept step's: trained (once) or dropped with a kill's explanation.
"""

from __future__ import annotations

import json
import re
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from harnessrl.tasks import load_task_file
from harnessrl.v1 import common_pb2 as c

STREAM, CONSUMER_GROUP = "train", "trainer"
SUCCEEDED = c.ROLLOUT_STATUS_SUCCEEDED


@dataclass
class KillWindow:
    service: str
    at: float  # time.time() of the kill -9
    back: float | None  # time.time() it served again (None: never)
    label: str = ""  # e.g. "gateway@12.3s"

    def covers(self, start: float, end: float) -> bool:
        back = float("inf") if self.back is None else self.back
        return start <= back and end >= self.at


# -- the expected set ------------------------------------------------------------------------
def step_task_ids(tasks_file: Path, seed: int, step: int, k: int) -> list[str]:
    """The trainer's documented rule: k tasks without replacement, seeded by "seed:step"."""
    tasks = [{**data, "id": tid} for tid, data in load_task_file(tasks_file)]
    return [str(t["id"]) for t in random.Random(f"{seed}:{step}").sample(tasks,
                                                                          min(k, len(tasks)))]


def expected_sync(tasks_file: Path, seed: int, steps: int, k: int, group_size: int,
                  prefix: str) -> dict[str, int]:
    """rollout id -> its step, for steps 1..steps."""
    out = {}
    for s in range(1, steps + 1):
        run = f"{prefix}-step{s:06d}"
        for t in step_task_ids(tasks_file, seed, s, k):
            out.update({f"{run}/{t}/{i}": s for i in range(group_size)})
    return out


def expected_async(tasks_file: Path, seed: int, steps: int, k: int, group_size: int,
                   prefix: str, pool_factor: float, max_staleness: int) -> dict[str, int]:
    """rollout id -> the step whose tasks it was drawn as (the pool's order)."""
    total = int(pool_factor * steps * k) + (max_staleness + 1) * k
    run, out, s, n = f"{prefix}-async", {}, 0, 0
    while n < total:
        s += 1
        for t in step_task_ids(tasks_file, seed, s, k)[:total - n]:
            out.update({f"{run}/s{s:06d}-{t}/{i}": s for i in range(group_size)})
            n += 1
    return out


def kept_steps(output_dir: Path) -> int:
    """The step of the final checkpoint (0: none)."""
    latest = Path(output_dir) / "checkpoints" / "latest"
    if not latest.exists():
        return 0
    return int(latest.read_text().strip().rsplit("-", 1)[-1])


# -- the sources -----------------------------------------------------------------------------
@dataclass
class Attempt:
    start: float
    end: float | None = None
    exit: int | None = None


def read_harness_log(path: Path) -> dict[str, dict[int, Attempt]]:
    """rollout id -> attempt -> when it ran (the chaos harness's log)."""
    out: dict[str, dict[int, Attempt]] = {}
    if not Path(path).exists():
        return out
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        atts = out.setdefault(r["rollout_id"], {})
        if r["event"] == "start":
            atts.setdefault(r["attempt"], Attempt(r["time"]))
        else:
            a = atts.setdefault(r["attempt"], Attempt(r["start"]))
            a.end, a.exit = r["time"], r["exit"]
    return out


@dataclass
class Entry:
    entry_id: str
    group_id: str
    run_id: str
    acked: bool
    pending: bool
    dead_reason: str | None = None
    deliveries: int = 0


@dataclass
class RedisView:
    rollouts: dict[str, c.Rollout]  # the expected ones found, and the prefix's others
    runs: list[str]  # run ids of the prefix
    entries: list[Entry]  # the stream's, of the prefix's runs
    # policy versions of the calls (not aborted) of each succeeded rollout's last attempt, as
    # the gateway recorded them (`P calls:{rollout}:{attempt}`)
    versions: dict[str, list[int]] = field(default_factory=dict)


def _id(x: Any) -> tuple[int, int]:
    s = x.decode() if isinstance(x, bytes) else str(x)
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def read_redis(url: str, key_prefix: str, run_prefix: str, expected: set[str]) -> RedisView:
    r: Any = redis.Redis.from_url(url)  # untyped replies: bytes throughout
    try:
        ids = set(expected)
        for key in r.scan_iter(match=f"{key_prefix}ro:{run_prefix}-*", count=1000):
            ids.add(key.decode()[len(key_prefix) + 3:])
        order = sorted(ids)
        datas = r.mget([f"{key_prefix}ro:{i}" for i in order]) if order else []
        rollouts = {i: c.Rollout.FromString(d) for i, d in zip(order, datas) if d is not None}
        runs = [x.decode() for x in r.zrange(f"{key_prefix}runs", 0, -1)
                if x.decode().startswith(run_prefix + "-")]
        skey = f"{key_prefix}stream:{STREAM}"
        entries: list[Entry] = []
        if r.exists(skey):
            groups = {g["name"].decode(): g for g in r.xinfo_groups(skey)}
            g = groups.get(CONSUMER_GROUP)
            last = _id(g["last-delivered-id"]) if g else (0, 0)
            pend = {p["message_id"].decode(): int(p["times_delivered"])
                    for p in r.xpending_range(skey, CONSUMER_GROUP, "-", "+", 100_000)} \
                if g else {}
            dead = {}
            for _, f in r.xrange(f"{key_prefix}dead:{STREAM}"):
                f = {k.decode(): v.decode() for k, v in f.items()}
                dead[f["original_entry_id"]] = (f.get("reason", ""), int(f.get("deliveries", 0)))
            for eid, f in r.xrange(skey):
                f = {k.decode(): v.decode() for k, v in f.items()}
                if not f.get("run_id", "").startswith(run_prefix + "-"):
                    continue
                e = eid.decode()
                delivered = _id(e) <= last
                d = dead.get(e)
                entries.append(Entry(e, f["group_id"], f["run_id"],
                                     acked=delivered and e not in pend, pending=e in pend,
                                     dead_reason=d[0] if d else None,
                                     deliveries=d[1] if d else pend.get(e, 0)))
        succeeded = [(i, ro.attempt) for i, ro in rollouts.items() if ro.status == SUCCEEDED]
        pipe = r.pipeline(transaction=False)
        for i, attempt in succeeded:
            pipe.hvals(f"{key_prefix}calls:{i}:{attempt}")
        versions = {i: [call.policy_version for call in map(c.Call.FromString, raw)
                        if not call.aborted]
                    for (i, _), raw in zip(succeeded, pipe.execute() if succeeded else [])}
        return RedisView(rollouts, runs, entries, versions)
    finally:
        r.close()


@dataclass
class Claims:
    trained: Counter[str] = field(default_factory=Counter)
    dropped: dict[str, str] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    # the trainer's version at the start of the step that dropped each rollout (its row's
    # behaviour_version): what a stale drop's "trainer at" must say
    dropped_at: dict[str, int] = field(default_factory=dict)


def read_claims(metrics_file: Path) -> Claims:
    out = Claims()
    for line in Path(metrics_file).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.steps.append(row["step"])
            out.trained.update(row.get("trained_rollouts", []))
            out.dropped.update(row.get("dropped_rollouts", {}))
            out.dropped_at.update({rid: row.get("behaviour_version", -1)
                                   for rid in row.get("dropped_rollouts", {})})
    return out


# -- the accounting --------------------------------------------------------------------------
@dataclass
class Accounting:
    expected: int = 0
    rollouts_in: int = 0
    trained: int = 0
    drops: list[dict[str, Any]] = field(default_factory=list)  # rollout, reason, kills
    by_design: dict[str, int] = field(default_factory=dict)  # zero_variance; async: stale, surplus
    trained_twice: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def dropped_by_reason(self) -> dict[str, int]:
        return dict(Counter(d["reason"] for d in self.drops))


ZERO_VARIANCE = "group zero_variance"


def equal_rewards(rid: str, rollouts: dict[str, c.Rollout]) -> bool:
    """A drop the trainer makes by design (`advantage.filter_zero_variance`), read from the
    store: `rid` is usable (succeeded, rewarded) and every usable rollout of its group, at
    least 2 of them (fewer is the trainer's "too_few_rollouts"), has exactly the same reward
    (the trainer's test, `advantages.is_zero_variance`), so the group carries no learning
    signal. No kill is needed to explain it."""
    def usable(x: c.Rollout) -> bool:
        return x.status == SUCCEEDED and x.has_reward
    ro = rollouts[rid]
    rewards = [x.reward for x in rollouts.values() if x.group_id == ro.group_id and usable(x)]
    return usable(ro) and len(rewards) >= 2 and all(r == rewards[0] for r in rewards)


def _why_failed(ro: c.Rollout) -> str:
    err = ro.error or "; ".join(a.error for a in ro.attempts if a.error) or "no error recorded"
    return f"{c.RolloutStatus.Name(ro.status).removeprefix('ROLLOUT_STATUS_').lower()}: " \
           f"{err[:120]}"


_STALE = re.compile(r"^stale: a call of policy version (\d+), trainer at (\d+), "
                    r"max_staleness (\d+)$")


def _stale_problem(rid: str, why: str, versions: list[int], trainer_at: int | None,
                   max_staleness: int | None) -> str | None:
    """Why a "stale" drop does not hold against the calls the gateway recorded for the group
    (its succeeded rollouts'), or None: the claimed oldest version must be the oldest recorded
    and too old for the trainer's version; that version must be the dropping step's
    `behaviour_version` (`trainer_at`) and the bound the run's `max_staleness`."""
    m = _STALE.match(why)
    if m is None:
        return f"stale drop of {rid} with a reason of no known form: {why!r}"
    oldest, trainer, bound = (int(x) for x in m.groups())
    if trainer_at is not None and trainer != trainer_at:
        return f"stale drop of {rid}: the reason says trainer at {trainer}, the step that " \
               f"dropped it started at version {trainer_at}"
    if max_staleness is not None and bound != max_staleness:
        return f"stale drop of {rid}: the reason's max_staleness {bound} is not the run's " \
               f"{max_staleness}"
    if trainer - oldest <= bound:
        return f"stale drop of {rid}: version {oldest} at trainer {trainer} is within " \
               f"max_staleness {bound}"
    if min(versions, default=None) != oldest:
        return f"stale drop of {rid}: the trainer names a call of version {oldest}, the " \
               f"gateway recorded the group's calls at versions {sorted(set(versions))}"
    return None


def account(expected: dict[str, int], view: RedisView, claims: Claims,
            harness: dict[str, dict[int, Attempt]], kills: list[KillWindow], run_end: float,
            mode: str = "sync", trainer_deaths: int = 0,
            max_staleness: int | None = None) -> Accounting:
    """See the module docstring. `trainer_deaths`: times the trainer died (killed, or killed
    by the supervisor after an engine restart); `max_staleness`: the run's (async), which a
    stale drop's reason must name."""
    acc = Accounting(expected=len(expected))
    bad = acc.problems.append
    # the store's record of every expected rollout; nothing else of the prefix
    drop: dict[str, Any]
    acc.lost = sorted(set(expected) - set(view.rollouts))
    for rid in acc.lost:
        bad(f"lost: rollout {rid} is expected (step {expected[rid]}) but not in the store")
    for rid in sorted(set(view.rollouts) - set(expected)):
        bad(f"unexpected rollout {rid} in the store")
    runs = {rid.rsplit("/", 2)[0] for rid in expected}
    for run in sorted(set(view.runs) - runs):
        bad(f"unexpected run {run} in the store")
    acc.rollouts_in = len(set(expected) & set(view.rollouts))
    # the stream: one entry per group, each acknowledged (sync), none unknown
    by_group: dict[str, list[Entry]] = {}
    for x in view.entries:
        by_group.setdefault(x.group_id, []).append(x)
    for gid, es in by_group.items():
        if len(es) > 1:
            bad(f"group {gid} published {len(es)} times: entries {[x.entry_id for x in es]}")
    entry = {gid: es[0] for gid, es in by_group.items()}
    groups = {rid.rsplit("/", 1)[0] for rid in expected}
    for gid in sorted(set(entry) - groups):
        bad(f"unexpected group {gid} in the stream")

    def group_of(rid: str) -> str:
        return rid.rsplit("/", 1)[0]

    # trained: claimed, and acknowledged in Redis
    for rid, n in claims.trained.items():
        if n > 1:
            acc.trained_twice.append(rid)
            bad(f"trained twice: rollout {rid} is claimed by {n} kept steps")
        ce = entry.get(group_of(rid))
        if ce is None or not ce.acked or ce.dead_reason is not None:
            state = "no stream entry" if ce is None else "dead-lettered" if ce.dead_reason \
                is not None else "pending" if ce.pending else "never delivered"
            bad(f"claimed, never acknowledged: the trainer claims rollout {rid} trained, but "
                f"its group's entry is not acknowledged in Redis ({state})")
        elif rid in expected and rid in view.rollouts:
            acc.trained += 1
    # every expected rollout in the store: trained, or dropped with a kill that explains it
    explained_by: dict[str, list[str]] = {}

    def attempt_kills(rid: str, ro: c.Rollout) -> list[str] | None:
        """Kills explaining every attempt of `rid`; None when one attempt has none."""
        found: list[str] = []
        ran = harness.get(rid, {})
        for n in range(1, max(ro.attempt, len(ro.attempts)) + 1):
            a = ran.get(n)
            if a is None:
                return None
            ks = [k.label for k in kills if k.covers(a.start, a.end or run_end)]
            if not ks:
                return None
            found += [k for k in ks if k not in found]
        return found or None

    for rid in sorted(set(expected) & set(view.rollouts)):
        ro = view.rollouts[rid]
        if claims.trained.get(rid):
            if ro.status != SUCCEEDED:
                bad(f"rollout {rid} is claimed trained but is {_why_failed(ro)}")
            continue
        e = entry.get(group_of(rid))
        if e is None:
            if mode != "sync" and ro.status not in (SUCCEEDED, c.ROLLOUT_STATUS_FAILED):
                acc.by_design["surplus"] = acc.by_design.get("surplus", 0) + 1
                continue
            bad(f"rollout {rid} ({_why_failed(ro) if ro.status != SUCCEEDED else 'succeeded'})"
                " is neither trained nor in the stream")
            continue
        if not e.acked:
            if mode != "sync":
                acc.by_design["surplus"] = acc.by_design.get("surplus", 0) + 1
                continue
            bad(f"rollout {rid}: its group's entry {e.entry_id} is "
                f"{'pending' if e.pending else 'never delivered'} at the end, not trained")
            continue
        if e.dead_reason is not None:
            reason = f"dead-lettered after {e.deliveries} deliveries: {e.dead_reason[:100]}"
            ks = [k.label for k in kills if k.service in ("trainer",) or
                  k.service.startswith("engine")]
            drop = {"rollout": rid, "reason": reason,
                    "kills": ks if trainer_deaths >= max(1, e.deliveries - 1) else []}
        elif rid in claims.dropped:
            why = claims.dropped[rid]
            if why == ZERO_VARIANCE:
                if equal_rewards(rid, view.rollouts):
                    acc.by_design["zero_variance"] = acc.by_design.get("zero_variance", 0) + 1
                else:
                    bad(f"rollout {rid} dropped as {why}, but its group's succeeded rollouts "
                        "have different rewards in the store")
                continue
            if mode != "sync" and why.startswith("stale"):
                group = [view.versions.get(r, []) for r in view.rollouts
                         if group_of(r) == group_of(rid)]
                if problem := _stale_problem(rid, why, [v for vs in group for v in vs],
                                             claims.dropped_at.get(rid), max_staleness):
                    bad(problem)
                else:
                    acc.by_design["stale"] = acc.by_design.get("stale", 0) + 1
                continue
            reason = why if ro.status == SUCCEEDED else _why_failed(ro) if why == "failed" \
                else f"{why}: {_why_failed(ro)}"
            drop = {"rollout": rid, "reason": reason, "kills": None}
        else:
            bad(f"acknowledged, not claimed: rollout {rid}'s group entry {e.entry_id} is "
                "acknowledged but the trainer claims it neither trained nor dropped")
            continue
        if drop["kills"] is None:
            drop["kills"] = attempt_kills(rid, ro) or []
        explained_by[rid] = drop["kills"]
        acc.drops.append(drop)
    # a succeeded rollout dropped with its group: explained by the group's failed rollouts
    for d in acc.drops:
        ro = view.rollouts[d["rollout"]]
        if ro.status == SUCCEEDED and d["reason"].startswith("group too_few") and not d["kills"]:
            failed = [r for r in expected if group_of(r) == ro.group_id and r in view.rollouts
                      and view.rollouts[r].status != SUCCEEDED]
            expl = [explained_by.get(r) or [] for r in failed]
            if failed and all(expl):
                d["kills"] = sorted({k for x in expl for k in x})
    for d in acc.drops:
        if not d["kills"]:
            ran = {n: (a.start, a.end) for n, a in harness.get(d["rollout"], {}).items()}
            bad(f"drop without a kill: rollout {d['rollout']} dropped ({d['reason']}); "
                f"its attempts ran {ran or 'never (no harness log line)'}, no kill window "
                "covers them")
    return acc
