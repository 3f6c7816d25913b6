"""Generated bad input for the gateway's HTTP surface (hypothesis strategies + a raw client).

Used by `tests/test_gateway_fuzz.py` (a fixed seed, a bounded count) and `bench/gateway_fuzz.py`
(10,000+ inputs). Each input is the exact bytes of one HTTP request, sent over its own TCP
connection, so malformed framing reaches the gateway as it is. Five kinds:

- `mutated` and `wrong_type` (at least half together; about 47% and 17%): a well-formed
  request to one of the data-plane routes (`http_fuzz_shapes.SHAPES`: every API, streamed and
  not), under the rollout's valid key, with one field of its JSON body (at any depth) replaced
  by another type, a huge or deeply nested value, a bad number or string (lone surrogates),
  deleted, or joined by an unknown field (`mutated`); or given a value of a JSON kind the API
  does not accept there (`wrong_type`: answered 400 naming the field in the API's own shape);
- `bad_key`: the same, under a missing, garbage, forged, expired key, or the key of a finished
  rollout or of an attempt that is not running;
- `malformed_json`: truncated JSON, random bytes, invalid UTF-8 inside a string, NaN,
  trailing commas, a body that is not an object, an empty body; under any key;
- `framing`: odd methods, paths, HTTP versions and headers (non-ASCII bytes, huge values, many
  headers, duplicated or conflicting Content-Length/Transfer-Encoding, `Expect`), chunked
  bodies split at random points with chunk extensions, pipelined requests; under any key.

`exchange` sends one input and parses what comes back (httptools, as the gateway's server
does): every response status, and whether a streamed body ended with its API's final event.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import httptools
from hypothesis import strategies as st

from harnessrl.testing import http_fuzz_shapes as shapes

RAW = "__FUZZ_RAW__"  # a JSON string replaced by raw JSON text after serialisation
UNKNOWN_FIELDS = ("rollout_id", "x_rollout", "user", "metadata", "attempt", "seq", "api_key",
                  "extra_body", "__proto__", "é", "")

# Routes and a valid request for each: (path, body, extra headers, recording route).
BASES = [(s.route, s.body, s.headers, s.records) for s in shapes.SHAPES]
ROUTES = sorted({b[0] for b in BASES} | {"/v1/models", "/health"})
RECORDING = {b[0] for b in BASES if b[3]}  # routes whose 200 answers are recorded calls
FINAL_EVENTS = (b"data: [DONE]", b"event: message_stop", b"event: response.completed")


@dataclass
class Keys:
    """The keys a fuzz run uses: `valid` is the only one of a running attempt (rollout A)."""

    valid: str
    expired: str
    finished: str  # a rollout whose attempt has finished
    other_attempt: str  # rollout A, an attempt that is not running

    def strategy(self) -> st.SearchStrategy[tuple[str, bytes | None]]:
        forged = self.valid[:-3] + ("AAA" if not self.valid.endswith("AAA") else "BBB")
        fixed = [("expired", self.expired), ("finished", self.finished),
                 ("other_attempt", self.other_attempt), ("forged", forged)]
        return st.one_of(
            st.just(("none", None)),
            st.sampled_from([(n, k.encode()) for n, k in fixed]),
            st.binary(max_size=64).map(lambda b: ("garbage", b)),
            st.text(max_size=40).map(lambda t: ("garbage", ("hrl1." + t).encode("utf-8",
                                                                                 "replace"))))


@dataclass
class FuzzInput:
    kind: str  # mutated | wrong_type | bad_key | malformed_json | framing
    key: str  # valid | none | garbage | forged | expired | finished | other_attempt
    path: str
    raw: bytes  # the request's bytes as sent
    expect_responses: int = 1  # pipelined requests get one response each
    what: str = ""  # what was done to it, for failure reports
    field: str = ""  # wrong_type: the field, as its API names it in errors
    style: str = "openai"  # the route's error shape: openai | anthropic
    shape: str = ""  # wrong_type: the request mutated, "route" or "route stream"

    @property
    def records(self) -> bool:
        """Under the valid key, to a recording route: each 200 answer is a recorded call."""
        return self.key == "valid" and self.path.split("?", 1)[0] in RECORDING


def _leaf() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                     st.text(max_size=30), st.integers(min_value=2**63, max_value=2**80))


def _weird_value() -> st.SearchStrategy[tuple[str, Any]]:
    """(description, value): a Python value, or ("raw", JSON text) placed verbatim."""
    nested = st.recursive(_leaf(), lambda ch: st.lists(ch, max_size=4)
                          | st.dictionaries(st.text(max_size=8), ch, max_size=4), max_leaves=12)
    return st.one_of(
        nested.map(lambda v: ("value", v)),
        st.integers(10_000, 400_000).map(lambda n: ("huge_string", "x" * n)),
        st.integers(1_000, 60_000).map(lambda n: ("huge_list", [1] * n)),
        st.integers(1_000, 30_000).map(lambda n: ("huge_object", {f"k{i}": i for i in range(n)})),
        st.integers(50, 20_000).map(lambda d: ("raw", "[" * d + "]" * d)),
        st.integers(50, 20_000).map(lambda d: ("raw", '{"a":' * d + "1" + "}" * d)),
        st.sampled_from(["1e400", "-1e400", "123456789012345678901234567890", "-0", "0.0e0",
                         '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"', '"a\\u0000b"',
                         "NaN", "Infinity", "-Infinity", "1.", ".5", "01", "+1", "true1",
                         '"' + "\\u00e9" * 1000 + '"', "[1,]", "{,}"]).map(lambda r: ("raw", r)),
        st.binary(min_size=1, max_size=8).map(lambda b: ("raw_bytes", b)),
    )


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _body(base: dict[str, Any], path: tuple[Any, ...], op: str, value: tuple[str, Any],
          unknown: str) -> bytes:
    body = json.loads(json.dumps(base))
    parent = body
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    how, v = value
    if op == "delete":
        del parent[last]
    elif op == "add_field":
        target = parent[last] if isinstance(parent[last], dict) else parent
        new = RAW if how in ("raw", "raw_bytes") else v
        if isinstance(target, dict):
            target[unknown] = new
        else:  # a list: one more element
            target.append(new)
    else:
        parent[last] = RAW if how in ("raw", "raw_bytes") else v
    text = json.dumps(body).encode()
    if how == "raw":
        text = text.replace(b'"' + RAW.encode() + b'"', v.encode(), 1)
    elif how == "raw_bytes":  # bytes inside a JSON string: often invalid UTF-8
        text = text.replace(RAW.encode(), v.replace(b'"', b"'").replace(b"\\", b"/"), 1)
    return text


def request_bytes(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes,
                  chunks: list[int] | None = None, version: bytes = b"HTTP/1.1") -> bytes:
    """One request; `chunks` splits the body chunked at those offsets (else Content-Length)."""
    head = [method.encode() + b" " + path.encode() + b" " + version, b"Host: gateway"]
    head += [n + b": " + v for n, v in headers]
    if chunks is None:
        head.append(b"Content-Length: " + str(len(body)).encode())
        return b"\r\n".join(head) + b"\r\n\r\n" + body
    head.append(b"Transfer-Encoding: chunked")
    out = [b"\r\n".join(head) + b"\r\n\r\n"]
    cuts = sorted({0, len(body), *(c for c in chunks if 0 < c < len(body))})
    for a, b in zip(cuts, cuts[1:], strict=False):
        out.append(b"%x;ext=1\r\n%b\r\n" % (b - a, body[a:b]))
    out.append(b"0\r\n\r\n")
    return b"".join(out)


def _auth(route: str, key: bytes | None) -> list[tuple[bytes, bytes]]:
    if key is None:
        return []
    if route.startswith("/v1/messages"):
        return [(b"x-api-key", key)]
    return [(b"Authorization", b"Bearer " + key)]


def wrong_type_input(valid: str, shape: shapes.Shape, path: tuple[Any, ...], kind: str,
                     value: Any) -> FuzzInput:
    """`wrong_type`: `shape`'s request with the field at `path` set to `value`, of a `kind` it
    does not accept, under the valid key."""
    headers = [(n.encode(), v.encode()) for n, v in shape.headers.items()]
    raw = request_bytes("POST", shape.route, _auth(shape.route, valid.encode()) + headers
                        + [(b"Content-Type", b"application/json")],
                        shapes.mutated_body(shape.body, path, value))
    label = shape.route + (" stream" if shape.body.get("stream") else "")
    return FuzzInput("wrong_type", "valid", shape.route, raw, what=f"{list(path)} <- {kind}",
                     field=shapes.field_name(path, shape.style), style=shape.style, shape=label)


def wrong_type_inputs(valid: str) -> st.SearchStrategy[FuzzInput]:
    """`wrong_type` inputs only (`http_fuzz_shapes.wrong_types`)."""
    return shapes.wrong_types().map(lambda case: wrong_type_input(valid, *case))


def every_wrong_type(valid: str) -> list[FuzzInput]:
    """Each field of each `SHAPES` request once with each kind it does not accept."""
    return [wrong_type_input(valid, shape, path, kind, shapes.SAMPLES[kind][-1])
            for shape in shapes.SHAPES for path, kinds in shapes.field_paths(shape)
            for kind in shapes.wrong_kinds(kinds)]


def fuzz_inputs(keys: Keys) -> st.SearchStrategy[FuzzInput]:
    """Inputs of all five kinds, chosen by a drawn number 0-99: under 55 `mutated` or
    `wrong_type` (a drawn boolean), under 65 `bad_key`, under 80 `malformed_json`, else
    `framing` (hypothesis favours small numbers: about 47% + 17%, 14%, 9%, 13% in practice)."""

    @st.composite
    def build(draw: st.DrawFn) -> FuzzInput:
        roll = draw(st.integers(0, 99))
        if roll < 55 and draw(st.booleans()):
            return draw(wrong_type_inputs(keys.valid))
        route, base, extra, _ = draw(st.sampled_from(BASES))
        headers = [(n.encode(), v.encode()) for n, v in extra.items()]
        headers.append((b"Content-Type", b"application/json"))
        valid = keys.valid.encode()
        if roll < 65:  # one field mutated, under the valid key (or, 10%, under a bad one)
            paths = _paths(base)
            path = draw(st.sampled_from(paths))
            op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add_field"]))
            value = draw(_weird_value())
            unknown = draw(st.sampled_from(UNKNOWN_FIELDS))
            body = _body(base, path, op, value, unknown)
            key_name, key = ("valid", valid) if roll < 55 else draw(keys.strategy())
            chunks = draw(st.none() | st.lists(st.integers(0, len(body)), max_size=4))
            raw = request_bytes("POST", route, _auth(route, key) + headers, body, chunks)
            return FuzzInput("mutated" if roll < 55 else "bad_key", key_name, route, raw,
                             what=f"{op} {list(path)} <- {value[0]}")
        key_name, key = draw(st.sampled_from([("valid", valid)]) | keys.strategy())
        good = json.dumps(base).encode()
        if roll < 80:  # malformed JSON
            how = draw(st.sampled_from(["truncate", "random", "bad_utf8", "nan", "comma",
                                        "not_object", "empty", "bom", "dup_keys"]))
            if how == "truncate":
                body = good[:draw(st.integers(0, len(good) - 1))]
            elif how == "random":
                body = draw(st.binary(max_size=300))
            elif how == "bad_utf8":
                at = good.index(b'"') + 1  # inside the first key
                body = good[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80",
                                                         b"\xf4\x90\x80\x80", b"\x80"])) + good[at:]
            elif how == "nan":
                body = good.replace(b"8", b"NaN", 1).replace(b"0.5", b"NaN", 1)
            elif how == "comma":
                body = good[:-1] + b",}"
            elif how == "not_object":
                body = draw(st.sampled_from([b"[]", b"null", b"1", b'"s"', b"[{}]", b"true"]))
            elif how == "empty":
                body = b""
            elif how == "bom":
                body = b"\xef\xbb\xbf" + good
            else:
                body = good[:-1] + b', "model": 5, "model": "tiny"}'
            raw = request_bytes("POST", route, _auth(route, key) + headers, body)
            return FuzzInput("malformed_json", key_name, route, raw, what=how)
        # framing
        how = draw(st.sampled_from([
            "method", "path", "version", "header_bytes", "huge_header", "many_headers",
            "dup_length", "length_and_chunked", "bad_chunk", "chunked_ext", "expect",
            "no_colon", "obs_fold", "pipelined", "bad_length", "upgrade", "empty_header"]))
        method, path, version = "POST", route, b"HTTP/1.1"
        hdrs = _auth(route, key) + headers
        body, chunks = good, None
        if how == "method":
            method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "FOO",
                                           "post", "CONNECT"]))
        elif how == "path":
            path = draw(st.sampled_from([
                route + "?a=1&b", route + "/", "/" + route, route.upper(),
                "/v1/../v1/chat/completions", "/v1/chat%2Fcompletions", "*",
                "http://gateway" + route, "/" + "a" * 5000, "/v1/\xe9", "/v1/%00",
                route + "#frag"] + ROUTES))
        elif how == "version":
            version = draw(st.sampled_from([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9.9", b"HTTP/1.1x",
                                            b"http/1.1"]))
        elif how == "header_bytes":
            hdrs.append((b"X-Odd", draw(st.binary(max_size=200).map(
                lambda b: b.replace(b"\r", b"").replace(b"\n", b"")))))
        elif how == "huge_header":
            hdrs.append((b"X-Huge", b"h" * draw(st.integers(1_000, 200_000))))
        elif how == "many_headers":
            hdrs += [(b"X-H%d" % i, b"v") for i in range(draw(st.integers(50, 3_000)))]
        elif how == "dup_length":
            hdrs.append((b"Content-Length", str(len(body) + draw(st.integers(-5, 5))).encode()))
        elif how == "length_and_chunked":
            chunks = [len(body) // 2]
            hdrs.append((b"Content-Length", str(len(body)).encode()))
        elif how == "bad_chunk":
            raw = request_bytes(method, path, hdrs, b"", chunks=[]).replace(
                b"0\r\n\r\n", draw(st.sampled_from([b"zz\r\n", b"-1\r\n", b"fffffffffffffffff\r\n",
                                                    b"1\r\nab\r\n0\r\n\r\n"])))
            return FuzzInput("framing", key_name, path, raw, what=how)
        elif how == "chunked_ext":
            chunks = draw(st.lists(st.integers(0, len(body)), min_size=1, max_size=20))
        elif how == "expect":
            hdrs.append((b"Expect", draw(st.sampled_from([b"100-continue", b"100-Continue",
                                                          b"200-ok", b""]))))
        elif how == "no_colon":
            hdrs.append((b"X-No-Colon-Here", b""))
            raw = request_bytes(method, path, hdrs, body).replace(b"X-No-Colon-Here: ",
                                                                   b"X-No-Colon-Here", 1)
            return FuzzInput("framing", key_name, path, raw, what=how)
        elif how == "obs_fold":
            hdrs.append((b"X-Folded", b"a\r\n b"))
        elif how == "pipelined":
            one = request_bytes(method, path, hdrs, body)
            return FuzzInput("framing", key_name, path, one * 2, expect_responses=2, what=how)
        elif how == "bad_length":
            hdrs.append((b"Content-Length", draw(st.sampled_from([b"-1", b"1e3", b"0x10",
                                                                  b" 5", b"abc"]))))
            raw = b"\r\n".join(request_bytes(method, path, hdrs, body).split(b"\r\n")[:-3]) \
                + b"\r\n\r\n" + body
            return FuzzInput("framing", key_name, path, raw, what=how)
        elif how == "upgrade":
            hdrs += [(b"Connection", b"Upgrade"), (b"Upgrade", b"h2c")]
        elif how == "empty_header":
            hdrs.append((b"", b"x"))
        raw = request_bytes(method, path, hdrs, body, chunks, version)
        return FuzzInput("framing", key_name, path, raw, what=how)

    return build()


@dataclass
class Exchange:
    statuses: list[int] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    elapsed_s: float = 0.0
    timed_out: bool = False
    closed_early: bool = False  # the connection closed before every response arrived
    bad_response: str = ""  # what the client's parser could not read


class _Parser:
    def __init__(self) -> None:
        self.done: list[tuple[int, bytes]] = []
        self._body: list[bytes] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), b"".join(self._body)))
        self._body = []


def exchange(port: int, raw: bytes, responses: int = 1, timeout_s: float = 20.0) -> Exchange:
    """Sends `raw` on a new connection; reads until `responses` final responses arrived (an
    interim `100 Continue` is skipped), the gateway closed the connection, or `timeout_s`."""
    out = Exchange()
    t0 = time.monotonic()
    parser = _Parser()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(raw)
        except OSError:
            pass  # the gateway refused the rest (413, 400) and closed: read its answer
        while len([s for s, _ in parser.done if s != 100]) < responses:
            remaining = timeout_s - (time.monotonic() - t0)
            if remaining <= 0:
                out.timed_out = True
                break
            sock.settimeout(remaining)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                out.timed_out = True
                break
            except OSError:
                data = b""
            if not data:
                out.closed_early = True
                break
            try:
                parser.parser.feed_data(data)
            except httptools.HttpParserError as err:
                out.bad_response = f"{type(err).__name__}: {err}"
                break
    finals = [(s, b) for s, b in parser.done if s != 100]
    out.statuses = [s for s, _ in finals]
    out.bodies = [b for _, b in finals]
    out.elapsed_s = time.monotonic() - t0
    return out


def completed_calls(inp: FuzzInput, ex: Exchange) -> int:
    """How many calls the gateway must have recorded for this exchange: each 200 answer of a
    recording route under the valid key (a stream counts once it sent its final event)."""
    if not inp.records:
        return 0
    n = 0
    for status, body in zip(ex.statuses, ex.bodies, strict=False):
        if status != 200:
            continue
        if body.startswith(b"data:") or body.startswith(b"event:"):
            n += any(f in body for f in FINAL_EVENTS)
        else:
            n += 1
    return n


@dataclass
class FuzzReport:
    inputs: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_key: dict[str, int] = field(default_factory=dict)
    wrong_type_by_shape: dict[str, int] = field(default_factory=dict)  # inputs per request
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    expected_calls: int = 0  # calls the gateway must have recorded for rollout A
    slowest_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "by_kind": self.by_kind, "by_key": self.by_key,
                "wrong_type_by_shape": self.wrong_type_by_shape,
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "failures": len(self.failures), "failures_by_reason": self.failures_by_reason,
                "expected_calls": self.expected_calls, "slowest_s": round(self.slowest_s, 3)}


def check(inp: FuzzInput, ex: Exchange) -> list[str]:
    """What is wrong with the gateway's answer to `inp` (nothing: [])."""
    problems = []
    if ex.timed_out:
        problems.append("hang")
    if ex.bad_response:
        problems.append("unparseable_response")
    if not ex.statuses and not ex.timed_out:
        problems.append("no_response")
    elif len(ex.statuses) < inp.expect_responses and ex.statuses and ex.statuses[-1] < 400:
        problems.append("missing_pipelined_response")
    for status in ex.statuses:
        if status >= 500:
            problems.append(f"status_{status}")
    if inp.key == "valid" and inp.kind == "mutated" and 401 in ex.statuses:
        problems.append("valid_key_refused")
    if inp.key != "valid" and 200 in ex.statuses and inp.path.split("?")[0] != "/health":
        problems.append("bad_key_accepted")
    if inp.kind == "wrong_type":
        problems += shapes.check_named(inp.field, inp.style, ex.statuses, ex.bodies)
    return problems


