"""The rollout and run statuses after which nothing changes: one definition for every service
and the CLI."""

from __future__ import annotations

from harnessrl.v1 import common_pb2 as c

TERMINAL = (c.ROLLOUT_STATUS_SUCCEEDED, c.ROLLOUT_STATUS_FAILED, c.ROLLOUT_STATUS_CANCELLED)
RUN_TERMINAL = (c.RUN_STATUS_SUCCEEDED, c.RUN_STATUS_FAILED, c.RUN_STATUS_CANCELLED)
