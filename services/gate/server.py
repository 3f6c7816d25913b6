"""The gate's server: HTTP on a Unix socket, each allowed request forwarded to the Docker
daemon's socket as it came (responses streamed back: logs, wait), every other one answered
403 with the reason (`policy`) and logged."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import struct
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, UnixConnector, web

from harnessrl import log as hlog
from harnessrl import rpc
from services.gate import policy
from services.gate.config import GateConfig

log = logging.getLogger("harnessrl.gate")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
        "upgrade", "proxy-connection", "te", "trailer"}


class Gate:
    def __init__(self, cfg: GateConfig) -> None:
        self.cfg = cfg
        self.limits = policy.Limits(
            images=tuple(cfg.images), network=cfg.network,
            max_memory=cfg.max_memory_mb * 1024 * 1024, max_pids=cfg.max_pids,
            max_nano_cpus=int(cfg.max_cpus * 1e9))
        self.docker: ClientSession | None = None

    async def _managed(self, kind: str, name: str, starting: bool = False,
                       must_exist: bool = False) -> None:
        """Refused unless container/volume `name` carries the managed label (absent: the
        daemon's own 404 answers, unless it `must_exist`); a container to start must have its
        root read-only."""
        assert self.docker is not None
        path = f"/containers/{name}/json" if kind == "container" else f"/volumes/{name}"
        async with self.docker.get(f"http://docker{path}") as r:
            if r.status == 404:
                if must_exist:
                    raise policy.Refused(f"{kind} {name} was not made through the gate")
                return
            data = await r.json()
        labels = (data.get("Config") or {}).get("Labels") if kind == "container" \
            else data.get("Labels")
        if (labels or {}).get(policy.MANAGED_KEY) != policy.MANAGED_VALUE:
            raise policy.Refused(f"{kind} {name} is not a rollout's")
        if starting and not (data.get("HostConfig") or {}).get("ReadonlyRootfs"):
            raise policy.Refused(f"container {name} has a writable root: it may not start")

    async def _check(self, request: web.Request, body: bytes) -> None:
        kind, name = policy.route(request.method, request.path)
        if kind:
            await self._managed(kind, name, request.path.endswith("/start"))
        tail = request.path.rsplit("/", 1)[-1]
        if request.method == "POST" and tail == "create":
            try:
                data = json.loads(body or b"null")
            except ValueError:
                raise policy.Refused("the body is not JSON") from None
            if "/containers/" in request.path:
                policy.check_container(request.query.get("name", ""), data, self.limits)
                for mount in data["HostConfig"].get("Mounts") or []:  # (Docker would make a
                    await self._managed("volume", mount["Source"], must_exist=True)  # missing one)
            else:
                policy.check_volume(data)
        elif request.method == "PUT" and tail == "archive":
            policy.check_archive(name)
        elif request.method == "GET" and request.path.endswith("/containers/json"):
            try:
                filters = json.loads(request.query.get("filters", "{}") or "{}")
            except ValueError:
                raise policy.Refused("filters is not JSON") from None
            if not isinstance(filters, dict) or \
                    f"{policy.MANAGED_KEY}={policy.MANAGED_VALUE}" not in filters.get("label", []):
                raise policy.Refused("container lists must filter on the managed label")

    def _caller(self, request: web.Request) -> None:
        """Refused unless the connecting process runs as one of `allowed_uids`."""
        if not self.cfg.allowed_uids:
            return
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is None:
            raise policy.Refused("the caller cannot be identified")
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
        if uid not in self.cfg.allowed_uids:
            raise policy.Refused(f"uid {uid} may not call the gate")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.docker is not None
        body = await request.read()
        try:
            self._caller(request)
            await self._check(request, body)
        except policy.Refused as exc:
            log.warning("refused %s %s: %s", request.method, request.path_qs, exc)
            return web.json_response({"message": f"harnessrl gate: {exc}"}, status=403)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self.docker.request(request.method, f"http://docker{request.path_qs}",
                                       data=body or None, headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def run(self) -> None:
        self.docker = ClientSession(connector=UnixConnector(path=self.cfg.docker_socket),
                                    timeout=ClientTimeout(total=None, connect=30))
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        listen = Path(self.cfg.listen)
        listen.parent.mkdir(parents=True, exist_ok=True)
        listen.unlink(missing_ok=True)
        await web.UnixSite(runner, str(listen)).start()
        os.chmod(listen, 0o666)  # who reaches the folder may call: the controller alone
        log.info("gate serving on %s for images %s, network %s", listen,
                 ", ".join(self.limits.images) or "(none)", self.limits.network)
        rpc.write_ready_file(self.cfg.ready_file)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            await self.docker.close()


async def serve(cfg: GateConfig) -> None:
    await Gate(cfg).run()


def setup_logging(cfg: GateConfig) -> None:
    hlog.setup("gate", cfg.log_level)
    log.info("config %s", cfg.describe())
