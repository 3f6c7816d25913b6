"""The gateway's HTTP surface under generated bad input (slow clients and load:
`test_gateway_load.py`).

Real gateway process, real store on Redis, the stub engine. The fuzz inputs come from
`harnessrl.testing.http_fuzz` (hypothesis, a fixed seed, a bounded count here; 10,000+ in
`bench/gateway_fuzz.py`): no crash, no 5xx, no hang, and no write to any rollout but the key's
own, checked in the store.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import httpx
import pytest

from conftest import StoreService, StubEngineService
from harnessrl.testing import http_fuzz
from test_gateway import SIGNER, World

FUZZ_EXAMPLES = int(os.environ.get("HARNESSRL_FUZZ_EXAMPLES", "1500"))


def test_fuzzed_requests_neither_crash_nor_write_elsewhere(
        tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService) -> None:
    w = World(tmp_path, store_service, [stub_engine], "--max-body-bytes", "262144",
              "--http-read-timeout-s", "2")
    try:
        a, b, done = w.rollout(), w.rollout(), w.rollout()
        w.finish(done)
        keys = http_fuzz.Keys(valid=SIGNER.mint(a, 1, 3600), expired=SIGNER.mint(a, 1, -60),
                              finished=SIGNER.mint(done, 1, 3600),
                              other_attempt=SIGNER.mint(a, 2, 3600))
        report = http_fuzz.run(w.gateway.http_port, keys, FUZZ_EXAMPLES, seed=20261130)
        print("fuzz:", report.summary())
        assert report.inputs == FUZZ_EXAMPLES
        assert report.by_kind.get("mutated", 0) >= FUZZ_EXAMPLES // 2
        assert not report.failures, "\n".join(report.failures)
        # still serving, and the store holds exactly what was answered, for rollout A only
        assert w.gateway.proc.alive
        assert httpx.get(f"http://127.0.0.1:{w.gateway.http_port}/health").status_code == 200
        calls = w.calls(a)
        assert {c.rollout_id for c in calls} <= {a}
        assert len({c.seq for c in calls}) == len(calls)
        assert sum(not c.aborted for c in calls) == report.expected_calls > FUZZ_EXAMPLES // 10
        assert w.calls(b) == [] and w.calls(done) == []
        assert not any(at.has_reported_reward for r in (b, done)
                       for at in w.store.get_rollout(r).attempts)
        assert w.store.get_rollout(a).attempts[0].has_reported_reward  # its own: allowed
        # a request head over 64 KiB is refused, not buffered without bound
        huge = http_fuzz.request_bytes("POST", "/v1/chat/completions",
                                       [(b"X-Huge", b"h" * 70_000)], b"{}")
        assert http_fuzz.exchange(w.gateway.http_port, huge).statuses == [431]
        # a HEAD answer carries no body: the next response on the connection reads cleanly
        head_then_get = (b"HEAD /health HTTP/1.1\r\nHost: g\r\n\r\n"
                         b"GET /health HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
        with socket.create_connection(("127.0.0.1", w.gateway.http_port), timeout=10) as s:
            s.sendall(head_then_get)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        first, _, rest = data.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 405") and rest.startswith(b"HTTP/1.1 200"), data
    finally:
        w.close()


def test_keys_with_non_ascii_bytes_are_refused_not_crashed() -> None:
    """Found by the fuzzer: a key like `hrl1.<non-ASCII>.<sig>` made the signature comparison
    raise TypeError (answered 500); it is an invalid key (401)."""
    from harnessrl.errors import Unauthenticated

    for token in ("hrl1.\u00e9.abc", "hrl1.eyJ9.\u00ff\u00fe", SIGNER.mint("r", 1, 60) + "\u00e9"):
        with pytest.raises(Unauthenticated):
            SIGNER.verify(token)
