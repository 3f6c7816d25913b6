"""Honest health: each service answers NOT_SERVING while it cannot do its job, and SERVING
again once it can. Real Redis (stopped and started again), real store, gateway and
controller processes, the stub engine."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import os

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import GatewayService, RestartableRedis, StoreService, StubEngineService
from harnessrl import identity, procs, rpc
from harnessrl.clients import GatewayAdminClient


def health_status(address: str, peer: str) -> str:
    with rpc.channel(address, peer) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=2)
        except grpc.RpcError as err:
            return f"unreachable: {err.code().name}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def healthcheck(*args: str, module: str = "services.store") -> int:
    """Exit code of `python -m harnessrl.healthcheck` (the compose probes' command), run as a
    container runs it: with the service's own identity, no --peer."""
    env = {k: v for k, v in os.environ.items() if k != identity.TLS_DIR_ENV}
    return subprocess.run([sys.executable, "-m", "harnessrl.healthcheck", *args, "--timeout",
                           "2"], capture_output=True, timeout=60, check=False,
                          env={**env, **procs.identity_env(module)}).returncode


def wait_for(what: str, fn: Callable[[], object], want: object, timeout: float = 20.0) -> float:
    """Seconds until fn() == want."""
    t0 = time.monotonic()
    while (got := fn()) != want:
        assert time.monotonic() - t0 < timeout, f"{what}: {got!r}, not {want!r}, after {timeout}s"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_store_health_follows_redis(tmp_path: Path, own_redis: RestartableRedis,
                                    key_prefix: str) -> None:
    store = StoreService(tmp_path / "store", own_redis.url, key_prefix).start()
    try:
        assert health_status(store.address, "store") == "SERVING"
        own_redis.kill()
        took = wait_for("store with Redis down", lambda: health_status(store.address, "store"),
                        "NOT_SERVING")
        print(f"store NOT_SERVING {took:.1f}s after Redis died")
        # the probes: readiness fails, liveness (the process answers) passes
        assert healthcheck("grpc", store.address) == 1
        assert healthcheck("grpc", store.address, "--live") == 0
        own_redis.start()
        took = wait_for("store with Redis back", lambda: health_status(store.address, "store"),
                        "SERVING")
        print(f"store SERVING {took:.1f}s after Redis came back")
    finally:
        store.stop()


def test_gateway_health_follows_engines_and_store(tmp_path: Path, own_redis: RestartableRedis,
                                                  key_prefix: str,
                                                  stub_engine: StubEngineService) -> None:
    store = StoreService(tmp_path / "store", own_redis.url, key_prefix).start()
    gateway = GatewayService(tmp_path / "gw", store.address, [], "--hold-timeout-s", "2",
                             "--health-interval-s", "0.2")
    admin = GatewayAdminClient.connect(gateway.admin_address, timeout=10)
    health_url = gateway.base_url.removesuffix("/v1") + "/health"
    try:
        # no engine registered: cannot serve at all
        assert health_status(gateway.admin_address, "gateway") == "NOT_SERVING"
        assert httpx.get(health_url).status_code == 503
        admin.register_engine("e0", stub_engine.base_url, "tiny")
        wait_for("gateway with an engine", lambda: health_status(gateway.admin_address, "gateway"),
                 "SERVING")
        assert httpx.get(health_url).status_code == 200
        # a paused engine is usable: holding calls during a push is normal work
        admin.pause(drain=False)
        time.sleep(0.6)
        assert health_status(gateway.admin_address, "gateway") == "SERVING"
        admin.resume()
        # the store's Redis down: calls are held for hold_timeout_s (2 s), then 503
        own_redis.kill()
        took = wait_for("gateway with the store down", lambda: health_status(
            gateway.admin_address, "gateway"), "NOT_SERVING")
        assert took >= 1.5, f"NOT_SERVING after {took:.1f}s, before the hold timeout"
        body = httpx.get(health_url)
        assert body.status_code == 503 and "store unavailable" in body.json()["reason"]
        print(f"gateway NOT_SERVING {took:.1f}s after Redis died (hold_timeout_s 2)")
        own_redis.start()
        took = wait_for("gateway with the store back", lambda: health_status(
            gateway.admin_address, "gateway"), "SERVING")
        assert httpx.get(health_url).status_code == 200
        print(f"gateway SERVING {took:.1f}s after Redis came back")
    finally:
        admin.close()
        gateway.stop()
        store.stop()


def test_controller_health_follows_the_store(tmp_path: Path, own_redis: RestartableRedis,
                                             key_prefix: str) -> None:
    store = StoreService(tmp_path / "store", own_redis.url, key_prefix).start()
    controller, info = procs.start_service(
        "controller", "services.controller",
        ["--bind", "127.0.0.1:0", "--store-address", store.address,
         "--gateway-url", "http://127.0.0.1:9/v1", "--secret-file", str(tmp_path / "secret"),
         "--workdir-root", str(tmp_path / "rollouts"), "--health-interval-s", "0.2"],
        tmp_path / "controller", timeout=30)
    address = f"127.0.0.1:{info['grpc_port']}"
    try:
        assert health_status(address, "controller") == "SERVING"
        own_redis.kill()
        wait_for("controller with Redis down", lambda: health_status(address, "controller"), "NOT_SERVING")
        own_redis.start()
        wait_for("controller with Redis back", lambda: health_status(address, "controller"), "SERVING")
        store.kill()  # the store process itself gone
        wait_for("controller with the store dead", lambda: health_status(address, "controller"),
                 "NOT_SERVING")
        store.start()  # same port
        wait_for("controller with the store back", lambda: health_status(address, "controller"), "SERVING")
    finally:
        controller.stop()
        store.stop()
