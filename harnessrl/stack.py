"""The whole system on one machine: Redis, store, engine(s), gateway, controller.

`Stack` starts each piece as a child process (services on port 0, announcing their ports
through ready files) in a state directory, and stops them in reverse order. `harnessrl up`,
the end-to-end tests and the benchmarks use it; in production each service runs on its own
(docker compose, Kubernetes) with the same flags.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl import procs
from harnessrl.credentials import load_secret

log = logging.getLogger("harnessrl.stack")


def default_weight_backend() -> str:
    """nccl where CUDA is available (vLLM's own backend), else gloo (our vLLM plugin)."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass
class StackConfig:
    state_dir: Path = field(default_factory=lambda: Path(".harnessrl"))
    """Where logs, the secret, rollout workdirs and a started Redis's data live."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis to use; when none answers there, one is started (AOF on) on that port."""
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
    """Enables vLLM's weight-transfer protocol with this backend (gloo on CPU, nccl on GPU)."""
    max_model_len: int = 32768
    """Engine context length (the tiny model's positions: room for a 40,000-character prompt)."""
    engine_extra_args: tuple[str, ...] = ()
    """Extra vLLM server flags."""
    gateway_flags: tuple[str, ...] = ()
    """Extra gateway flags (e.g. --hold-timeout-s 30)."""
    controller_flags: tuple[str, ...] = ()
    """Extra controller flags."""


class Stack:
    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.state = Path(cfg.state_dir).resolve()
        self.logs = self.state / "logs"
        self.secret_file = self.state / "secret"
        self.procs: dict[str, procs.ServiceProcess] = {}
        self.redis_url = cfg.redis_url
        self.store_address = self.gateway_url = self.gateway_admin_address = ""
        self.controller_address = ""
        self.engines: list = []  # harnessrl.engine.EngineProcess

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
        if self.cfg.model_dir is not None:  # slowest first: vLLM starts while the rest comes up
            from harnessrl.engine import start_engine
            for i in range(self.cfg.num_engines):
                eng = start_engine(self.cfg.model_dir, workdir=self.state / "engines",
                                   served_model_name=self.cfg.served_model_name,
                                   weight_transfer_backend=self.cfg.weight_transfer_backend,
                                   max_model_len=self.cfg.max_model_len,
                                   extra_args=self.cfg.engine_extra_args)
                self.engines.append(eng)
                self.procs[f"engine{i}"] = eng
        self.redis_url, redis_proc = procs.ensure_redis(self.cfg.redis_url, self.state / "redis")
        if redis_proc is not None:
            log.info("started redis-server with AOF at %s", self.redis_url)
            self.procs["redis"] = redis_proc
        info = self._service("store", "services.store", "--bind", "127.0.0.1:0",
                             "--redis-url", self.redis_url, "--key-prefix", self.cfg.key_prefix)
        self.store_address = f"127.0.0.1:{info['grpc_port']}"
        for eng in self.engines:
            eng.wait_healthy(600)
        urls = [e.base_url for e in self.engines] + list(self.cfg.external_engines)
        engines = [{"name": f"engine{i}", "base_url": url, "model": self.cfg.served_model_name}
                   for i, url in enumerate(urls)]
        info = self._service("gateway", "services.gateway", "--http-port", "0",
                             "--grpc-bind", "127.0.0.1:0", "--store-address", self.store_address,
                             "--secret-file", str(self.secret_file),
                             "--engines", json.dumps(engines), *self.cfg.gateway_flags)
        self.gateway_url = f"http://127.0.0.1:{info['http_port']}/v1"
        self.gateway_admin_address = f"127.0.0.1:{info['grpc_port']}"
        info = self._service("controller", "services.controller", "--bind", "127.0.0.1:0",
                             "--store-address", self.store_address,
                             "--gateway-url", self.gateway_url,
                             "--secret-file", str(self.secret_file),
                             "--workdir-root", str(self.state / "rollouts"),
                             *self.cfg.controller_flags)
        self.controller_address = f"127.0.0.1:{info['grpc_port']}"

    def _service(self, name: str, module: str, *args: str) -> dict:  # type: ignore[type-arg]
        self.procs[name], info = procs.start_service(name, module, list(args), self.logs)
        return info

    def restart(self, name: str, kill: bool = True) -> None:
        """kill -9 (or stop) a service and start it again with the same flags and port."""
        proc = self.procs[name]
        proc.kill() if kill else proc.stop()
        argv = list(proc.argv)
        if "--bind" in argv:  # come back on the same port, so clients reconnect
            port = {"store": self.store_address, "controller": self.controller_address
                    }[name].rsplit(":", 1)[1]
            argv[argv.index("--bind") + 1] = f"127.0.0.1:{port}"
        new = procs.ServiceProcess(name, argv, self.logs, ready_file=proc.ready_file).start()
        self.procs[name] = new
        new.wait_ready(60)

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            try:
                self.procs[name].stop(timeout=20)
            except Exception:  # noqa: BLE001 - stop the rest regardless
                log.exception("stopping %s", name)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
