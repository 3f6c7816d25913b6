"""The gateway's Prometheus series (served at `GET /metrics` on the data plane).

- `harnessrl_gateway_requests_total{route, status}`: requests answered, by route and HTTP status
  (a route the gateway does not have counts as route="other");
- `harnessrl_gateway_request_seconds{route}`: time to the response (for a stream: to its head;
  the stream itself is in the engine's time);
- `harnessrl_gateway_held_requests{route}`: requests waiting now for an engine (paused for a
  weight update, or none reachable);
- `harnessrl_gateway_held_records`: calls waiting now for the store to record them;
- `harnessrl_gateway_forwarded_calls_total`: calls this replica forwarded to the replica that
  owns their rollout (ownership.py).

The per-request cost is a few additions to plain numbers (`RouteMetrics.observe`, 0.2 us):
the first two series are made from them when scraped (`_RouteSeries`), the same lines
prometheus-client's Counter and Histogram write (whose increments, each under a lock, took
1.2 us a request; tests/test_gateway_metrics.py compares the two).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client import metrics as _prometheus
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from harnessrl.metrics import LATENCY_BUCKETS


class _Route:
    """One route's counts, shared by every `RouteMetrics` of that route (as a labelled child
    is): requests by status, and the latency histogram's buckets (not cumulative) and sum."""

    __slots__ = ("by_status", "buckets", "sum", "created", "status_created")

    def __init__(self) -> None:
        self.by_status: dict[int, int] = {}
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: over every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()
        self.status_created: dict[int, float] = {}


class _RouteSeries:
    """`harnessrl_gateway_requests_total{route,status}` and
    `harnessrl_gateway_request_seconds{route}` from the routes' counts, when scraped."""

    def __init__(self) -> None:
        self.routes: dict[str, _Route] = {}
        self.statuses: list[tuple[str, int]] = []  # (route, status) in order of first use

    def describe(self) -> list[Metric]:
        return []  # its names are not checked for clashes at registration

    def collect(self) -> Iterator[Metric]:
        created = _prometheus._use_created  # PROMETHEUS_DISABLE_CREATED_SERIES, as its own
        requests = CounterMetricFamily("harnessrl_gateway_requests",
                                       "Requests answered, by route and HTTP status",
                                       labels=["route", "status"])
        latency = HistogramMetricFamily(
            "harnessrl_gateway_request_seconds",
            "Time from a request to its response (a stream: to its head), by route",
            labels=["route"])
        for name, status in list(self.statuses):
            route = self.routes[name]
            requests.add_metric([name, str(status)], route.by_status[status],
                                route.status_created[status] if created else None)
        for name, route in list(self.routes.items()):
            cumulative, total = [], 0
            for bound, n in zip(_LE, route.buckets):
                total += n
                cumulative.append((bound, total))
            latency.add_metric([name], cumulative, route.sum)
            if created:
                latency.samples.append(Sample("harnessrl_gateway_request_seconds_created",
                                              {"route": name}, route.created))
        yield requests
        yield latency


_LE = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]
_BOUNDS = tuple(float(b) for b in LATENCY_BUCKETS)
ROUTES = _RouteSeries()
REGISTRY.register(ROUTES)  # type: ignore[arg-type]
HELD = Gauge("harnessrl_gateway_held_requests",
             "Requests waiting now for an engine (paused or unreachable), by route", ["route"])
HELD_RECORDS = Gauge("harnessrl_gateway_held_records",
                     "Calls waiting now for the store to record them")
FORWARDED = Counter("harnessrl_gateway_forwarded_calls",
                    "Calls forwarded to the replica that owns their rollout")


class RouteMetrics:
    """One route's series, resolved once (no label lookup per request)."""

    __slots__ = ("route", "held", "_counts")

    def __init__(self, route: str) -> None:
        self.route = route
        self.held = HELD.labels(route)
        self._counts = ROUTES.routes.get(route) or ROUTES.routes.setdefault(route, _Route())

    def observe(self, status: int, seconds: float) -> None:
        """A request answered `status` after `seconds` (a histogram's bucket: the first bound
        at or over it, as prometheus-client's)."""
        counts = self._counts
        by_status = counts.by_status
        if status in by_status:
            by_status[status] += 1
        else:
            by_status[status] = 1
            counts.status_created[status] = time.time()
            ROUTES.statuses.append((self.route, status))
        counts.buckets[bisect_left(_BOUNDS, seconds)] += 1
        counts.sum += seconds
