"""Prometheus metrics: the shared wiring of every service's `/metrics`.

Each service declares its series once, at import, in its own `metrics.py` (names
`harnessrl_<service>_...`), in prometheus-client's default registry, which also carries the
process collector (CPU, memory, open files). The gRPC services (store, controller, trainer)
serve them on a port of their own, `serve_metrics(cfg.metrics_bind)`, from a daemon thread;
the gateway serves `GET /metrics` on its HTTP data plane. `docs/metrics.md` lists the series
and the Grafana dashboard that shows them.
"""

from __future__ import annotations

import logging

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest, start_http_server

log = logging.getLogger(__name__)

METRICS_BIND_HELP = ("host:port to serve Prometheus metrics on at /metrics (port 0: any free "
                     "port, written into the ready file as metrics_port); empty: no metrics "
                     "endpoint")
# Latency buckets (seconds) for requests and job launches: 1 ms .. 2 min.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)
# Phase buckets (seconds) for training steps: 10 ms .. 30 min.
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                 1800.0)


def serve_metrics(bind: str) -> int | None:
    """Serves the registry at http://`bind`/metrics from a daemon thread; returns the bound
    port, or None when `bind` is empty (no endpoint)."""
    if not bind:
        return None
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"metrics_bind {bind!r}: expected host:port")
    server, _ = start_http_server(int(port), addr=host or "0.0.0.0")
    bound = int(server.server_port)
    log.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", bound)
    return bound


def exposition() -> tuple[bytes, str]:
    """The registry in the text exposition format, and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