def run(port: int, keys: Keys, examples: int, seed: int,
        inputs: st.SearchStrategy[FuzzInput] | list[FuzzInput] | None = None) -> FuzzReport:
    """Sends `examples` generated inputs (`fuzz_inputs` unless given; a list is sent as it is)
    to the gateway at `port`, one connection each; never stops at a failure (each is noted in
    the report, with the input that caused it)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    report = FuzzReport()

    def one(inp: FuzzInput) -> None:
        ex = exchange(port, inp.raw, inp.expect_responses)
        report.inputs += 1
        report.by_kind[inp.kind] = report.by_kind.get(inp.kind, 0) + 1
        report.by_key[inp.key] = report.by_key.get(inp.key, 0) + 1
        if inp.shape:
            report.wrong_type_by_shape[inp.shape] = report.wrong_type_by_shape.get(inp.shape, 0) + 1
        for s in ex.statuses:
            report.statuses[s] = report.statuses.get(s, 0) + 1
        report.slowest_s = max(report.slowest_s, ex.elapsed_s)
        report.expected_calls += completed_calls(inp, ex)
        for problem in check(inp, ex):
            seen = report.failures_by_reason[problem] = report.failures_by_reason.get(problem, 0) + 1
            if len(report.failures) < 50 or seen <= 3:  # and a few of each reason
                report.failures.append(
                    f"{problem}: {inp.kind}/{inp.key} {inp.shape or inp.path} ({inp.what}) -> "
                    f"{ex.statuses} {[b[:200] for b in ex.bodies]} raw={inp.raw[:300]!r}")

    if isinstance(inputs, list):
        for inp in inputs:
            one(inp)
    else:
        test = given(inputs if inputs is not None else fuzz_inputs(keys))(one)
        hseed(seed)(settings(max_examples=examples, database=None, deadline=None,
                             phases=[Phase.generate],
                             suppress_health_check=list(HealthCheck))(test))()
    return report
