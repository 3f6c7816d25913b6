"""Keeps a `Stack`'s processes running, as compose's `restart: unless-stopped` or a Deployment
would: a service that exits without being asked is started again with the same flags, on the
same ports (the stack chooses them once, at start), and each event is logged, appended to
`<state>/events.jsonl` and handed to a callback (the CLI prints it).

Per process (`ServiceProcess.restart`): "always" (the services, Redis, the engines),
"on-failure" (the trainer: exit 0 means its steps are done), "no". A process that dies within
`crash_window_s` of its start is restarted after a growing back-off (1, 2, 4 ... 30 s), and
given up on after `max_crash_restarts` such deaths in a row, so a crash loop does not spin.

What a restart needs besides the process itself:
- engine: it comes back with the weights it loaded from disk, not the trainer's. It is marked
  MARKED at the gateway (no traffic) as soon as it is seen dead; once healthy, the trainer is
  restarted (it resumes from its checkpoint and pushes its weights into every engine, which marks
  them READY again); with no trainer it is marked READY at the version the gateway had.
- gateway: restarts with the same flags; it reloads its engine registry (engines, policy
  versions, MARKED states, pauses) from the store, so calls carry the right version.
- trainer: restarts with `--resume` (`restart_argv`), after any engine being restarted is
  healthy again (its start pushes into every engine).
- controller: adopts the jobs of its earlier life itself (`RunManager.recover`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from harnessrl import procs
from harnessrl.local.events import Event

log = logging.getLogger("harnessrl.local.supervisor")


class SupervisedStack(Protocol):
    """What a `Supervisor` reads and changes of the stack it keeps running (`stack.Stack`)."""

    lock: threading.RLock  # guards procs: a restart swaps a process under it
    procs: dict[str, procs.ServiceProcess]
    stopping: bool  # set (under lock) when the stack stops: no restart starts after it
    redis_url: str
    gateway_admin_address: str


class Supervisor:
    def __init__(self, stack: SupervisedStack, events_file: Path, poll_s: float = 0.25,
                 on_event: Callable[[Event], None] | None = None,
                 crash_window_s: float = 10.0, ready_timeout_s: float = 600.0,
                 max_crash_restarts: int = 5, adapters: bool = False) -> None:
        """`adapters`: the engines serve LoRA adapters (`StackConfig.lora`)."""
        self.stack = stack
        self.adapters = adapters
        self.events_file = Path(events_file)
        self.poll_s = poll_s
        self.on_event = on_event
        self.crash_window_s = crash_window_s
        self.ready_timeout_s = ready_timeout_s
        self.events: list[Event] = []
        self._stop = threading.Event()
        self._busy: set[str] = set()  # being restarted
        self._done: set[str] = set()  # exited for good (trainer finished, restart "no")
        self._backoff: dict[str, float] = {}
        self._crashes: dict[str, int] = {}
        self.max_crash_restarts = max_crash_restarts
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    @property
    def restarting(self) -> set[str]:
        with self._lock:
            return set(self._busy)

    def _emit(self, ev: Event) -> None:
        self.events.append(ev)
        (log.warning if ev.kind in ("died", "restart_failed") else log.info)("%s", ev.line())
        with open(self.events_file, "a") as f:
            f.write(json.dumps(asdict(ev)) + "\n")
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:
                log.exception("event callback")

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check_once()

    def check_once(self) -> None:
        with self.stack.lock:  # Stack.restart swaps processes under it
            items = list(self.stack.procs.items())
            for name, proc in items:
                with self._lock:
                    if proc.alive or name in self._busy or name in self._done or \
                            proc.proc is None or self.stack.stopping:
                        continue
                    code = proc.proc.returncode
                    if proc.restart == "no" or (proc.restart == "on-failure" and code == 0):
                        self._done.add(name)
                        self._emit(Event(time.time(), name, "exited", code))
                        continue
                    self._busy.add(name)
                self._emit(Event(time.time(), name, "died", code))
                threading.Thread(target=self._restart, args=(name, proc), daemon=True,
                                 name=f"restart-{name}").start()

    # -- one restart -----------------------------------------------------------------------------
    def _restart(self, name: str, old: procs.ServiceProcess) -> None:
        seen_dead = time.monotonic()
        try:
            if time.time() - old.started_at < self.crash_window_s:
                self._crashes[name] = self._crashes.get(name, 0) + 1
                if self._crashes[name] > self.max_crash_restarts:
                    self._emit(Event(time.time(), name, "gave_up", detail=(
                        f"died within {self.crash_window_s:.0f}s of its start "
                        f"{self._crashes[name]} times in a row; log {old.log_path}")))
                    with self._lock:
                        self._done.add(name)
                    return
                delay = min(30.0, self._backoff.get(name, 0.5) * 2)
                self._backoff[name] = delay
                if self._stop.wait(delay):
                    return
            else:
                self._backoff.pop(name, None)
                self._crashes.pop(name, None)
            if name == "trainer":  # its start pushes into every engine: not while one restarts
                deadline = time.monotonic() + self.ready_timeout_s
                while any(n.startswith("engine") for n in self.restarting) and \
                        time.monotonic() < deadline and not self._stop.wait(0.5):
                    pass
            is_engine = name.startswith("engine")
            if is_engine:
                self._mark_engine(name, "restarted: serves its start-up weights until a push")
            with self.stack.lock:
                if self.stack.stopping or self._stop.is_set() or \
                        self.stack.procs.get(name) is not old:
                    return  # stopping, or restarted by someone else (Stack.restart)
                new = old.respawn()
                self.stack.procs[name] = new
            self._wait_serving(new)
            self._emit(Event(time.time(), name, "restarted", detail=f"pid {new.proc.pid}"
                             if new.proc else "", down_s=time.monotonic() - seen_dead))
            if is_engine:
                self._after_engine_restart(name)
        except Exception as exc:  # noqa: BLE001 - reported, and retried on the next check
            self._emit(Event(time.time(), name, "restart_failed", detail=str(exc)[:500]))
        finally:
            with self._lock:
                self._busy.discard(name)

    def _wait_serving(self, proc: procs.ServiceProcess) -> None:
        wait_healthy = getattr(proc, "wait_healthy", None)
        if wait_healthy is not None:  # an engine: /health
            wait_healthy(self.ready_timeout_s)
        elif proc.ready_file is not None:
            proc.wait_ready(self.ready_timeout_s)
        elif proc.name == "redis":
            url = self.stack.redis_url
            deadline = time.monotonic() + 30
            while not procs.redis_alive(url):
                if not proc.alive or time.monotonic() > deadline:
                    raise RuntimeError(f"redis did not come back: {proc.log_tail()}")
                time.sleep(0.05)

    # -- engines and the gateway's registry ---------------------------------------------------
    def _admin(self):  # type: ignore[no-untyped-def]
        from harnessrl.clients import GatewayAdminClient

        return GatewayAdminClient.connect(self.stack.gateway_admin_address, timeout=5)

    def _mark_engine(self, name: str, reason: str) -> None:
        from harnessrl.v1 import gateway_pb2 as gpb

        try:
            admin = self._admin()
            try:
                admin.update_engine(name, state=gpb.ENGINE_STATE_MARKED, reason=reason)
            finally:
                admin.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("could not mark %s at the gateway: %s", name, exc)

    def _after_engine_restart(self, name: str) -> None:
        trainer = self.stack.procs.get("trainer")
        if self.adapters:  # its base weights are on disk; the adapters come
            self._ready(name)  # back from the gateway's reload and the trainer's next push
        if trainer is not None and trainer.alive:
            # its weights are only in the trainer: restart it (it resumes from its checkpoint
            # and pushes them into every engine, which marks this one READY)
            self._emit(Event(time.time(), "trainer", "killed",
                             detail=f"to push its weights into the restarted {name}"))
            trainer.kill()
            return
        if trainer is None:  # nothing trains: the weights on disk are the policy
            self._ready(name)

    def _ready(self, name: str) -> None:
        from harnessrl.v1 import gateway_pb2 as gpb

        admin = self._admin()
        try:
            admin.update_engine(name, state=gpb.ENGINE_STATE_READY)
        finally:
            admin.close()
