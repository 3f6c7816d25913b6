"""The gateway's per-request series (services/gateway/metrics.py) are counted in plain numbers
and written when scraped: the lines must be the ones prometheus-client's Counter and Histogram
write for the same requests (tests/test_metrics.py reads them from a running gateway)."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import prometheus_client
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest

from harnessrl.metrics import LATENCY_BUCKETS
from services.gateway.metrics import ROUTES, RouteMetrics

NAMES = ("harnessrl_gateway_requests", "harnessrl_gateway_request_seconds")


def _lines(registry: CollectorRegistry) -> list[str]:
    """The two series' lines, creation times masked."""
    text = generate_latest(registry).decode()
    return [re.sub(r"(_created\{[^}]*\}) \S+$", r"\1 T", line) for line in text.splitlines()
            if any(n in line for n in NAMES)]


@pytest.fixture
def fresh() -> Iterator[None]:
    """The routes' counts empty for the test, and as they were after it."""
    saved = dict(ROUTES.routes), list(ROUTES.statuses)
    ROUTES.routes.clear()
    ROUTES.statuses.clear()
    yield
    ROUTES.routes.clear()
    ROUTES.routes.update(saved[0])
    ROUTES.statuses[:] = saved[1]


@pytest.mark.parametrize("created", [True, False])
def test_the_series_are_prometheus_clients(fresh: None, created: bool) -> None:
    if not created:
        prometheus_client.disable_created_metrics()
    try:
        theirs = CollectorRegistry()
        requests = Counter(NAMES[0], "Requests answered, by route and HTTP status",
                           ["route", "status"], registry=theirs)
        latency = Histogram(NAMES[1], "Time from a request to its response (a stream: to its "
                            "head), by route", ["route"], buckets=LATENCY_BUCKETS,
                            registry=theirs)
        routes = ["/v1/chat/completions", "/v1/messages", "other", "/health"]
        ours = [RouteMetrics(r) for r in routes]
        ours.append(RouteMetrics(routes[0]))  # a second app's: the same series
        for r in routes:
            latency.labels(r)  # a route's histogram is there before its first request
        rng = random.Random(7)
        # every bound exactly, either side of each, over the last, and a spread
        seconds = [b + d for b in LATENCY_BUCKETS for d in (-1e-9, 0.0, 1e-9)] + [0.0, 500.0] \
            + [rng.expovariate(20) for _ in range(2000)]
        for s in seconds:
            i = rng.randrange(len(ours) - 1) if rng.random() < 0.9 else len(ours) - 1
            status = rng.choice([200, 200, 200, 400, 401, 503])
            ours[i].observe(status, s)
            requests.labels(ours[i].route, str(status)).inc()
            latency.labels(ours[i].route).observe(s)
        assert _lines(REGISTRY) == _lines(theirs)
    finally:
        prometheus_client.enable_created_metrics()
