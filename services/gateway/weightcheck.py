"""Keeps calls off engines whose own weights are not the policy version the gateway records.

The gateway stamps every call with its engine's `policy_version`; that is only true if the
engine holds exactly those weights. Each vLLM engine says what it holds (`GET /weight_info`,
see `harnessrl.weight_versions`): `incomplete:<v>` after a push that was cut off (a mix of two
versions), `default` after a restart (its checkpoint's weights). A failed push that the trainer
lived through is MARKED by the trainer itself; these checks cover what nobody reported: a trainer
killed mid-push, an engine restarted behind the gateway's back.

`WeightCheck.verify` reads an engine's version and MARKs the engine (no traffic, the reason
says why) when it does not match. It runs

- every probe interval on each engine that takes traffic (`watch`),
- before an engine that was unreachable is counted reachable again (the health probe), and
- before paused engines are resumed (GatewayAdmin `Resume`),

never on an engine paused in the gateway (a push may be under way there: the engine then says
`incomplete:<v>` by design). An engine that refuses the connection is counted unreachable, so
one that comes back (restarted) is checked before it takes traffic again. MARKED is lifted only by `UpdateEngine(READY)`, which the trainer
sends after a push completes. An engine without the route (404; vLLM without
`VLLM_SERVER_DEV_MODE=1`, which no trainer can push to either) is not checked; its
`weight_version` stays "". A read that fails or times out decides nothing.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.weight_versions import matches, mismatch_reason
from services.gateway.engines import EngineRegistry, EngineState

log = logging.getLogger("harnessrl.gateway.weightcheck")


class WeightCheck:
    def __init__(self, registry: EngineRegistry, http: httpx.AsyncClient,
                 timeout_s: float = 10.0) -> None:
        self.registry = registry
        self.http = http
        self.timeout_s = timeout_s
        self._unchecked: set[str] = set()  # engines without /weight_info, logged once

    async def read(self, eng: EngineState) -> str | None:
        """The engine's own weight version, or None when it does not serve the route.
        Raises `httpx.HTTPError` when it does not answer (or answers an error)."""
        resp = await self.http.get(f"{eng.base_url}/weight_info", timeout=self.timeout_s)
        if resp.status_code == 404:
            if eng.name not in self._unchecked:
                self._unchecked.add(eng.name)
                log.warning("engine serves no /weight_info: its weights cannot be checked",
                            extra={"engine": eng.name})
            return None
        if resp.status_code in (401, 403):
            log.error("engine refuses the gateway's engine key: its weights cannot be checked",
                      extra={"engine": eng.name})
        resp.raise_for_status()
        version = resp.json().get("weight_version")
        return "" if version is None else str(version)

    async def verify(self, eng: EngineState) -> bool:
        """Reads `eng`'s weight version and MARKs it if it differs from its policy version.
        True when the engine may take traffic as far as its weights go (also when it cannot
        be checked); False when it was marked, already is, or did not answer."""
        try:
            reported = await self.read(eng)
        except httpx.ConnectError as e:  # nothing listens: down (maybe restarting)
            self.registry.mark_unreachable(eng, str(e))
            return False
        except (httpx.HTTPError, ValueError) as e:  # ValueError: not JSON
            log.info("weight check of %s: no answer (%s)", eng.name, e or type(e).__name__,
                     extra={"engine": eng.name})
            return False
        if reported is None:
            return not eng.marked
        eng.weight_version = reported
        if eng.marked:
            return False
        if matches(reported, eng.policy_version):
            return True
        if self.registry.engines.get(eng.name) is not eng:  # removed meanwhile
            return False
        self.registry.update(eng.name, None, gpb.ENGINE_STATE_MARKED,
                             mismatch_reason(reported, eng.policy_version))
        return False

    async def watch(self, interval: float) -> None:
        """Every `interval` seconds, verifies each engine that is not paused (a MARKED one
        only has what it reports refreshed, and is counted unreachable when it is down)."""
        while True:
            await asyncio.sleep(interval)
            for eng in list(self.registry.engines.values()):
                if eng.reachable and not eng.paused:
                    try:
                        await self.verify(eng)
                    except Exception:  # keep watching the others
                        log.exception("weight check of %s failed", eng.name,
                                      extra={"engine": eng.name})
