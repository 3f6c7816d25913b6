"""Wires the controller: store client, job backends, credential signer, gRPC server."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from harnessrl import rpc
from harnessrl.credentials import CredentialSigner, load_secret
from harnessrl.metrics import serve_metrics
from harnessrl.v1 import controller_pb2, controller_pb2_grpc
from services.controller.backends import JobBackend, LocalBackend
from services.controller.config import ControllerConfig
from services.controller.run_execution import RunContext
from services.controller.run_manager import RunManager
from services.controller.sandbox import Sandbox, Unavailable, egress
from services.controller.servicer import ControllerServicer
from services.controller.grader_access import GraderAccess
from services.controller.store_calls import ResilientStore

log = logging.getLogger("harnessrl.controller")


def make_sandbox(cfg: ControllerConfig) -> Sandbox | None:
    """The local backend's sandbox, checked; `Unavailable` says why none can be made here."""
    if not cfg.local_backend:
        return None  # (no local jobs to sandbox)
    if not cfg.sandbox:
        log.warning("SANDBOX OFF (--sandbox false): every rollout of this controller runs "
                    "unsandboxed, with the controller's user, files and network: a harness "
                    "can read the secret and forge its reward. Use it for trusted harnesses "
                    "only.")
        return None
    doors = Path(cfg.sandbox_doors) if cfg.sandbox_doors else \
        egress.default_root(Path(cfg.workdir_root))
    sandbox = Sandbox(doors)
    sandbox.check()
    return sandbox


def make_backends(cfg: ControllerConfig, sandbox: Sandbox | None = None
                  ) -> dict[str, JobBackend]:
    """The local backend unless turned off; the docker one when an image is configured, the
    kubernetes one when a Job template is."""
    backends: dict[str, JobBackend] = {"local": LocalBackend(
        kill_grace_s=cfg.kill_grace_s, nice=cfg.local_job_nice, cpus=cfg.local_job_cpus,
        sandbox=sandbox)} if cfg.local_backend else {}
    if cfg.k8s.job_template:
        from services.controller.backends.k8s_manifests import load_template
        from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings

        k8s = cfg.k8s
        backends["kubernetes"] = KubernetesBackend(KubernetesSettings(
            job_template=load_template(k8s.job_template),
            gateway_url=k8s.gateway_url or cfg.gateway_url, namespace=k8s.namespace,
            kubeconfig=k8s.kubeconfig, creates_per_s=k8s.job_creates_per_s,
            relist_s=k8s.relist_s, pending_timeout_s=k8s.pending_timeout_s,
            secret_timeout_s=k8s.secret_timeout_s, ttl_after_finished_s=k8s.ttl_after_finished_s,
            deadline_margin_s=k8s.deadline_margin_s, kill_grace_s=cfg.kill_grace_s))
    if cfg.docker_image:
        from services.controller.backends.docker import DockerBackend, DockerSettings

        backends["docker"] = DockerBackend(DockerSettings(
            socket=cfg.docker_socket, image=cfg.docker_image, network=cfg.docker_network,
            gateway_url=cfg.docker_gateway_url or cfg.gateway_url,
            memory_mb=cfg.docker_memory_mb, pids_limit=cfg.docker_pids_limit,
            cpus=cfg.docker_cpus))
    if cfg.default_backend not in backends:
        raise ValueError(f"default_backend {cfg.default_backend!r} is not available: " + {
            "kubernetes": "set k8s.job_template for the kubernetes backend",
            "docker": "set docker_image for the docker backend",
            "local": "local_backend is false"}.get(
                cfg.default_backend, f"choose one of {', '.join(backends)}"))
    return backends


async def serve(cfg: ControllerConfig) -> None:
    signer = CredentialSigner(load_secret(cfg.secret, cfg.secret_file))
    store = ResilientStore(cfg.store_address, call_timeout_s=cfg.store_call_timeout_s,
                           retry_s=cfg.store_retry_s)
    try:
        sandbox = make_sandbox(cfg)
    except Unavailable as exc:
        log.error("cannot sandbox rollouts: %s", exc)
        raise SystemExit(f"controller: cannot sandbox rollouts: {exc}") from None
    backends = make_backends(cfg, sandbox)
    runs = RunManager(RunContext(cfg=cfg, store=store, backends=backends, signer=signer,
                                 job_slots=asyncio.Semaphore(cfg.max_jobs),
                                 graders=GraderAccess(cfg.grader_tls_dir)))
    # Runs an earlier controller left running are resumed (their jobs adopted) first.
    await runs.recover()
    async def ready() -> tuple[bool, str]:
        """SERVING while the store answers SERVING (runs cannot progress without it)."""
        ok, why = await rpc.peer_serving(store.client.channel, cfg.health_interval_s * 2)
        return ok, "" if ok else f"store at {cfg.store_address} unavailable: {why}"

    server, port, _ = await rpc.start_server(cfg.bind, [
        (controller_pb2_grpc.add_ControllerServicer_to_server, ControllerServicer(runs),
         controller_pb2.DESCRIPTOR.services_by_name["Controller"].full_name),
    ], ready=ready, ready_interval_s=cfg.health_interval_s)
    log.info("controller serving on port %d, store %s, gateway %s, backends %s", port,
             cfg.store_address, cfg.gateway_url, ", ".join(backends))
    rpc.write_ready_file(cfg.ready_file, grpc_port=port,
                         metrics_port=serve_metrics(cfg.metrics_bind))

    async def stop() -> None:
        await runs.shutdown()
        for backend in backends.values():
            await backend.close()

    try:
        await rpc.wait_for_termination(server, on_stop=stop)
    finally:
        await store.close()
