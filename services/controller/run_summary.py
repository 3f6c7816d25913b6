"""What a run's record says of its rollouts (the counts, the mean reward, the tampered ones),
and the log line each finished rollout gets."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from harnessrl.v1 import common_pb2 as c

log = logging.getLogger("harnessrl.controller")


def summary(run: c.Run, rollouts: Iterable[c.Rollout]) -> c.Run:
    """A copy of `run` with its counts and mean reward (over succeeded, rewarded rollouts)."""
    out = c.Run()
    out.CopyFrom(run)
    ros = list(rollouts)
    by_status = [ro.status for ro in ros]
    out.num_rollouts = len(by_status)
    out.num_succeeded = by_status.count(c.ROLLOUT_STATUS_SUCCEEDED)
    out.num_failed = by_status.count(c.ROLLOUT_STATUS_FAILED)
    out.num_cancelled = by_status.count(c.ROLLOUT_STATUS_CANCELLED)
    out.num_running = by_status.count(c.ROLLOUT_STATUS_RUNNING)
    rewards = [ro.reward for ro in ros
               if ro.status == c.ROLLOUT_STATUS_SUCCEEDED and ro.has_reward]
    out.mean_reward = sum(rewards) / len(rewards) if rewards else 0.0
    out.num_tampered = sum(ro.tampered for ro in ros)
    return out


def log_finished(ro: c.Rollout, run: c.Run, extra: Mapping[str, object]) -> None:
    """The line of a rollout that reached a terminal status, with the run's progress."""
    done = run.num_succeeded + run.num_failed + run.num_cancelled
    log.info("rollout %s %s%s%s; run %d/%d done (%d succeeded, %d failed, %d cancelled), "
             "mean reward %.3f", ro.rollout_id, c.RolloutStatus.Name(ro.status),
             " TAMPERED" if ro.tampered else "",
             f" reward={ro.reward:g}" if ro.has_reward
             else f": {ro.error}" if ro.error else " (no reward)",
             done, run.num_rollouts, run.num_succeeded, run.num_failed, run.num_cancelled,
             run.mean_reward, extra={**extra, "rollout": ro.rollout_id, "attempt": ro.attempt})
