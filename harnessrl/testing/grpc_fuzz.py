"""Generated inputs for every harnessrl gRPC service (the fuzz tests and `bench/fuzz_grpc.py`).

`request_strategy(method, seed)` draws a request for one RPC, three ways:

- **mutated** (at least half): a well-formed request (`seed`, naming the fuzzer's own objects)
  with one field, top-level or one message down, replaced by a value of its type drawn from
  the edges: out-of-range and extreme numbers, NaN and infinities, unknown enum values, empty,
  enormous (100,000 characters or elements) and odd strings and bytes; or with a field no
  message declares added (the only mutation of a request without fields);
- **generated**: every field drawn that way, messages nested up to three deep;
- **garbage**: bytes that are no valid protobuf message at all.

`call(channel, method, payload, timeout)` sends one serialized request through the generic
gRPC API (no stub, so garbage travels too) and returns the status code. Some fields never get
arbitrary values because the controller would run them: harness and grader commands come from
a small harmless set, and `tasks_file` names no device or large file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message as pb_message
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from hypothesis import strategies as st

# protobuf's stubs type every descriptor link (message_type, enum_type, ...) as Optional and
# hide _concrete_class: descriptors are handled untyped here.
Field = Any

HUGE = 100_000  # characters / elements of an "enormous" value
HUGE_MESSAGES = 2_000  # elements of an enormous repeated message field

_INT32 = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 3, 1000]),
                   st.integers(-(2**31), 2**31 - 1))
_INT64 = st.one_of(st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**31]),
                   st.integers(-(2**63), 2**63 - 1))
_UINT = st.integers(0, 2**32 - 1)
_DOUBLE = st.one_of(st.sampled_from([0.0, -0.0, -1.0, 1.0, math.nan, math.inf, -math.inf,
                                     1e308, -1e308, 5e-324]), st.floats())
_FLOAT = st.one_of(st.sampled_from([0.0, math.nan, math.inf, -math.inf, 3.4e38]),
                   st.floats(width=32))
_STRING = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", "-", "train", "0-0", "1-1", "99999999999999-0", "../../etc/passwd",
                     "a" * 300, "\x00", "é/ü:🙂", " ", "x" * HUGE, "*", "$", "+"]),
)
_BYTES = st.one_of(st.binary(max_size=32),
                   st.sampled_from([b"", b"\xff\xfe", b'{"a":', b"\x00" * 64, b"z" * HUGE]))

# Fields whose values the controller would execute or read: never arbitrary.
_SAFE_ARGV = st.sampled_from([[], ["/bin/true"], ["/bin/false"], ["/nonexistent/harness"],
                              ["/bin/true"] * 5000, ["", "x"], ["/bin/true", "\x00"]])
SAFE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "harness_command": _SAFE_ARGV,
    "grader_command": _SAFE_ARGV,
    "tasks_file": st.sampled_from(["", "/nonexistent/tasks.jsonl", "/", "relative.jsonl",
                                   "x" * 5000]),
}


def _scalar(f: Field) -> st.SearchStrategy[Any]:
    t = f.type
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32,
             FieldDescriptor.TYPE_SFIXED32):
        return _INT32
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64,
             FieldDescriptor.TYPE_SFIXED64):
        return _INT64
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _UINT
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if t == FieldDescriptor.TYPE_DOUBLE:
        return _DOUBLE
    if t == FieldDescriptor.TYPE_FLOAT:
        return _FLOAT
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return _STRING
    if t == FieldDescriptor.TYPE_BYTES:
        return _BYTES
    if t == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown values travel
        known = [v.number for v in f.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from([-1, 99, 2**31 - 1]),
                         st.integers(-(2**31), 2**31 - 1))
    raise TypeError(f"field {f.full_name}: type {t}")


def _repeated(f: Field) -> bool:
    return bool(f.is_repeated)


def _is_map(f: Field) -> bool:
    return f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def field_value(f: Field, depth: int) -> st.SearchStrategy[Any]:
    """A value for field `f` (a list for repeated fields, a dict for maps, a message)."""
    if f.name in SAFE_FIELDS:
        return SAFE_FIELDS[f.name]
    if _is_map(f):
        k, v = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        return st.dictionaries(_scalar(k), _scalar(v), max_size=4) | st.just(
            {f"K{i}": "v" for i in range(2000)})
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        one = message_strategy(f.message_type, depth + 1)
    else:
        one = _scalar(f)
    if not _repeated(f):
        return one
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        huge = st.builds(lambda: [f.message_type._concrete_class()] * HUGE_MESSAGES)
    elif f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
        # many short elements (100,000 copies of a 100,000-character string would be 10 GB)
        small = st.sampled_from(["", "a", "0-1", "é"] if f.type == FieldDescriptor.TYPE_STRING
                                else [b"", b"a", b"\xff"])
        huge = small.map(lambda v: [v] * HUGE)
    else:
        huge = one.map(lambda v: [v] * HUGE)
    return st.one_of(st.lists(one, max_size=3), huge)


def _assign(msg: pb_message.Message, f: Field, value: Any) -> None:
    if _is_map(f):
        target = getattr(msg, f.name)
        target.clear()
        for k, v in value.items():
            target[k] = v
    elif _repeated(f):
        target = getattr(msg, f.name)
        del target[:]
        target.extend(value)
    elif f.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(msg, f.name).CopyFrom(value)
    else:
        setattr(msg, f.name, value)


def message_strategy(desc: Field, depth: int = 0) -> st.SearchStrategy[Any]:
    """A message of type `desc` with each field set or not, values from `field_value`."""
    cls = desc._concrete_class
    if depth >= 3:
        return st.just(cls())
    fields = list(desc.fields)

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        msg = cls()
        for f in fields:
            if draw(st.booleans()):
                _assign(msg, f, draw(field_value(f, depth)))
        return msg

    return build()


def mutated(seed: pb_message.Message) -> st.SearchStrategy[Any]:
    """`seed` with one field (top level, or inside a set message field) replaced."""

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        msg = type(seed)()
        msg.CopyFrom(seed)
        target = msg
        fields: list[Field] = list(msg.DESCRIPTOR.fields)
        if not fields:
            return msg
        f = draw(st.sampled_from(fields))
        nested = [g for g in fields if g.type == FieldDescriptor.TYPE_MESSAGE
                  and not _repeated(g) and msg.HasField(g.name)]
        if draw(st.booleans()) and nested:
            parent = draw(st.sampled_from(nested))
            target = getattr(msg, parent.name)
            inner: list[Field] = list(target.DESCRIPTOR.fields)
            if inner:
                f = draw(st.sampled_from(inner))
            else:
                target = msg
        elif any(_repeated(g) and
                 g.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(g) and
                 len(getattr(msg, g.name)) for g in fields) and draw(st.booleans()):
            parent = draw(st.sampled_from([
                g for g in fields if _repeated(g) and
                g.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(g) and
                len(getattr(msg, g.name))]))
            target = getattr(msg, parent.name)[0]
            f = draw(st.sampled_from(list(target.DESCRIPTOR.fields)))
        _assign(target, f, draw(field_value(f, 1)))
        return msg

    return build()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def unknown_field() -> st.SearchStrategy[bytes]:
    """One field no harnessrl message declares (number >= 100), varint or length-delimited."""
    def encode(t: tuple[int, int, bytes, int]) -> bytes:
        number, wire, payload, value = t
        key = _varint((number << 3) | wire)
        return key + (_varint(value) if wire == 0 else _varint(len(payload)) + payload)
    return st.tuples(st.integers(100, 2**29 - 1), st.sampled_from([0, 2]),
                     st.binary(max_size=16), st.integers(0, 2**64 - 1)).map(encode)


def mutated_bytes(seed: pb_message.Message) -> st.SearchStrategy[bytes]:
    """`mutated(seed)` serialized; for a message without fields (or one time in four), with an
    unknown field added instead of or besides the mutation."""
    base = mutated(seed).map(lambda m: m.SerializeToString())
    extra = st.tuples(base, unknown_field()).map(lambda t: t[0] + t[1])
    if not seed.DESCRIPTOR.fields:
        return extra
    return st.one_of(base, base, base, extra)


@dataclass(frozen=True)
class Rpc:
    service: str  # full name, e.g. harnessrl.v1.Store
    method: MethodDescriptor
    seed: pb_message.Message  # a well-formed request naming the fuzzer's own objects

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method.name}"

    @property
    def request_desc(self) -> Descriptor:
        return self.method.input_type


def request_strategy(rpc: Rpc) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, serialized request) with kind in mutated / generated / garbage."""
    garbage = st.one_of(st.binary(min_size=1, max_size=64),
                        st.sampled_from([b"\xff" * 16, b"\x0a\xff\xff\xff\xff\x0f",
                                         b"\x08" + b"\xff" * 11]))
    kinds = {"mutated": mutated_bytes(rpc.seed),
             "generated": message_strategy(rpc.request_desc).map(
                 lambda m: m.SerializeToString()),
             "garbage": garbage}
    # 6 in 10 mutated well-formed requests, 3 generated whole, 1 garbage
    return st.integers(0, 9).flatmap(
        lambda i: st.tuples(st.just(k := "mutated" if i < 6 else "generated" if i < 9
                                    else "garbage"), kinds[k]))


def call(ch: grpc.Channel, rpc: Rpc, payload: bytes, timeout: float
         ) -> tuple[grpc.StatusCode, str]:
    """Sends `payload` as the request of `rpc`; the status code it ends with and its details
    (streams: the status after reading everything, or DEADLINE_EXCEEDED)."""
    def ident(b: bytes) -> bytes:
        return b

    m = rpc.method
    try:
        if m.client_streaming and m.server_streaming:
            fn = ch.stream_stream(rpc.path, request_serializer=ident,
                                  response_deserializer=ident)
            for _ in fn(iter([payload, payload]), timeout=timeout):
                pass
        elif m.server_streaming:
            fn = ch.unary_stream(rpc.path, request_serializer=ident,
                                 response_deserializer=ident)
            for _ in fn(payload, timeout=timeout):
                pass
        else:
            ch.unary_unary(rpc.path, request_serializer=ident,
                           response_deserializer=ident)(payload, timeout=timeout)
    except grpc.RpcError as err:
        return err.code(), str(err.details())  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""
