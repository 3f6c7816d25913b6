"""Shared gRPC wiring (harnessrl/rpc.py): what every service's server and clients rely on."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from harnessrl import rpc


async def test_idle_streams_survive_keepalive_pings() -> None:
    """A stream that carries no data for many keepalive intervals (the gateway's RecordCalls
    stream while the trainer steps) stays open: the server accepts the pings the client sends.
    With gRPC's default server policy the connection ends in GOAWAY "too_many_pings" after
    about three pings. Keepalive is 1 s here instead of 30 s, with the same relationship."""
    options = rpc.grpc_options(keepalive_time_ms=1000)
    server = grpc.aio.server(options=options)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set("svc", health_pb2.HealthCheckResponse.SERVING)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="svc"))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(6)  # six pings without data
        assert not watch.done(), f"stream ended: {await watch.code()} {await watch.details()}"
        await health.set("svc", health_pb2.HealthCheckResponse.NOT_SERVING)
        second = await asyncio.wait_for(watch.read(), 5)
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    finally:
        await channel.close()
        await server.stop(None)
