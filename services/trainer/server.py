"""Wires the trainer: its gRPC service in a thread of its own (with its own asyncio loop), the
training loop in the main thread with its parts connected to the other services
(`build_trainer`), signals, the ready file."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from pathlib import Path
from types import FrameType

from harnessrl import identity, rpc
from harnessrl.clients import ControllerClient, GatewayAdminClient, StoreClient
from harnessrl.metrics import serve_metrics
from harnessrl.v1 import trainer_pb2, trainer_pb2_grpc

from .adapter_push import AdapterWeights
from .collocation import EngineSleep
from .config import TrainerConfig
from .control import TrainerControl
from .gauges import GatewayHold, Gauges
from .loop import Trainer, train
from .outputs import run_prefix_of
from .rollouts import ControllerRuns
from .servicer import TrainerServicer
from .sharding import Dist
from .weights import make_sink

log = logging.getLogger("harnessrl.trainer")

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


class ServerThread:
    """The Trainer gRPC service (plus health and reflection) served from a daemon thread, as
    `ident` (default: this process's identity; tests that serve it in their own process pass
    the trainer's)."""

    def __init__(self, bind: str, control: TrainerControl,
                 ident: identity.Identity | None = rpc.OWN) -> None:
        self.bind = bind
        self.control = control
        self.ident = ident
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trainer-grpc", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"trainer gRPC server not up after {timeout}s")
        if self._error is not None:
            raise RuntimeError(f"trainer gRPC server failed to start: {self._error}")
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server, self.port, _ = await rpc.start_server(self.bind, [
            (trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(self.control),
             SERVICE_NAME)], ident=self.ident)
        self._started.set()
        await self._stop.wait()
        await server.stop(2.0)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)


def _install_signal_handlers(control: TrainerControl) -> None:
    """First SIGTERM/SIGINT: stop after the step in progress (with a checkpoint); second: now."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if control.stop_requested:
            raise KeyboardInterrupt
        log.info("signal %d: stopping after the step in progress", signum)
        control.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def build_trainer(cfg: TrainerConfig, control: TrainerControl | None = None,
                  dist: Dist | None = None) -> Trainer:
    """The service's trainer: the controller runs the steps, the store's stream feeds it, the
    engines registered with the gateway get its weights. Sharded, only rank 0 connects to
    them (one voice); the other ranks follow it through collectives."""
    if dist is not None and not dist.is_main:
        return Trainer(cfg, None, None, None, control, dist)

    store = StoreClient.connect(cfg.store_address)
    adapter = run_prefix_of(Path(cfg.output_dir), cfg.run_name) if cfg.lora else ""  # LoRA
    launcher = ControllerRuns(ControllerClient.connect(cfg.controller_address),
                              cfg.run_timeout_s, adapter)
    admin = GatewayAdminClient.connect(cfg.gateway_admin_address)
    weights = make_sink(admin, cfg)
    controller = ControllerClient.connect(cfg.controller_address)
    gauges = Gauges(GatewayAdminClient.connect(cfg.gateway_admin_address), controller,
                    cfg.mode.gauge_interval_s)
    collocated, m = cfg.mode.kind == "collocated", cfg.mode
    hold = GatewayHold(admin, m.hold_drain_timeout_s, adapter) if collocated else None
    sleep = EngineSleep(admin, m.sleep_level, m.sleep_timeout_s) if m.sleep_level else None
    return Trainer(cfg, launcher, store, weights, control, dist, gauges=gauges, hold=hold,
                   admission=gauges, sleep=sleep)


def serve(cfg: TrainerConfig) -> int:
    """Runs the trainer until its steps are done or it is stopped; the exit code.

    Sharded (WORLD_SIZE > 1): every rank runs this; rank 0 alone serves the Trainer gRPC
    service, writes the ready file and handles SIGTERM/SIGINT gracefully (its stop reaches the
    others through the loop's collectives); another rank ends at once on SIGTERM (the default
    action: its launcher ends it only when the job is failing anyway)."""
    from .sharding import close_distributed, init_distributed

    dist = init_distributed(cfg.device, cfg.dist_timeout_s,
                            cfg.run_timeout_s + cfg.read_timeout_s + cfg.dist_timeout_s)
    control = TrainerControl()
    server = None
    if dist.is_main:
        server = ServerThread(cfg.bind, control).start()
        log.info("trainer gRPC service on port %d", server.port)
        rpc.write_ready_file(cfg.ready_file, grpc_port=server.port,
                             metrics_port=serve_metrics(cfg.metrics_bind))
        _install_signal_handlers(control)
    trainer = build_trainer(cfg, control, dist)
    try:
        train(trainer)
        if isinstance(trainer.weights, AdapterWeights):  # LoRA, rank 0: free the engines
            trainer.weights.retire()
        control.end()
        log.info("done: step %d, policy version %d, checkpoint %s", trainer.state.step,
                 trainer.state.policy_version, trainer.last_checkpoint)
        return 0
    except BaseException as e:
        control.end(error=f"{type(e).__name__}: {e}")
        log.exception("training stopped by an error")
        return 1
    finally:
        trainer.close()
        if server is not None:
            server.stop()
        close_distributed()
