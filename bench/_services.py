"""Starting the harnessrl services for benchmarks (private Redis, store, gateway, engines)."""

from __future__ import annotations

import json
from pathlib import Path

from harnessrl import procs


def start_store(workdir: Path, redis_url: str) -> tuple[procs.ServiceProcess, str]:
    ready = workdir / "store.ready"
    proc = procs.ServiceProcess("store", procs.python_module(
        "services.store", "--bind", "127.0.0.1:0", "--redis-url", redis_url,
        "--ready-file", str(ready)), workdir, ready_file=ready).start()
    return proc, f"127.0.0.1:{proc.wait_ready(30)['grpc_port']}"


def start_gateway(workdir: Path, store_address: str, secret: str,
                  engines: list[dict[str, object]]) -> tuple[procs.ServiceProcess, dict]:  # type: ignore[type-arg]
    ready = workdir / "gateway.ready"
    proc = procs.ServiceProcess("gateway", procs.python_module(
        "services.gateway", "--http-port", "0", "--grpc-bind", "127.0.0.1:0",
        "--store-address", store_address, "--engines", json.dumps(engines),
        "--ready-file", str(ready)), workdir, ready_file=ready,
        env={"HARNESSRL_GATEWAY_SECRET": secret}).start()
    return proc, proc.wait_ready(30)


def start_stub_engine(workdir: Path, model: str) -> tuple[procs.ServiceProcess, str]:
    ready = workdir / "stub.ready"
    proc = procs.ServiceProcess("stub", procs.python_module(
        "harnessrl.testing.stub_engine", "--model", model, "--ready-file", str(ready)),
        workdir, ready_file=ready).start()
    return proc, f"http://127.0.0.1:{proc.wait_ready(30)['http_port']}"
