"""AppendCalls and RecordCalls read with each call's bytes kept (`AppendCallsRequestBytes`).

A `Call` field and a `bytes` field are encoded alike, so `AppendCallsRequestBytes` is
`AppendCallsRequest`'s wire format with each call left as the bytes it came in. The store
reads both RPCs' requests that way (`decode`): every call is still parsed, so a request with
a call that does not parse is refused INVALID_ARGUMENT as before and nothing unreadable is
ever stored, and the store keeps the bytes it received instead of serialising the parsed call
again. A caller that serialises as protobuf does (fields in number order, repeated numbers
packed: the gateway, and any of the official libraries) sends exactly the bytes the store
kept before; the gateway serialises each call once (`services/gateway/recorder.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from harnessrl.v1 import store_pb2_grpc

READ_AS_BYTES = ("AppendCalls", "RecordCalls")


@dataclass(slots=True)
class CallBatch:
    """An AppendCalls request as the store reads it: the calls parsed, the bytes of each as
    received (what is stored), and the gateway's states of them."""

    calls: list[c.Call]
    data: list[bytes]
    states: Sequence[spb.GatewayCallState]


def decode(data: bytes) -> CallBatch:
    """An AppendCallsRequest (or its twin) from the wire; raises if a call does not parse."""
    request = spb.AppendCallsRequestBytes.FromString(data)
    raw = list(request.calls)
    return CallBatch([c.Call.FromString(b) for b in raw], raw, request.states)


class _Captured:
    """Stands in for the server while the generated code adds the Store's handlers."""

    def __init__(self) -> None:
        self.service, self.handlers = "", {}  # type: tuple[str, dict[str, Any]]

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def add_store_servicer(servicer: store_pb2_grpc.StoreServicer, server: Any) -> None:
    """`store_pb2_grpc.add_StoreServicer_to_server`, with AppendCalls and RecordCalls reading
    their requests as `CallBatch`es (`decode`)."""
    captured = _Captured()
    store_pb2_grpc.add_StoreServicer_to_server(servicer, captured)
    handlers = dict(captured.handlers)
    for name in READ_AS_BYTES:
        handlers[name] = handlers[name]._replace(request_deserializer=decode)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(captured.service, handlers),))
    server.add_registered_method_handlers(captured.service, handlers)
