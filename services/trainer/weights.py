"""Pushing the trainer's weights into every engine the gateway routes to.

`EngineWeights.push(model, version)` lists the engines registered with the gateway (engines
added or removed since the last push are picked up) and pushes through
`harnessrl.weight_transfer.WeightPusher` with `GatewayHooks`: per engine the gateway holds new
calls (Pause), the weights travel, the gateway records the engine's new policy version and
marks it READY, and releases the held calls (Resume).

Failure policy: an engine whose push fails is marked MARKED in the gateway with the reason (no
traffic reaches it) and left paused in vLLM, so nothing is ever served by a half-updated engine
(its own weight version says `incomplete:<v>` meanwhile, see `harnessrl.weight_versions`; the
gateway checks it too). The push of that version is then tried again on the failed engines only
(up to `attempts` times, `retry_delay_s` apart; the pusher re-joins a failed engine's weight
group first, and a success marks it READY again). If every try fails:

- when no engine got the version, the error (`PushError`, naming each failed engine and the
  stage) is raised and the trainer stops: nothing could serve the next step's rollouts;
- when some did, the push counts as done (`PushReport.failed` names the others): every engine
  that takes traffic serves the new version, as sync mode requires, and the failed ones stay
  MARKED, out of traffic, until a later push reaches them (every push includes them again).
  One dead engine among several does not stop training.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from harnessrl.clients import GatewayAdminClient
from harnessrl.weight_transfer import (
    EngineRef,
    EngineTiming,
    GatewayHooks,
    PushConfig,
    PushError,
    PushReport,
    WeightPusher,
)
from harnessrl.weight_transfer.transports import NamedTensors

log = logging.getLogger("harnessrl.trainer")


class WeightSink(Protocol):
    """Where the trainer's weights go after each step: the model itself, or (sharded, on rank
    0) its full tensors gathered bucket by bucket (`weight_transfer.sharded.GatheredWeights`)."""

    def push(self, model: torch.nn.Module | NamedTensors, version: int
             ) -> PushReport | None: ...

    def close(self) -> None: ...


class EngineWeights:
    """`WeightSink` into the engines registered with the gateway (see the module docstring)."""

    def __init__(self, admin: GatewayAdminClient, config: PushConfig, attempts: int = 3,
                 retry_delay_s: float = 2.0) -> None:
        self.admin = admin
        self.attempts = attempts
        self.retry_delay_s = retry_delay_s
        self.hooks = GatewayHooks(admin)
        self.pusher = WeightPusher([], config, self.hooks)
        self.exclude: set[str] = set()  # engines left out of pushes (a failed wake)

    def defer_ready(self, on: bool, exclude: set[str] | None = None) -> None:
        """Collocated steps with sleep: a pushed engine keeps its state (it is still partly
        asleep) until the trainer marks it READY; `exclude`d engines are not pushed to."""
        self.hooks.defer_ready = self.pusher.keep_paused = on  # the sleep paused the engine
        self.exclude = set(exclude or ()) if on else set()

    def _sync_engines(self) -> None:
        registered = {e.name: e.base_url for e in self.admin.list_engines().engines}
        if not registered:
            raise RuntimeError("no engines are registered with the gateway: nothing to push to")
        for name in self.pusher.engines:
            if name not in registered:
                log.info("engine %r left the gateway; no longer pushed to", name,
                         extra={"engine": name})
                self.pusher.remove_engine(name)
        for name, url in registered.items():
            if name not in self.pusher.engines:
                self.pusher.add_engine(EngineRef(name, url))

    def push(self, model: torch.nn.Module | NamedTensors, version: int) -> PushReport:
        done: dict[str, EngineTiming] = {}
        todo: list[str] | None = None  # None: every registered engine
        for attempt in range(1, self.attempts + 1):
            self._sync_engines()
            if todo is None and self.exclude:
                todo = [n for n in self.pusher.engines if n not in self.exclude]
            if todo is not None:  # the failed engines that are still registered
                todo = [n for n in todo if n in self.pusher.engines]
                if not todo:
                    return PushReport(version=version, bytes=0, wall_s=0.0, engines=done)
            try:
                report = self.pusher.push(model, version, engines=todo)
                report.engines = {**done, **report.engines}
                return report
            except PushError as e:
                log.error("push of version %d, try %d of %d: %s", version, attempt,
                          self.attempts, e, extra={"version": version})
                done.update(e.done)
                todo = e.failed_engines
                if attempt == self.attempts:
                    if not done:
                        raise
                    log.error("version %d reached %s; %s stay MARKED until a later push "
                              "reaches them", version, sorted(done), todo,
                              extra={"version": version})
                    return PushReport(version=version, bytes=e.bytes, wall_s=e.wall_s,
                                      engines=done, failed=dict(e.failures))
            time.sleep(self.retry_delay_s)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.pusher.close()

    def __enter__(self) -> EngineWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_sink(admin: GatewayAdminClient, cfg: Any) -> WeightSink:
    """Full weights into every engine, or (cfg.lora) the run's adapter into every LoRA engine."""
    p = cfg.push
    if cfg.lora is not None:
        from .adapter_push import AdapterWeights

        log.info("weight push: LoRA adapters (PEFT folders under %s)", adapter_root(cfg))
        return AdapterWeights(admin, cfg.lora.engine_adapter_dir, p.attempts, p.retry_delay_s,
                              p.http_timeout_s)
    log.info("weight transport: %s (%s)", p.backend, cfg.push_backend_reason)
    return EngineWeights(admin, p, p.attempts, p.retry_delay_s)


def push_model(model: torch.nn.Module, weights: WeightSink | None, version: int, dist: Any,
               cfg: Any, adapter: str) -> PushReport | None:
    """The trainer's push of `model` as `version` (cfg: `TrainerConfig`): straight from the
    model, or (sharded) rank 0 pushes the full tensors gathered bucket by bucket with the other
    ranks' help (they follow the gathers and get None). LoRA (adapter_push.py): every rank
    joins the save of the version's adapter folder, rank 0 loads it into the engines."""
    if cfg.lora is not None:
        from .adapter_push import AdapterWeights, version_dir
        from .lora import save_adapter

        path = version_dir(adapter_root(cfg) / adapter, version, dist)
        save_adapter(model, path, dist)
        if not dist.is_main:
            return None
        assert isinstance(weights, AdapterWeights) or hasattr(weights, "load"), weights
        return weights.load(path, version)  # type: ignore[union-attr]
    bucket_bytes = cfg.push.bucket_bytes
    if not dist.sharded:
        assert weights is not None
        return weights.push(model, version)
    from harnessrl.weight_transfer.sharded import GatheredWeights, follow_gathers

    from .sharding import object_group

    if dist.is_main:
        assert weights is not None
        with GatheredWeights(model, bucket_bytes, object_group()) as gathered:
            return weights.push(gathered, version)  # type: ignore[arg-type]
    follow_gathers(model, bucket_bytes, object_group())
    return None


def adapter_root(cfg: Any) -> Path:
    """Where a LoRA trainer writes its adapter versions (cfg: `TrainerConfig`)."""
    return Path(cfg.lora.adapter_dirs(cfg.output_dir)[0])
