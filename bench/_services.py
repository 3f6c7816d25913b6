"""Starting the harnessrl services for benchmarks (store, gateway, stub engine).

Services start as modules of the installed `harnessrl` and `services` packages; a helper of
`bench/` starts by its file path, never as `python -m bench.…`: `bench` is a folder of the
checkout, not an installed package, so a child process (whose cwd is its work folder) could not
import it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from harnessrl import identity, pki, procs, rpc
from harnessrl.clients import StoreClient
from harnessrl.credentials import CredentialSigner
from harnessrl.v1 import common_pb2 as c

VARIANTS = Path(__file__).resolve().parent / "_gateway_variants.py"


def bench_pki(workdir: Path) -> Path:
    """The PKI folder (harnessrl/pki.py) the bench's services take their identities from, as a
    deployment's do: $HARNESSRL_TLS_ROOT when set (the test session's), else a new one in
    `workdir`, made the bench process's $HARNESSRL_TLS_ROOT with the bench itself calling as
    `admin` (it plays controller, gateway and operator at once, as the tests do)."""
    root = os.environ.get(procs.TLS_ROOT_ENV, "")
    if root:
        if not os.environ.get(identity.TLS_DIR_ENV) and (Path(root) / "admin").is_dir():
            os.environ[identity.TLS_DIR_ENV] = str(Path(root) / "admin")
        return Path(root)
    folder = workdir / "pki"
    pki.Pki(folder).ensure(pki.ALL_IDENTITIES)
    os.environ[procs.TLS_ROOT_ENV] = str(folder)
    os.environ[identity.TLS_DIR_ENV] = str(folder / "admin")
    return folder


def start_store(workdir: Path, redis_url: str, env: dict[str, str] | None = None
                ) -> tuple[procs.ServiceProcess, str]:
    proc, info = procs.start_service("store", "services.store",
                                     ["--bind", "127.0.0.1:0", "--redis-url", redis_url], workdir,
                                     env=env)
    return proc, f"127.0.0.1:{info['grpc_port']}"


def start_gateway(workdir: Path, store_address: str, secret: str,
                  engines: list[dict[str, object]], http_server: str = "builtin",
                  engine_client: str = "builtin", extra: tuple[str, ...] = (),
                  env: dict[str, str] | None = None) -> tuple[procs.ServiceProcess, dict]:  # type: ignore[type-arg]
    """The gateway (with `extra` flags; `env` added to its environment); with another
    `http_server` or `engine_client` than its own, the variant of `bench/_gateway_variants.py`."""
    flags = ["--http-port", "0", "--grpc-bind", "127.0.0.1:0", "--store-address", store_address,
             "--engines", json.dumps(engines), *extra]
    env = {**(env or {}), "HARNESSRL_SECRET": secret}
    if (http_server, engine_client) == ("builtin", "builtin"):
        return procs.start_service("gateway", "services.gateway", flags, workdir, env=env)
    name = f"gateway-{http_server}-{engine_client}"
    ready = workdir / f"{name}.ready"
    env = {**procs.identity_env("services.gateway"), **env}  # a file path, not `-m services.X`
    proc = procs.ServiceProcess(
        name, [sys.executable, str(VARIANTS), "--http-server", http_server, "--engine-client",
               engine_client, *flags, "--ready-file", str(ready)],
        workdir, env=env, ready_file=ready).start()
    return proc, proc.wait_ready(60.0)


def start_stub_engine(workdir: Path, model: str) -> tuple[procs.ServiceProcess, str]:
    proc, info = procs.start_service("stub", "harnessrl.testing.stub_engine",
                                     ["--model", model], workdir)
    return proc, f"http://127.0.0.1:{info['http_port']}"


def start_world(workdir: Path, model: str,
                started: list[procs.ServiceProcess]) -> tuple[str, str, str]:
    """Redis, a store on it and a stub engine serving `model`, each appended to `started` (the
    caller stops them); returns (redis URL, store address, stub engine URL). The services run
    authenticated, with identities from `bench_pki`."""
    bench_pki(workdir)
    redis_url, redis_proc = procs.start_redis(workdir / "redis")
    started.append(redis_proc)
    store_proc, store_addr = start_store(workdir, redis_url)
    started.append(store_proc)
    stub_proc, stub_url = start_stub_engine(workdir, model)
    started.append(stub_proc)
    return redis_url, store_addr, stub_url


def running_attempt(store_address: str, rollout_id: str, secret: str,
                    ident: identity.Identity | None = rpc.OWN) -> str:
    """Creates rollout `rollout_id` in the store (calling as `ident`, default this process's
    identity; None: plaintext), starts its attempt 1; returns its key."""
    store = StoreClient.connect(store_address, ident=ident)
    store.create_rollouts([c.Rollout(rollout_id=rollout_id, run_id="bench", task_id="t",
                                     group_id="bench/t", group_size=1, stream="-")])
    store.start_attempt(rollout_id, 1)
    store.close()
    return CredentialSigner(secret.encode()).mint(rollout_id, 1, 3600)
