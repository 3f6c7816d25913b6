"""The gateway's HTTP surface under generated bad input (slow clients and load:
`test_gateway_load.py`).

Real gateway process, real store on Redis, the stub engine. The fuzz inputs come from
`harnessrl.testing.http_fuzz` (hypothesis, a fixed seed, a bounded count here; 10,000+ in
`bench/gateway_fuzz.py`): no crash, no 5xx, no hang, and no write to any rollout but the key's
own, checked in the store; a field of a kind its API does not accept is answered 400 naming
the field, in the API's own error shape (`http_fuzz_shapes`).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import httpx
import pytest

from conftest import StoreService, StubEngineService
from harnessrl.testing import http_fuzz
from harnessrl.testing import http_fuzz_shapes as shapes
from test_gateway import SIGNER, World

FUZZ_EXAMPLES = int(os.environ.get("HARNESSRL_FUZZ_EXAMPLES", "1500"))
WRONG_TYPE_EXAMPLES = int(os.environ.get("HARNESSRL_WRONG_TYPE_EXAMPLES", "600"))


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
        assert report.by_kind.get("mutated", 0) + report.by_kind.get("wrong_type", 0) \
            >= FUZZ_EXAMPLES // 2 and report.by_kind.get("wrong_type", 0) > FUZZ_EXAMPLES // 10
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
        # its own reward is allowed: reported here too, since the draws (seeded, yet shaped by
        # the rollouts' random ids) need not hold an accepted one (CI's of 2026-12-07 did not)
        own = httpx.post(f"http://127.0.0.1:{w.gateway.http_port}/v1/harnessrl/reward",
                         json={"reward": 0.5}, timeout=10,
                         headers={"Authorization": f"Bearer {keys.valid}"})
        assert own.status_code == 200, own.text
        assert w.store.get_rollout(a).attempts[0].has_reported_reward
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


def test_wrong_typed_fields_are_refused_naming_the_field_in_the_apis_shape(
        tmp_path: Path, store_service: StoreService, stub_engine: StubEngineService) -> None:
    """Found by the fuzzer (issue 17): a field of the wrong type (a Messages or Responses
    `tools` that is not a list, ...) reached the translation code, which raised TypeError
    (answered 500). Every API's request is checked against its shape first: one field of a
    valid request (any API, streamed or not) given a value of a kind the API does not accept
    there is answered 400 naming the field: OpenAI's `error.param` for chat, completions and
    Responses, Anthropic's `error.message` for Messages and count_tokens."""
    w = World(tmp_path, store_service, [stub_engine])
    try:
        a = w.rollout()
        key = SIGNER.mint(a, 1, 3600)
        auth = {b"authorization": b"Bearer " + key.encode(), b"x-api-key": key.encode(),
                b"content-type": b"application/json"}
        for shape in shapes.SHAPES:  # the fuzzer mutates valid requests
            headers = [*auth.items(), *((n.encode(), v.encode()) for n, v in shape.headers.items())]
            raw = http_fuzz.request_bytes("POST", shape.route, headers,
                                          json.dumps(shape.body).encode())
            ex = http_fuzz.exchange(w.gateway.http_port, raw)
            assert ex.statuses == [200], (shape, ex.bodies)
        answered = sum(s.records for s in shapes.SHAPES)
        keys = http_fuzz.Keys(valid=key, expired=key, finished=key, other_attempt=key)
        report = http_fuzz.run(w.gateway.http_port, keys, WRONG_TYPE_EXAMPLES, seed=20261201,
                               inputs=http_fuzz.wrong_type_inputs(key))
        print("wrong types:", report.summary())
        assert report.by_kind == {"wrong_type": WRONG_TYPE_EXAMPLES}
        assert not report.failures, "\n".join(report.failures)
        assert report.statuses == {400: WRONG_TYPE_EXAMPLES}
        # every API's requests, streamed and not, were mutated
        assert set(report.wrong_type_by_shape) == {
            s.route + (" stream" if s.body.get("stream") else "") for s in shapes.SHAPES}
        assert len(w.calls(a)) == answered  # the valid requests' calls only
    finally:
        w.close()
