"""Wires the gateway: HTTP data plane and GatewayAdmin (gRPC) in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import httpx

from harnessrl import rpc
from harnessrl.clients import StoreClient
from harnessrl.credentials import CredentialSigner, load_secret
from harnessrl.engine_guard import process_key
from harnessrl.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.admin import GatewayAdminServicer
from services.gateway.app import GatewayApp
from services.gateway.config import GatewayConfig
from services.gateway.engines import EngineRegistry
from services.gateway.health import GatewayReadiness
from services.gateway.http_server import serve_http
from services.gateway.recorder import CallRecorder
from services.gateway.registry_state import RegistryState
from services.gateway.replicas import ReplicaSet, advertised, default_name
from services.gateway.sessions import Sessions
from services.gateway.weightcheck import WeightCheck

log = logging.getLogger("harnessrl.gateway")


async def _probe_engines(registry: EngineRegistry, http: httpx.AsyncClient,
                         interval: float, weights: WeightCheck) -> None:
    """Marks unreachable engines reachable again once their /health answers (and their
    weights were checked: a restarted engine holds its checkpoint's)."""
    while True:
        await asyncio.sleep(interval)
        for eng in list(registry.engines.values()):
            if eng.reachable:
                continue
            with contextlib.suppress(httpx.HTTPError):
                resp = await http.get(f"{eng.base_url}/health", timeout=interval)
                if resp.status_code == 200 and (await weights.verify(eng) or eng.marked):
                    registry.mark_reachable(eng)


async def serve(cfg: GatewayConfig) -> None:
    signer = CredentialSigner(load_secret(cfg.secret, cfg.secret_file))
    store = StoreClient.connect_async(cfg.store_address, timeout=10.0)
    registry = EngineRegistry()
    state = RegistryState(store, cfg.state_namespace, cfg.state_write_timeout_s)
    await state.restore(registry, cfg.engines, cfg.state_load_timeout_s)
    readiness = GatewayReadiness(registry, store.channel, cfg.hold_timeout_s)
    engine_key = process_key()  # HARNESSRL_ENGINE_API_KEY[_FILE]; a file named but missing: exit
    log.info("engine key: %s", "sent to every engine" if engine_key else
             "none (engines with harnessrl.engine_guard refuse this gateway)")
    http = httpx.AsyncClient(auth=engine_key)  # health probes of engines; weight checks
    weights = WeightCheck(registry, http)
    recorder = CallRecorder(store, cfg.hold_timeout_s, cfg.record_batch_max,
                            cfg.record_writers, cfg.record_batch_timeout_s)
    admin = GatewayAdminServicer(registry, weights, state, None, cfg.state_load_timeout_s)
    grpc_server, grpc_port, _ = await rpc.start_server(cfg.grpc_bind, [
        (gateway_pb2_grpc.add_GatewayAdminServicer_to_server, admin,
         gateway_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"].full_name),
    ], ready=readiness.check, ready_interval_s=cfg.health_interval_s)

    def on_peers(alone: bool) -> None:
        registry.hash_routing = not alone

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.http_host, cfg.http_port))
    http_port = sock.getsockname()[1]
    admin_address = cfg.advertise_address or advertised(cfg.grpc_bind, grpc_port)
    replicas = ReplicaSet(
        store, cfg.replica_namespace, cfg.replica_name or default_name(grpc_port),
        admin_address, cfg.replica_heartbeat_s, cfg.replica_ttl_s,
        lambda: state.reload(registry, [], cfg.state_load_timeout_s), on_peers,
        cfg.advertise_http_address or f"{admin_address.rsplit(':', 1)[0]}:{http_port}")
    await replicas.beat()  # the peers, before any call (a store down: the gateway exits)
    admin.replicas = readiness.replicas = replicas
    sessions = Sessions(signer, store, replicas=replicas, hold_timeout_s=cfg.hold_timeout_s)
    app = GatewayApp(cfg, registry, sessions, recorder, store)
    app.readiness = readiness
    http_server = await serve_http(app.handle, sock, cfg.max_body_bytes,
                                   cfg.http_idle_timeout_s, cfg.http_read_timeout_s)
    probe = asyncio.create_task(_probe_engines(registry, http, cfg.engine_probe_interval_s,
                                               weights))
    weight_watch = asyncio.create_task(weights.watch(cfg.engine_probe_interval_s))
    heartbeat = asyncio.create_task(replicas.run())
    log.info("gateway %s serving HTTP on %s:%d, GatewayAdmin on port %d, store %s", replicas.name,
             cfg.http_host, http_port, grpc_port, cfg.store_address)
    rpc.write_ready_file(cfg.ready_file, http_port=http_port, grpc_port=grpc_port)

    async def shutdown() -> None:  # still a replica (pauses reach it) until its calls are done
        readiness.stopping = True
        replicas.draining = True  # its rollouts move to its peers (the next heartbeat says so)
        cut = await http_server.drain(cfg.shutdown_grace_s)
        log.info("stopped serving HTTP%s", f"; {cut} connections cut after "
                 f"{cfg.shutdown_grace_s:g}s" if cut else "")
        probe.cancel()
        weight_watch.cancel()
        if app._background:  # aborted calls being recorded (their clients went away)
            await asyncio.wait(list(app._background), timeout=10)
        await recorder.close()
        heartbeat.cancel()
        await asyncio.gather(heartbeat, return_exceptions=True)  # no announcement after leave
        await replicas.leave()
        app.ownership.close()
        await http.aclose()
        await store.close()

    await rpc.wait_for_termination(grpc_server, on_stop=shutdown)
