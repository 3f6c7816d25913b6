"""LoRA runs' adapters on the engines (docs/lora.md): per (engine, adapter name) the version
that serves new calls, the versions still loaded for calls in flight, MARKED and held states.

A run whose `RunSpec.adapter` names an adapter is served only where that adapter is READY, as
its current `lora_name`, and each call is recorded with that adapter's version (not the
engine's). The trainer loads each new version under a new name and path
(`services/trainer/adapter_push.py`) and reports it with `SetAdapter`; from then on new calls get
it, while calls already at the engine finish on the version that started them. A replaced
version is unloaded from the engine (`POST /v1/unload_lora_adapter`) once its last call has
ended; the trainer deletes its files when no engine lists it any more.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from harnessrl.errors import InvalidArgument
from harnessrl.v1 import gateway_pb2 as gpb

log = logging.getLogger("harnessrl.gateway.adapters")

MAX_ADAPTERS = 256  # adapters per engine the gateway tracks


@dataclass
class AdapterState:
    engine: str
    name: str
    policy_version: int = 0
    lora_name: str = ""  # "" until a version is loaded: no traffic yet
    lora_path: str = ""
    marked: bool = False
    reason: str = ""
    paused: bool = False  # Pause(adapter=...): its calls are held
    # lora_name -> version: the current one and replaced ones still in use (a version pushed
    # again by a restarted trainer comes under a new name)
    loaded: dict[str, int] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)  # lora_name -> calls in flight
    served: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def usable(self) -> bool:
        return bool(self.lora_name) and not self.marked

    @property
    def calls(self) -> int:
        return sum(self.inflight.values())

    def to_proto(self) -> gpb.Adapter:
        return gpb.Adapter(
            engine=self.engine, name=self.name, policy_version=self.policy_version,
            lora_name=self.lora_name, lora_path=self.lora_path,
            state=gpb.ENGINE_STATE_MARKED if self.marked else gpb.ENGINE_STATE_READY,
            reason=self.reason, loaded_versions=sorted(set(self.loaded.values())),
            inflight=self.calls, paused=self.paused, served_calls=self.served,
            loaded_names=sorted(self.loaded, key=lambda n: n != self.lora_name))

    # -- a call's lease --------------------------------------------------------------------
    def take(self) -> int:
        """Counts a call in flight on the current version; returns that version."""
        name = self.lora_name
        self.inflight[name] = self.inflight.get(name, 0) + 1
        self.idle.clear()
        return self.policy_version

    def give_back(self, lora_name: str, served: bool) -> list[str]:
        """Ends a call sent as `lora_name`; returns the lora names no call needs any more."""
        left = self.inflight.get(lora_name, 0) - 1
        if left > 0:
            self.inflight[lora_name] = left
        else:
            self.inflight.pop(lora_name, None)
        if served:
            self.served += 1
        if not self.inflight:
            self.idle.set()
        return self.retire()

    def retire(self) -> list[str]:
        """Drops replaced versions with no call in flight; their lora names to unload."""
        done = [n for n in self.loaded if n != self.lora_name and n not in self.inflight]
        for n in done:
            del self.loaded[n]
        return done

    # -- administration ----------------------------------------------------------------------
    def set(self, version: int | None, lora_name: str, lora_path: str, state: int,
            reason: str) -> list[str]:
        """SetAdapter: READY with a loaded version (it serves new calls from now on), or
        MARKED. Returns the lora names to unload."""
        if state == gpb.ENGINE_STATE_READY:
            if version is None or version < 0 or not lora_name:
                raise InvalidArgument("READY needs policy_version >= 0 and lora_name")
            if len(lora_name) > 512 or len(lora_path) > 4096:
                raise InvalidArgument("lora_name or lora_path too long")
            if self.loaded.get(lora_name, version) != version:
                raise InvalidArgument(f"adapter {self.name!r} on {self.engine}: {lora_name!r} "
                                      f"is version {self.loaded[lora_name]}, not {version}")
            # any version: a resumed trainer pushes its checkpoint's, older than the last one
            self.policy_version, self.lora_name, self.lora_path = version, lora_name, lora_path
            self.loaded[lora_name] = version
            self.marked, self.reason = False, ""
            return self.retire()
        if state == gpb.ENGINE_STATE_MARKED:
            self.marked, self.reason = True, (reason or "marked")[:4096]
            log.warning("adapter %s marked on %s: %s", self.name, self.engine, self.reason,
                        extra={"engine": self.engine})
            return []
        raise InvalidArgument(f"SetAdapter state must be READY or MARKED, not {state}")

    @classmethod
    def from_proto(cls, rec: gpb.Adapter) -> AdapterState:
        """A restarted gateway's adapter (from the stored engine record). Its calls in flight
        ended with the old process, so only the current version is kept; replaced versions
        that were still loaded are unloaded by the trainer's clean-up at its next push (it
        knows their names)."""
        st = cls(rec.engine, rec.name, rec.policy_version, rec.lora_name, rec.lora_path,
                 rec.state == gpb.ENGINE_STATE_MARKED, rec.reason, rec.paused)
        if rec.lora_name:
            st.loaded[rec.lora_name] = rec.policy_version
        return st

    def end(self) -> None:
        """RemoveAdapter's first half: no new call (MARKED); its calls in flight go on."""
        self.marked, self.reason = True, REMOVED

    def lora_names(self) -> list[str]:
        """Every name the engine holds a version of it under, the current one first."""
        return [n for n in dict.fromkeys([self.lora_name, *self.loaded]) if n]


REMOVED = "removed (RemoveAdapter): its run is done"


def check_name(name: str) -> None:
    if not name or len(name) > 128:
        raise InvalidArgument("adapter name: 1-128 characters (RunSpec.adapter)")
