"""Wires the controller: store client, job backends, credential signer, gRPC server."""

from __future__ import annotations

import asyncio
import logging

from harnessrl import rpc
from harnessrl.credentials import CredentialSigner, load_secret
from harnessrl.v1 import controller_pb2, controller_pb2_grpc
from services.controller.backends import JobBackend, LocalBackend
from services.controller.config import ControllerConfig
from services.controller.run_execution import RunContext
from services.controller.run_manager import RunManager
from services.controller.servicer import ControllerServicer
from services.controller.store_calls import ResilientStore

log = logging.getLogger("harnessrl.controller")


def make_backends(cfg: ControllerConfig) -> dict[str, JobBackend]:
    return {"local": LocalBackend(kill_grace_s=cfg.kill_grace_s)}


async def serve(cfg: ControllerConfig) -> None:
    signer = CredentialSigner(load_secret(cfg.secret, cfg.secret_file))
    store = ResilientStore(cfg.store_address, call_timeout_s=cfg.store_call_timeout_s,
                           retry_s=cfg.store_retry_s)
    backends = make_backends(cfg)
    runs = RunManager(RunContext(cfg=cfg, store=store, backends=backends, signer=signer,
                                 job_slots=asyncio.Semaphore(cfg.max_jobs)))
    # Runs an earlier controller left running are resumed (their jobs adopted) first.
    await runs.recover()
    server, port, _ = await rpc.start_server(cfg.bind, [
        (controller_pb2_grpc.add_ControllerServicer_to_server, ControllerServicer(runs),
         controller_pb2.DESCRIPTOR.services_by_name["Controller"].full_name),
    ])
    log.info("controller serving on port %d, store %s, gateway %s, backends %s", port,
             cfg.store_address, cfg.gateway_url, ", ".join(backends))
    rpc.write_ready_file(cfg.ready_file, grpc_port=port)

    async def stop() -> None:
        await runs.shutdown()
        for backend in backends.values():
            await backend.close()

    try:
        await rpc.wait_for_termination(server, on_stop=stop)
    finally:
        await store.close()
