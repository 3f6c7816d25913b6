"""Pushing a LoRA run's adapter into every LoRA engine (docs/lora.md).

Each policy version is written as a PEFT-format folder of its own,
`<adapter_dir>/<adapter>/v<version>-<nonce>` (`services/trainer/lora.py` `save_adapter`; every
rank joins it when the model is sharded), and loaded into each engine registered with LoRA
support by vLLM's runtime API, `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`, under
the name `<adapter>-v<version>-<nonce>`. A new name and path per push (a resumed trainer pushing
its checkpoint's version again included) keep vLLM's prefix cache from serving a stale
adapter (docs/vllm-cpu.md). The gateway then hears `SetAdapter(READY, version, name, path)`
and sends the run's new calls there; calls already at the engine finish on their version. No
engine is paused: other runs' adapters and base traffic keep flowing.

Failure policy, as for full weights (`weights.py`): an engine whose load fails is reported
`SetAdapter(MARKED, reason)`, so the run gets no traffic there (never its old adapter under the
new version; other runs are unaffected), and the load is tried again on the failed engines
(`attempts`, `retry_delay_s` apart). No engine loaded it: `PushError`, the trainer stops. Some
did: the push counts as done and the others stay MARKED until a later push reaches them.

Clean-up after each push: version folders of this adapter that no engine lists among its
loaded versions any more (the gateway unloads replaced versions after their last call) are
deleted, and unloaded from the engines once more (a restarted gateway forgets the names of
replaced versions still loaded).

When the run is done (the service's clean end), `retire` removes the adapter from the engines
(`RemoveAdapter`) and deletes its folders: a shared engine does not keep a slot, or the
gateway a record, for every run that ever trained on it.

Adapter files reach the engines through a shared folder: a volume mounted in the trainer and
the engines (compose), a ReadWriteMany volume (Kubernetes). `engine_adapter_dir` is that folder
as the engines see it when it is mounted elsewhere.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from harnessrl.clients import GatewayAdminClient
from harnessrl.engine_guard import process_key
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.weight_transfer import EngineTiming, PushError, PushReport
from harnessrl.weight_transfer.push import EngineFailure

log = logging.getLogger("harnessrl.trainer")

_VERSION_DIR = re.compile(r"^v(\d+)-[0-9a-f]{8}$")


def version_dir(root: Path, version: int, dist: Any) -> Path:
    """A new folder name for `version`, the same on every rank."""
    return root / f"v{version}-{dist.agree(uuid.uuid4().hex[:8])}"


class AdapterWeights:
    """The trainer's `WeightSink` for a LoRA run (see the module docstring): `weights.push_model`
    writes each version's folder (every rank joins the save when the model is sharded) and
    rank 0 calls `load`."""

    def __init__(self, admin: GatewayAdminClient, engine_adapter_dir: str = "",
                 attempts: int = 3, retry_delay_s: float = 2.0, http_timeout_s: float = 60.0
                 ) -> None:
        self.admin = admin
        self.engine_adapter_dir = engine_adapter_dir  # the folder as the engines see it
        self.adapter, self.root = "", Path()  # set by the first load
        self.attempts, self.retry_delay_s = attempts, retry_delay_s
        self.http = httpx.Client(timeout=http_timeout_s, auth=process_key())  # engine key

    def push(self, model: Any, version: int) -> PushReport:
        raise TypeError("a LoRA run's adapter is written by every rank: push it with "
                        "services.trainer.weights.push_model")

    @staticmethod
    def lora_name(path: Path) -> str:
        """`<adapter>-v<version>-<nonce>` for the folder `<root>/<adapter>/v<version>-<nonce>`."""
        return f"{path.parent.name}-{path.name}"

    def load(self, path: Path, version: int) -> PushReport:
        """Loads the adapter folder `path` (`<adapter_dir>/<adapter>/v<version>-<nonce>`) as
        `version` into every LoRA engine."""
        t0 = time.perf_counter()
        self.adapter, self.root = path.parent.name, path.parent
        engine_path = str(Path(self.engine_adapter_dir) / self.adapter / path.name) \
            if self.engine_adapter_dir else str(path)
        name = self.lora_name(path)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        done: dict[str, EngineTiming] = {}
        failures: dict[str, EngineFailure] = {}
        todo: list[str] | None = None
        for attempt in range(1, self.attempts + 1):
            engines = [e for e in self.admin.list_engines().engines if e.lora.enabled]
            if not engines:
                raise RuntimeError("no engine registered with the gateway serves LoRA "
                                   "adapters (start the engines with --enable-lora and "
                                   "register them with lora support): nothing to push to")
            failures = {}
            for e in engines:
                if todo is not None and e.name not in todo:
                    continue
                try:
                    t = time.perf_counter()
                    self.load_one(e, name, engine_path, retry=attempt > 1)
                    self.admin.set_adapter(e.name, self.adapter, gpb.ENGINE_STATE_READY,
                                           version, name, engine_path)
                    done[e.name] = EngineTiming(paused_s=0.0,
                                                transfer_s=time.perf_counter() - t, bytes=size)
                except Exception as err:  # noqa: BLE001 - the engine is marked, retried
                    failures[e.name] = EngineFailure(e.name, "load_lora_adapter", err)
                    self._mark(e.name, str(failures[e.name]))
            if not failures:
                break
            log.error("adapter %s version %d, try %d of %d: %s", self.adapter, version,
                      attempt, self.attempts, "; ".join(map(str, failures.values())),
                      extra={"version": version})
            todo = sorted(failures)
            if attempt < self.attempts:
                time.sleep(self.retry_delay_s)
        wall = time.perf_counter() - t0
        if not done:
            raise PushError(version, failures, bytes=size, wall_s=wall)
        if failures:
            log.error("adapter %s version %d reached %s; %s stay MARKED for it until a later "
                      "push reaches them", self.adapter, version, sorted(done),
                      sorted(failures), extra={"version": version})
        self.clean_up(path)
        return PushReport(version=version, bytes=size, wall_s=wall, engines=done,
                          failed=failures)

    def load_one(self, engine: gpb.Engine, name: str, path: str, retry: bool) -> None:
        """One engine's load of the adapter folder `path` under `name` (vLLM's runtime API);
        raises on any answer but 200. `retry`: the same files again, replacing."""
        body: dict[str, Any] = {"lora_name": name, "lora_path": path}
        if retry:  # the same files at the same path: replacing is safe (and needed if the
            body["load_inplace"] = True  # first try loaded it but its answer was lost)
        r = self.http.post(f"{engine.base_url}/v1/load_lora_adapter", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")

    def _mark(self, engine: str, reason: str) -> None:
        try:
            self.admin.set_adapter(engine, self.adapter, gpb.ENGINE_STATE_MARKED,
                                   reason=reason[:1000])
        except Exception as err:  # noqa: BLE001 - the push fails on this engine either way
            log.error("could not mark adapter %s on %s: %s", self.adapter, engine, err)

    def clean_up(self, current: Path) -> None:
        """Deletes (and unloads) this adapter's version folders that no engine still uses: not
        an engine's current version of it, nor a replaced one still serving calls (by name: a
        resumed trainer pushes a version number again, under a new name)."""
        engines = list(self.admin.list_engines().engines)
        names = {n for e in engines for a in e.adapters if a.name == self.adapter
                 for n in (a.lora_name, *a.loaded_names)}
        for folder in sorted(self.root.iterdir()) if self.root.exists() else []:
            if _VERSION_DIR.match(folder.name) is None or folder == current or \
                    self.lora_name(folder) in names:
                continue
            for e in engines:  # best effort: a restarted gateway forgets replaced names
                if e.lora.enabled:
                    try:
                        self.http.post(f"{e.base_url}/v1/unload_lora_adapter",
                                       json={"lora_name": self.lora_name(folder)})
                    except httpx.HTTPError:
                        pass  # unused either way: nothing is served from it
            shutil.rmtree(folder, ignore_errors=True)
            log.info("adapter version folder %s deleted", folder)

    def retire(self) -> None:
        """The run is done: its adapter is removed from the engines (`RemoveAdapter`: no new
        call, unloaded once its calls have ended), freeing their LoRA slots, and its version
        folders are deleted (the checkpoint holds the adapter: `harnessrl export`)."""
        if not self.adapter:
            return
        try:
            r = self.admin.remove_adapter(self.adapter)
        except Exception as err:  # noqa: BLE001 - the training itself is done and saved
            log.error("adapter %s could not be removed from the engines (it stays loaded, "
                      "its folders are kept): %s", self.adapter, err)
            return
        log.info("adapter %s removed from %s (unloaded %s)", self.adapter, list(r.engines),
                 list(r.unloaded))
        shutil.rmtree(self.root, ignore_errors=True)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> AdapterWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
