"""The gateway's Prometheus series (served at `GET /metrics` on the data plane).

- `harnessrl_gateway_requests_total{route, status}`: requests answered, by route and HTTP status
  (a route the gateway does not have counts as route="other");
- `harnessrl_gateway_request_seconds{route}`: time to the response (for a stream: to its head;
  the stream itself is in the engine's time);
- `harnessrl_gateway_held_requests{route}`: requests waiting now for an engine (paused for a
  weight update, or none reachable);
- `harnessrl_gateway_held_records`: calls waiting now for the store to record them.

The per-request cost is a dict lookup, a counter increment and a histogram observation (a few
microseconds: bench/gateway_overhead.py measures the gateway with them).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from harnessrl.metrics import LATENCY_BUCKETS

REQUESTS = Counter("harnessrl_gateway_requests", "Requests answered, by route and HTTP status",
                   ["route", "status"])
LATENCY = Histogram("harnessrl_gateway_request_seconds",
                    "Time from a request to its response (a stream: to its head), by route",
                    ["route"], buckets=LATENCY_BUCKETS)
HELD = Gauge("harnessrl_gateway_held_requests",
             "Requests waiting now for an engine (paused or unreachable), by route", ["route"])
HELD_RECORDS = Gauge("harnessrl_gateway_held_records",
                     "Calls waiting now for the store to record them")


class RouteMetrics:
    """The labelled children of one route, resolved once (no label lookup per request)."""

    __slots__ = ("route", "latency", "held", "_by_status")

    def __init__(self, route: str) -> None:
        self.route = route
        self.latency = LATENCY.labels(route)
        self.held = HELD.labels(route)
        self._by_status: dict[int, Counter] = {}

    def observe(self, status: int, seconds: float) -> None:
        counter = self._by_status.get(status)
        if counter is None:
            counter = self._by_status[status] = REQUESTS.labels(self.route, str(status))
        counter.inc()
        self.latency.observe(seconds)
