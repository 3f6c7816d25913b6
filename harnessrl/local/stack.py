"""The whole system on one machine: Redis, store, engine(s), gateway, controller.

`Stack` starts each piece as a child process in a state directory and stops them in reverse
order. Ports are chosen once, at start (free ones), and passed to each service explicitly, so a
service restarted (by `restart`, or by the `Supervisor` that `supervise` starts) comes back on
the same address and its clients simply reconnect. `harnessrl up`,
the end-to-end tests and the benchmarks use it; in production each service runs on its own
(docker compose, Kubernetes) with the same flags.
"""

from __future__ import annotations

import json
import os
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harnessrl import pki, procs, redis_server
from harnessrl.config import mask_passwords
from harnessrl.credentials import load_secret
from harnessrl.local.events import Event
from harnessrl.local.supervisor import Supervisor

if TYPE_CHECKING:
    from harnessrl.local.engine import LoraEngine

log = logging.getLogger("harnessrl.local.stack")


def default_weight_backend(mode: str = "sync") -> str:
    """gloo without CUDA (our vLLM plugin); with CUDA vLLM's own backends: ipc for collocated
    mode (this machine's engine and trainer share its GPU; NCCL refuses two ranks on one
    device), else nccl."""
    import torch

    if not torch.cuda.is_available():
        return "gloo"
    return "ipc" if mode == "collocated" else "nccl"


@dataclass
class StackConfig:
    state_dir: Path = field(default_factory=lambda: Path(".harnessrl"))
    """Where logs, the secret, rollout workdirs and a started Redis's data live."""
    redis_url: str | None = None
    """Redis to use, as given (credentials included); when none answers there and it is on this
    machine, one is started there (AOF on; the URL's password as requirepass). None: a Redis
    of the stack's own with a password (`harnessrl.redis_server`)."""
    key_prefix: str = "hrl:"
    """Prefix of every Redis key of this deployment."""
    model_dir: Path | None = None
    """Model the engines serve; None starts no engine (engines can be registered later)."""
    served_model_name: str = "tiny"
    """Model name harnesses ask for."""
    num_engines: int = 1
    """vLLM engines to start on model_dir."""
    external_engines: tuple[str, ...] = ()
    """Base URLs of engines already running (registered with the gateway as well)."""
    weight_transfer_backend: str | None = field(default_factory=default_weight_backend)
    """Enables vLLM's weight-transfer protocol with this backend (`default_weight_backend`)."""
    max_model_len: int = 32768
    """Engine context length (the tiny model's positions: room for a 40,000-character prompt)."""
    engine_extra_args: tuple[str, ...] = ()
    """Extra vLLM server flags."""
    gateway_flags: tuple[str, ...] = ()
    """Extra gateway flags (e.g. --hold-timeout-s 30)."""
    gateway_replicas: int = 1
    """Gateways sharing the store (docs/gateway-replicas.md): "gateway", "gateway1", ...; above
    one, a balancer (`harnessrl.local.balancer`) in front of their HTTP and GatewayAdmin ports,
    as a Service would be, is the address everything else uses."""
    controller_flags: tuple[str, ...] = ()
    """Extra controller flags."""
    lora: LoraEngine | None = None
    """The engines serve runtime-loaded LoRA adapters (docs/lora.md)."""


def tls_root(state: Path) -> Path:
    """Where a stack in `state` keeps its CA and identities: <state>/tls, or the PKI folder
    $HARNESSRL_TLS_ROOT names (several stacks under one CA, as the test suite runs them)."""
    return Path(os.environ.get(procs.TLS_ROOT_ENV) or state / "tls").resolve()


