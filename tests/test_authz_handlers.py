"""The server's interceptors build their wrapper of a method's handler once, not per call
(bench/gateway_overhead.py --auth-only measured the per-call rebuild at about 6 µs per
interceptor per call), and the wrapper kept still decides every call by its own caller: a real
asyncio gRPC server (`rpc.start_server`, mTLS with the session's CA) serving GetRollout, called
in turn by identities the table allows and refuses.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import grpc
import pytest

import conftest
from harnessrl import authz, rpc
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb

METHOD = "/harnessrl.v1.Store/GetRollout"


async def get_rollout(request: spb.GetRolloutRequest, context: Any) -> c.Rollout:
    return c.Rollout(rollout_id=request.rollout_id)


def add_get_rollout(_servicer: object, server: grpc.aio.Server) -> None:
    handler = grpc.unary_unary_rpc_method_handler(
        get_rollout, request_deserializer=spb.GetRolloutRequest.FromString,
        response_serializer=c.Rollout.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "harnessrl.v1.Store", {"GetRollout": handler}),))


async def test_wrappers_are_built_once_per_method_and_every_call_is_still_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built: Counter[str] = Counter()
    authorize_wrap, refuse_wrap = authz.Authorize._wrap, rpc._RefuseUndecodable._wrap

    def counted_authorize(self: authz.Authorize, method: str, handler: Any) -> Any:
        built["authorize " + method] += 1
        return authorize_wrap(self, method, handler)

    def counted_refuse(handler: Any) -> Any:
        built["refuse-undecodable"] += 1
        return refuse_wrap(handler)

    monkeypatch.setattr(authz.Authorize, "_wrap", counted_authorize)
    monkeypatch.setattr(rpc._RefuseUndecodable, "_wrap", staticmethod(counted_refuse))
    server, port, _ = await rpc.start_server(
        "127.0.0.1:0", [(add_get_rollout, None, "harnessrl.v1.Store")],
        ident=conftest.as_identity("store"))
    channels = {name: rpc.aio_channel(f"127.0.0.1:{port}", "store", conftest.as_identity(name))
                for name in ("controller", "store", "reader", "grader")}
    calls = {name: ch.unary_unary(METHOD,
                                  request_serializer=spb.GetRolloutRequest.SerializeToString,
                                  response_deserializer=c.Rollout.FromString)
             for name, ch in channels.items()}
    try:
        # allowed, refused, allowed, refused (a grader without a scope token), 3 rounds: each
        # call decided by its own caller, whatever the one before was
        for i in range(3):
            for name, call in calls.items():
                rollout_id = f"r{i}-{name}"
                if authz.allowed(name, METHOD) and name != authz.GRADER:
                    assert (await call(spb.GetRolloutRequest(rollout_id=rollout_id))
                            ).rollout_id == rollout_id
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(spb.GetRolloutRequest(rollout_id=rollout_id))
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
                assert f"identity {name!r} may not call {METHOD}" in str(err.value.details())
    finally:
        for ch in channels.values():
            await ch.close()
        await server.stop(0)
    assert built == {"authorize " + METHOD: 1, "refuse-undecodable": 1}
