"""Chaos on the real stack, bounded for CI: four training steps of the example (Redis with AOF,
vLLM, store, gateway, controller, trainer) while the store, gateway, controller, Redis and the
trainer are each killed with kill -9 once, in the phase each is meant to hit (harnesses in
flight; groups delivered and not yet acknowledged), and restarted by the supervisor; first, the
two gateway replicas behind the stack's balancer are restarted one after the other (SIGTERM,
as a rolling update does it), which may lose nothing. Every
rollout the run should have made (derived from the seed and the task file, not read from the
stack) must be in the store and trained once (acknowledged in Redis), or dropped with a kill
that explains it (`harnessrl.testing.chaos_accounting`). The run is made once; the accounting is
then shown to fail on a store that lost a rollout record and on a trainer that claims what it
never acknowledged, on that run's own state. That it trained is read from outside the
trainer too: the engine's logprobs of a fixed probe moved from the base model's and equal
the last checkpoint's, computed offline. The async mode goes through the same kills in a run
of its own (its stale drops held against the recorded call versions). `bench/chaos.py` runs
the long form."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from harnessrl import procs
from harnessrl.testing import chaos_accounting as ca, trained_probe
from harnessrl.testing.chaos import KEY_PREFIX, KILL_ORDER, ChaosInputs, ChaosResult, run_chaos

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
# Four: Redis and the trainer are each killed in a step's "groups pending" window (its groups
# read, not yet acknowledged: ~0.6 s of a ~9 s step here), one window each, after the three
# harness-phase kills have recovered (~20 s). With three steps a quiet machine finished the run
# before the trainer's window came (the kills ran on time; the run was too short for them).
STEPS = 4
KILLS = ("gateways", *KILL_ORDER)  # "gateways": the rolling restart of both replicas


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
          ) -> Iterator[tuple[ChaosResult, str]]:
    """One chaos run; then its Redis started again on its AOF (the stack is down)."""
    tmp = tmp_path_factory.mktemp("chaos")
    # the session's warmed tiny model: an un-warmed one scores 0 on every rollout, so every
    # advantage is 0 and no step moves the weights the probe test reads
    res = run_chaos(tmp, tiny_model_dir, seed=11, steps=STEPS, timeout_s=600, kill_order=KILLS,
                    gateway_replicas=2)
    print("chaos accounting:", json.dumps(res.line()))
    for e in res.events:
        print("  supervisor:", e)
    assert res.inputs is not None
    url, proc = procs.start_redis(res.inputs.redis_dir, res.inputs.redis_port)
    try:
        yield res, url
    finally:
        proc.stop()


def test_kill_each_service_during_training_every_rollout_accounted(
        chaos: tuple[ChaosResult, str]) -> None:
    res, _ = chaos
    assert [k.service for k in res.kills] == list(KILLS), \
        f"planned kills not done: {res.line()}"
    assert all(k.back is not None for k in res.kills), res.line()
    assert res.trainer_exit == 0, res.events
    assert res.steps == STEPS
    assert res.acc.problems == []
    assert all(d["kills"] for d in res.acc.drops), res.acc.drops


def test_a_rolling_restart_of_both_gateways_loses_nothing(chaos: tuple[ChaosResult, str]
                                                          ) -> None:
    """The rolling restart excuses no drop (no kill window): every rollout whose attempts ran
    through it was trained, unless a later kill explains its drop."""
    res, _ = chaos
    inputs = _inputs(res)
    [rolling] = [k for k in res.kills if k.service == "gateways"]
    assert rolling.back is not None and not rolling.excuses
    assert "gateways" not in [w.service for w in inputs.windows]
    ran = ca.read_harness_log(inputs.harness_log)
    through = {rid for rid, attempts in ran.items() for a in attempts.values()
               if a.start <= rolling.back and (a.end or inputs.run_end) >= rolling.at}
    assert through, "no harness was in flight during the rolling restart"
    trained = set(ca.read_claims(inputs.metrics_file).trained)
    dropped = {d["rollout"] for d in res.acc.drops}
    assert through <= trained | dropped and not (through & dropped - {
        r for r in through if _in_a_kill_window(inputs, r)}), (through, res.acc.drops)


def test_the_engine_serves_trained_weights_the_last_checkpoint_reproduces(
        chaos: tuple[ChaosResult, str]) -> None:
    """Training seen from outside the trainer (harnessrl/testing/trained_probe.py): the
    engine's logprobs of a fixed probe, asked over HTTP at the end, moved from the base
    model's and equal the last checkpoint's computed offline. The check fails for a trainer
    that claims steps it never pushed (the engine serving the base weights) and for a
    checkpoint that is not what the engine serves, on this run's own numbers."""
    res, _ = chaos
    assert res.probe is not None and res.probe.checkpoint
    assert trained_probe.check(res.probe) == []
    engine = torch.tensor(res.probe.engine, dtype=torch.float64)
    base = trained_probe.offline(res.probe.base, res.probe.ids)
    ckpt = trained_probe.offline(res.probe.checkpoint, res.probe.ids)
    never_pushed = trained_probe.problems(base, base, ckpt)  # (nor the checkpoint served)
    assert any("nothing trained was pushed" in p for p in never_pushed), never_pushed
    [not_served] = trained_probe.problems(engine, base, base)
    assert "not what the engine serves" in not_served


def _inputs(res: ChaosResult) -> ChaosInputs:
    assert res.inputs is not None
    return res.inputs


def _a_trained_rollout(inputs: ChaosInputs) -> str:
    return sorted(ca.read_claims(inputs.metrics_file).trained)[0]


