"""Whether the gateway can serve at all, for gRPC health and HTTP `/health`.

It cannot while no engine is registered, or once the store (its process, or the store's Redis:
the store's own health) has been unavailable for longer than `hold_timeout_s` — calls are held
that long, then answered 503. A paused engine counts as usable: holding calls during a weight
push is normal work. Nor while it joins other replicas or catches up (`replicas.py`).
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from harnessrl import rpc
from services.gateway.engines import EngineRegistry


class GatewayReadiness:
    def __init__(self, registry: EngineRegistry, store_channel: grpc.aio.Channel,
                 hold_timeout_s: float, probe_timeout_s: float = 2.0) -> None:
        self.registry = registry
        self.store_channel = store_channel
        self.hold_timeout_s = hold_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.store_down_since: float | None = None
        self.ok, self.reason = True, ""
        self.replicas: Any = None  # replicas.ReplicaSet: not ready while joining or stale
        self.stopping = False  # SIGTERM: draining, send new calls to the other replicas

    async def check(self) -> tuple[bool, str]:
        store_ok, why = await rpc.peer_serving(self.store_channel, self.probe_timeout_s)
        now = time.monotonic()
        if store_ok:
            self.store_down_since = None
        elif self.store_down_since is None:
            self.store_down_since = now
        problems = ["shutting down"] if self.stopping else []
        if not self.registry.engines:
            problems.append("no engine registered")
        if self.store_down_since is not None and \
                now - self.store_down_since >= self.hold_timeout_s:
            problems.append(f"store unavailable for {now - self.store_down_since:.0f}s "
                            f"(hold_timeout_s {self.hold_timeout_s:g}): {why}")
        if self.replicas is not None and not self.replicas.ready:
            problems.append(self.replicas.why_not_ready())
        self.ok, self.reason = not problems, "; ".join(problems)
        return self.ok, self.reason
