"""Wires the store: Redis connection, servicer, gRPC server with health and reflection."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from redis.exceptions import ConnectionError as RedisConnectionError, RedisError

from harnessrl import procs, rpc
from harnessrl.config import mask_passwords
from harnessrl.metrics import serve_metrics
from harnessrl.v1 import store_pb2
from services.store.call_bytes import add_store_servicer
from services.store.config import StoreConfig
from services.store.images import ImageStore
from services.store.metrics import refresh_streams
from services.store.redis_client import connect
from services.store.redis_store import RolloutStore
from services.store.servicer import StoreServicer

log = logging.getLogger("harnessrl.store")


def _hint(url: str, exc: BaseException) -> str:
    if url.startswith("redis://") and isinstance(exc, RedisConnectionError) and \
            ("reset by peer" in str(exc) or "closed by server" in str(exc)):
        return " (a Redis that speaks TLS drops plaintext: give it a rediss:// URL)"
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return (" (the store checks Redis's certificate against redis_tls_ca_file, or the "
                "system's CAs when that is empty, and the URL's host against its names)")
    return ""


async def serve(cfg: StoreConfig) -> None:
    redis_proc = None
    shown = mask_passwords(cfg.redis_url)  # the URL as logs, health and the ready file show it
    if cfg.start_redis:
        cfg.redis_url, redis_proc = procs.ensure_redis(cfg.redis_url, Path(cfg.redis_data_dir))
        if redis_proc is not None:
            log.info("started redis-server (AOF on) at %s, data in %s", shown,
                     cfg.redis_data_dir)
    client = connect(cfg.redis_url, socket_keepalive=True, health_check_interval=10,
                     **cfg.redis_tls_kwargs())
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        log.error("cannot use the Redis at %s: %s: %s%s", shown, type(exc).__name__,
                  mask_passwords(str(exc)), _hint(cfg.redis_url, exc))
        raise SystemExit(1) from None
    store = RolloutStore(client, cfg.key_prefix)
    images = ImageStore(client, cfg.key_prefix, cfg.max_image_bytes, cfg.max_image_store_bytes,
                        cfg.image_retention_s)

    async def ready() -> tuple[bool, str]:
        """SERVING while Redis answers a PING within the check interval."""
        try:
            await asyncio.wait_for(client.ping(), cfg.health_interval_s)
        except Exception as exc:  # noqa: BLE001 - any failure: Redis unreachable
            return False, f"redis unreachable at {shown}: {type(exc).__name__} {exc}"
        return True, ""

    server, port, _ = await rpc.start_server(cfg.bind, [
        (add_store_servicer,  # AppendCalls and RecordCalls keep each call's bytes
         StoreServicer(store, cfg.max_state_value_bytes, cfg.max_state_keys, images),
         store_pb2.DESCRIPTOR.services_by_name["Store"].full_name),
    ], ready=ready, ready_interval_s=cfg.health_interval_s)
    log.info("store serving on port %d, redis %s, prefix %r", port, shown,
             cfg.key_prefix)
    metrics_port = serve_metrics(cfg.metrics_bind)
    refresh = asyncio.create_task(refresh_streams(store.groups, cfg.metrics_refresh_s)) \
        if metrics_port is not None else None
    rpc.write_ready_file(cfg.ready_file, grpc_port=port, redis_url=shown,
                         metrics_port=metrics_port)
    try:
        await rpc.wait_for_termination(server)
    finally:
        if refresh is not None:
            refresh.cancel()
        await client.aclose()
        if redis_proc is not None:
            redis_proc.stop()