def _in_a_kill_window(inputs: ChaosInputs, rid: str) -> bool:
    ran = ca.read_harness_log(inputs.harness_log).get(rid, {})
    return any(k.covers(a.start, a.end or inputs.run_end) for a in ran.values()
               for k in inputs.windows)


def _claim_dropped(inputs: ChaosInputs, rid: str, tmp_path: Path) -> ChaosInputs:
    """The trainer's claims with `rid` moved from trained to dropped ("failed")."""
    rows = [json.loads(x) for x in inputs.metrics_file.read_text().splitlines()]
    for row in rows:
        if rid in row["trained_rollouts"]:
            row["trained_rollouts"].remove(rid)
            row["dropped_rollouts"][rid] = "failed"
    claims = tmp_path / "metrics.jsonl"
    claims.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return dataclasses.replace(inputs, metrics_file=claims)


def test_chaos_accounting_ties_a_drop_to_the_kill_it_ran_through(
        chaos: tuple[ChaosResult, str], tmp_path: Path) -> None:
    res, url = chaos
    inputs = _inputs(res)
    rid = next(r for r in sorted(ca.read_claims(inputs.metrics_file).trained)
               if _in_a_kill_window(inputs, r))
    acc = _claim_dropped(inputs, rid, tmp_path).account(url)
    assert acc.problems == []
    [drop] = acc.drops
    assert drop["rollout"] == rid and drop["kills"]


@pytest.mark.parametrize("fault", ["store loses a rollout record",
                                   "trainer claims a rollout never acknowledged",
                                   "a trained group un-acknowledged in Redis",
                                   "trainer drops a rollout no kill explains"])
def test_chaos_accounting_fails_on(fault: str, chaos: tuple[ChaosResult, str],
                                   tmp_path: Path) -> None:
    res, url = chaos
    inputs = _inputs(res)
    assert inputs.account(url).problems == []  # the run's own state, read again: it passes
    r: Any = redis.Redis.from_url(url)  # untyped replies: bytes throughout
    skey, group = f"{KEY_PREFIX}stream:{ca.STREAM}", ca.CONSUMER_GROUP
    undo: Any = None
    if fault == "store loses a rollout record":
        victim = _a_trained_rollout(inputs)
        key = f"{KEY_PREFIX}ro:{victim}"
        dump = r.dump(key)
        r.delete(key)

        def undo() -> None:
            r.restore(key, 0, dump)
        expect = "lost"
    elif fault == "trainer claims a rollout never acknowledged":
        rows = [json.loads(x) for x in inputs.metrics_file.read_text().splitlines()]
        task = next(iter(rows[-1]["trained_rollouts"])).rsplit("/", 2)[1]
        victim = f"{inputs.run_prefix}-step{STEPS + 1:06d}/{task}/0"  # a run never made
        rows[-1]["trained_rollouts"].append(victim)
        claims = tmp_path / "metrics.jsonl"
        claims.write_text("".join(json.dumps(x) + "\n" for x in rows))
        inputs = dataclasses.replace(inputs, metrics_file=claims)
        expect = "claimed, never acknowledged"
    elif fault == "trainer drops a rollout no kill explains":
        victim = next(r for r in sorted(ca.read_claims(inputs.metrics_file).trained)
                      if not _in_a_kill_window(inputs, r))
        inputs = _claim_dropped(inputs, victim, tmp_path)
        expect = "drop without a kill"
    else:  # the entry delivered again (pending, as if never acknowledged): XGROUP SETID below
        # it, one XREADGROUP, then the group's position put back
        victim = _a_trained_rollout(inputs)
        gid = victim.rsplit("/", 1)[0]
        eid = next(e for e, f in r.xrange(skey) if f[b"group_id"].decode() == gid).decode()
        last = next(g for g in r.xinfo_groups(skey)
                    if g["name"].decode() == group)["last-delivered-id"]
        ms, seq = (int(x) for x in eid.split("-"))
        r.xgroup_setid(skey, group, f"{ms}-{seq - 1}" if seq else f"{ms - 1}-18446744073709551615")
        assert r.xreadgroup(group, "chaos-test", {skey: ">"}, count=1)[0][1][0][0].decode() == eid
        r.xgroup_setid(skey, group, last)

        def undo() -> None:
            r.xack(skey, group, eid)
        expect = "claimed, never acknowledged"
    try:
        acc = inputs.account(url)
    finally:
        if undo is not None:
            undo()
        r.close()
    assert [p for p in acc.problems if p.startswith(expect) and victim in p], acc.problems


def test_async_mode_under_chaos_every_rollout_accounted_and_trained(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """The async mode (the pool: rollouts keep running while the trainer trains and pushes)
    through the same kills, one round: every rollout its pool could have made is trained,
    dropped with a kill that explains it, or by design (stale: held against the recorded
    call versions; surplus at the end), and the engine serves the trained weights."""
    res = run_chaos(tmp_path, tiny_model_dir, seed=5, steps=STEPS, timeout_s=600,
                    kill_order=KILL_ORDER, mode="async")
    print("async chaos accounting:", json.dumps(res.line()))
    assert [k.service for k in res.kills] == list(KILL_ORDER), res.line()
    assert res.trainer_exit == 0, res.events
    assert res.steps == STEPS
    assert res.acc.problems == [], res.acc.problems
    assert res.acc.trained > 0 and all(d["kills"] for d in res.acc.drops), res.line()
    assert res.probe is not None and trained_probe.check(res.probe) == []