class Stack:
    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.state = Path(cfg.state_dir).resolve()
        self.logs = self.state / "logs"
        self.secret_file = self.state / "secret"
        self.tls = tls_root(self.state)
        """The stack's CA and identities (harnessrl/pki.py); the CLI acts as tls/operator."""
        self.engine_keys = self.state / "engine"
        """The engines' keys (harnessrl/engine_guard.py `EngineKeys`), made at start."""
        self.procs: dict[str, procs.ServiceProcess] = {}
        self.redis_url = cfg.redis_url or ""
        """The Redis URL, password included (never logged or written out: `addresses`)."""
        self.store_address = self.gateway_url = self.gateway_admin_address = ""
        self.controller_address = self.trainer_address = ""
        self.engines: list = []  # harnessrl.local.engine.EngineProcess
        self.balancers: list = []  # harnessrl.local.balancer.Balancer: gateway HTTP, admin
        self.lock = threading.RLock()  # guards procs against the supervisor's restarts
        self.stopping = False
        self.supervisor: "Supervisor | None" = None

    # lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Stack":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        load_secret(None, self.secret_file)
        issued = pki.Pki(self.tls).ensure()
        if issued:
            log.info("issued identities in %s: %s", self.tls, ", ".join(issued))
        from harnessrl.local.engine import stack_keys, start_engine
        keys = stack_keys(self.engine_keys)
        if self.cfg.model_dir is not None:  # slowest first: vLLM starts while the rest comes up
            for i in range(self.cfg.num_engines):
                eng = start_engine(self.cfg.model_dir, workdir=self.state / "engines",
                                   served_model_name=self.cfg.served_model_name,
                                   weight_transfer_backend=self.cfg.weight_transfer_backend,
                                   max_model_len=self.cfg.max_model_len,
                                   extra_args=self.cfg.engine_extra_args, lora=self.cfg.lora,
                                   keys=keys)
                self.engines.append(eng)
                self.procs[f"engine{i}"] = eng
        self.redis_url, redis_proc = procs.ensure_redis(self.cfg.redis_url, self.redis_dir) \
            if self.cfg.redis_url else redis_server.start_private(self.redis_dir)
        if redis_proc is not None:
            log.info("started redis-server with AOF at %s", mask_passwords(self.redis_url))
            self.procs["redis"] = redis_proc
        self._service("store", "services.store", "--bind", f"127.0.0.1:{procs.free_port()}",
                      "--key-prefix", self.cfg.key_prefix,
                      env={"HARNESSRL_STORE_REDIS_URL": self.redis_url})  # not on its argv
        self.store_address = self._address("store", "--bind")
        for eng in self.engines:
            eng.wait_healthy(600)
        urls = [e.base_url for e in self.engines] + list(self.cfg.external_engines)
        engines = [{"name": f"engine{i}", "base_url": url, "model": self.cfg.served_model_name,
                    **(self.cfg.lora.gateway_spec() if self.cfg.lora else {})}
                   for i, url in enumerate(urls)]
        ports = []
        model = self.cfg.model_dir  # a vision model's processor settings, recorded with images
        processor = ["--processor-dirs", json.dumps({self.cfg.served_model_name: str(model)})] \
            if model is not None and (Path(model) / "processor_config.json").is_file() else []
        for i in range(self.cfg.gateway_replicas):
            info = self._service(f"gateway{i or ''}", "services.gateway", "--http-port",
                                 str(procs.free_port()),
                                 "--grpc-bind", f"127.0.0.1:{procs.free_port()}",
                                 "--store-address", self.store_address,
                                 "--secret-file", str(self.secret_file),
                                 "--engines", json.dumps(engines), *processor,
                                 *self.cfg.gateway_flags, env=self.engine_env("gateway"))
            ports.append((info["http_port"], info["grpc_port"]))
        if len(ports) > 1:
            from harnessrl.local.balancer import Balancer
            self.balancers = [Balancer([("127.0.0.1", p[k]) for p in ports]).start()
                              for k in (0, 1)]
            ports = [(self.balancers[0].port, self.balancers[1].port)]
        self.gateway_url = f"http://127.0.0.1:{ports[0][0]}/v1"
        self.gateway_admin_address = f"127.0.0.1:{ports[0][1]}"
        self._service("controller", "services.controller", "--bind",
                             f"127.0.0.1:{procs.free_port()}",
                             "--store-address", self.store_address,
                             "--gateway-url", self.gateway_url,
                             "--secret-file", str(self.secret_file),
                             "--workdir-root", str(self.state / "rollouts"),
                             # sandboxed rollouts see nothing of the stack's state folder
                             "--sandbox-hidden-paths", json.dumps([str(self.state)]),
                             *self.cfg.controller_flags, env=self.engine_env("controller"))
        self.controller_address = self._address("controller", "--bind")

    def _service(self, name: str, module: str, *args: str,
                 env: dict[str, str] | None = None) -> dict:  # type: ignore[type-arg]
        self.procs[name], info = procs.start_service(name, module, list(args), self.logs, env,
                                                     tls_root=self.tls)
        return info

    def engine_env(self, service: str) -> dict[str, str]:
        """The engine key `service` ("gateway", "trainer", "controller": its judge's) needs
        (harnessrl.local.engine.key_env); a trainer started by the caller gets this."""
        from harnessrl.engine_guard import EngineKeys
        from harnessrl.local.engine import key_env
        return key_env(EngineKeys(self.engine_keys), service)

    @property
    def redis_dir(self) -> Path:
        return self.state / "redis"

    def _address(self, name: str, flag: str) -> str:
        argv = self.procs[name].argv
        return argv[argv.index(flag) + 1]

    def add(self, proc: procs.ServiceProcess) -> None:
        """Puts a process the caller started (the trainer) under the stack (and supervisor)."""
        with self.lock:
            self.procs[proc.name] = proc
            if proc.name == "trainer" and "--bind" in proc.argv:
                self.trainer_address = proc.argv[proc.argv.index("--bind") + 1]

    def supervise(self, on_event: "Callable[[Event], None] | None" = None) -> "Supervisor":
        """Starts restarting what dies (see `harnessrl.local.supervisor`); events go to
        `<state>/events.jsonl` and `on_event`."""
        self.supervisor = Supervisor(self, self.state / "events.jsonl", on_event=on_event,
                                     adapters=self.cfg.lora is not None)
        return self.supervisor.start()

    def restart(self, name: str, kill: bool = True) -> None:
        """kill -9 (or stop) a service and start it again with the same flags and port."""
        with self.lock:
            proc = self.procs[name]
            proc.kill() if kill else proc.stop()
            new = proc.respawn()
            self.procs[name] = new
        new.wait_ready(60)

    def addresses(self) -> dict[str, object]:
        """What another process needs to find this stack (written to `<state>/stack.json`)."""
        return {"store": self.store_address, "gateway_url": self.gateway_url,
                "gateway_admin": self.gateway_admin_address,
                "controller": self.controller_address, "trainer": self.trainer_address,
                "redis_url": mask_passwords(self.redis_url),  # stack.json is world-readable
                "redis_password_file": "" if self.cfg.redis_url else
                str(self.redis_dir / redis_server.PASSWORD_FILE),
                "key_prefix": self.cfg.key_prefix,
                "served_model_name": self.cfg.served_model_name,
                "model_dir": str(self.cfg.model_dir or ""),
                "engines": [e.base_url for e in self.engines] + list(self.cfg.external_engines),
                "logs": str(self.logs),
                "pids": {n: p.proc.pid for n, p in self.procs.items() if p.proc is not None}}

    def stop(self) -> None:
        with self.lock:  # no restart starts after this (the supervisor checks it under the lock)
            self.stopping = True
        if self.supervisor is not None:
            self.supervisor.stop()
        for name in reversed(list(self.procs)):
            try:
                self.procs[name].stop(timeout=20)
            except Exception:  # noqa: BLE001 - stop the rest regardless
                log.exception("stopping %s", name)
        for balancer in self.balancers:
            balancer.stop()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
