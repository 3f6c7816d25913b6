"""Domain errors. Servicers raise these; `harnessrl.rpc` maps them to explicit gRPC codes."""

from __future__ import annotations

import grpc


class HarnessRLError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(HarnessRLError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(HarnessRLError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(HarnessRLError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(HarnessRLError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhausted(HarnessRLError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(HarnessRLError):
    code = grpc.StatusCode.UNAVAILABLE


class AlreadyExists(HarnessRLError):
    code = grpc.StatusCode.ALREADY_EXISTS


_BY_CODE = {
    c.code: c
    for c in (InvalidArgument, NotFound, FailedPrecondition, Unauthenticated, ResourceExhausted,
              Unavailable, AlreadyExists)
}


def from_rpc_error(err: grpc.RpcError) -> HarnessRLError:
    """The domain error matching a client-side `grpc.RpcError` (for callers that branch on it)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    cls = _BY_CODE.get(code, HarnessRLError)
    return cls(err.details() if hasattr(err, "details") else str(err))
