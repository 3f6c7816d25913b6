"""The controller's Prometheus series (served on `metrics_bind`).

- `harnessrl_controller_rollouts{state}`: rollouts of the runs this controller executed, by
  their state now (PENDING, RUNNING, SUCCEEDED, ...);
- `harnessrl_controller_job_launch_seconds{backend}`: time to launch one harness job (a local
  process group started, a Kubernetes Job and its Secret created);
- `harnessrl_controller_job_launches_total{backend, outcome}`: launches, ok or failed;
- `harnessrl_controller_rewards_tampered_total{policy}`: rollouts a grader found tampered
  (`"tampered": true`), by what their run's `tampered_rewards` made of their reward: zero,
  penalty or drop (tampered_rewards.py).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from harnessrl.metrics import LATENCY_BUCKETS
from harnessrl.v1 import common_pb2 as c

ROLLOUTS = Gauge("harnessrl_controller_rollouts",
                 "Rollouts of the runs this controller executed, by state", ["state"])
JOB_LAUNCH = Histogram("harnessrl_controller_job_launch_seconds",
                       "Time to launch one harness job, by job backend", ["backend"],
                       buckets=LATENCY_BUCKETS)
JOB_LAUNCHES = Counter("harnessrl_controller_job_launches", "Harness job launches",
                       ["backend", "outcome"])
TAMPERED = Counter("harnessrl_controller_rewards_tampered",
                   "Rollouts a grader found tampered, by the run's tampered_rewards policy",
                   ["policy"])
_STATES: dict[int, str] = {v: c.RolloutStatus.Name(v).removeprefix("ROLLOUT_STATUS_")
                           for v in c.RolloutStatus.values()}


def rollout_state_changed(old: int | None, new: int | None) -> None:
    """A rollout moved from state `old` to `new` (None: it was not counted / is no more)."""
    if old == new:
        return
    if old is not None:
        ROLLOUTS.labels(_STATES.get(old, str(old))).dec()
    if new is not None:
        ROLLOUTS.labels(_STATES.get(new, str(new))).inc()
