"""Bounded staleness in async and collocated mode: which completed groups a step may train on.

A call served by policy version v may be trained on by the step that updates version s (the
trainer's version when the step starts) only if s - v <= max_staleness. A group is one unit
(its advantages compare its rollouts with each other), so one call too old drops the whole
group: it is taken off the stream, counted, and given a reason ("stale"), never trained.

Why drop rather than down-weight: the loss already corrects each token for the behaviour policy
with the recorded logprobs (truncated importance sampling, `loss.py`); a call beyond the bound
is one the admission rule was meant to prevent, and down-weighting it would still put an
arbitrarily old policy's tokens into the gradient, with weights the IS cap already truncates.
Dropping keeps the bound a guarantee that the metrics can show (staleness_max <= max_staleness).

`select_groups` is the rule, pure: the loop (`loop.train_async`) and the property test
(tests/test_modes.py) both use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from harnessrl.v1 import common_pb2 as c

STALE = "stale"


def call_versions(group: c.Group) -> list[int]:
    """Policy versions of the calls of the group's succeeded rollouts (those trained on)."""
    return [call.policy_version for r in group.rollouts
            if r.status == c.ROLLOUT_STATUS_SUCCEEDED for call in r.calls if not call.aborted]


def group_staleness(group: c.Group, version: int) -> int:
    """The largest `version - v` over the group's trained calls (0 without calls)."""
    return max((version - v for v in call_versions(group)), default=0)


@dataclass
class Selection:
    kept: list[c.Group] = field(default_factory=list)
    dropped: list[tuple[c.Group, str]] = field(default_factory=list)
    rest: list[c.Group] = field(default_factory=list)


def select_groups(completed: Sequence[c.Group], version: int, max_staleness: int,
                  batch: int) -> Selection:
    """The first `batch` groups of `completed` (in completion order) fresh enough to train on at
    `version`; the too-stale ones before them dropped (with a reason), the others left."""
    out = Selection()
    for g in completed:
        if len(out.kept) == batch:
            out.rest.append(g)
            continue
        age = group_staleness(g, version)
        if age > max_staleness:
            out.dropped.append((g, f"{STALE}: a call of policy version {version - age}, "
                                   f"trainer at {version}, max_staleness {max_staleness}"))
        else:
            out.kept.append(g)
    return out
