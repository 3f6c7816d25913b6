"""Logging, configured once per process: one line per record, key=value fields after the text.

Call `setup("store")` in a service's entry point. Pass ids through `extra=`:
`log.info("rollout finished", extra={"run": run_id, "rollout": rid, "version": v})`.
"""

from __future__ import annotations

import logging
import os
import sys

_FIELDS = ("run", "rollout", "attempt", "group", "engine", "version", "step")


class _Formatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__("%(asctime)s %(levelname)s " + service + " %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        kv = [f"{k}={getattr(record, k)}" for k in _FIELDS if hasattr(record, k)]
        return line + (" " + " ".join(kv) if kv else "")


def setup(service: str, level: str | None = None) -> None:
    level = level or os.environ.get("HARNESSRL_LOG_LEVEL", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "uvicorn.access", "grpc._cython"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
