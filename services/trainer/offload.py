"""Where the trainer's state lives between collocated steps on a shared GPU.

With `mode.sleep_level` > 0 and `mode.offload` on a CUDA device, the trainer keeps its
parameters, gradients and optimizer state in host memory while the engines serve rollouts, and
brings them onto the device only while the engines sleep (docs/modes.md, "One device pool"):

    onload (params, optimizer state) -> step -> offload_optimizer (grads dropped too)
    -> the push reads the parameters on the device -> offload_params

Moves are whole-module `.to()` for the parameters (FSDP2's sharded parameters move their local
shards) and per-tensor for the optimizer state, as verl's FSDP2 offload does. On a CPU device every call is a no-op: there is nothing
to free, the engine and the trainer share host memory anyway.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("harnessrl.trainer")


class TrainerOffload:
    def __init__(self, device: torch.device | str, enabled: bool) -> None:
        self.device = torch.device(device)
        self.enabled = enabled and self.device.type == "cuda"
        self.seconds: dict[str, float] = {}  # the last move of each kind, for metrics
        self.params_on_device = self.optimizer_on_device = True  # as the trainer builds them
        if enabled and not self.enabled:
            log.info("trainer offload: a no-op on %s (nothing to free)", self.device)

    def _timed(self, what: str, t0: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[what] = time.perf_counter() - t0

    def hold_on_host(self) -> bool:
        """The trainer builds its state in host memory (True when offload is on)."""
        if self.enabled:
            self.params_on_device = self.optimizer_on_device = False
        return self.enabled

    @torch.no_grad()
    def onload(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """The parameters onto the device, and the optimizer state when given."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        model.to(self.device, non_blocking=True)
        self.params_on_device = True
        if optimizer is not None:
            _move_optimizer(optimizer, self.device)
            self.optimizer_on_device = True
        self._timed("onload_s", t0)

    @torch.no_grad()
    def offload_optimizer(self, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer | None) -> None:
        if not self.enabled or not self.optimizer_on_device:
            return
        t0 = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        if optimizer is not None:
            _move_optimizer(optimizer, torch.device("cpu"))
        self.optimizer_on_device = False
        torch.cuda.empty_cache()
        self._timed("offload_optimizer_s", t0)

    @torch.no_grad()
    def offload_params(self, model: torch.nn.Module) -> None:
        if not self.enabled or not self.params_on_device:
            return
        t0 = time.perf_counter()
        model.to("cpu")
        self.params_on_device = False
        torch.cuda.empty_cache()
        self._timed("offload_params_s", t0)


def _move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            # Adam's `step` counter stays where torch keeps it (on the host unless capturable)
            if key != "step" and isinstance(value, torch.Tensor) and value.device != device:
                state[key] = value.to(device)
