"""The few Docker Engine API calls the Docker job backend makes, over a Unix socket (aiohttp).

The socket is a Docker daemon's, or in Compose the rollout gate's (`services/gate`): the gate
answers the same API but lets through only what rollouts need. Errors come back as
`DockerError` with the daemon's (or the gate's) message and HTTP status.
"""

from __future__ import annotations

import asyncio
import io
import json
import struct
import tarfile
from typing import Any

import aiohttp

API_VERSION = "v1.41"  # Docker 20.10 (Debian 12's docker.io) and every later daemon


class DockerError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{message} (HTTP {status})")
        self.status = status


class DockerAPI:
    def __init__(self, socket_path: str, timeout_s: float = 30.0) -> None:
        self.socket_path = socket_path
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # (made on the event loop that uses it)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path), timeout=self._timeout)
        return self._session

    async def _call(self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201, 204),
                    timeout: float | None = -1.0, **kw: Any) -> tuple[int, Any]:
        """(status, JSON body or None) of one call."""
        if timeout != -1.0:
            kw["timeout"] = aiohttp.ClientTimeout(total=timeout)
        url = f"http://docker/{API_VERSION}{path}"
        try:
            async with self._client().request(method, url, **kw) as r:
                body = await r.read()
                status = r.status
        except (aiohttp.ClientError, OSError) as exc:
            raise DockerError(0, f"Docker at {self.socket_path} unreachable: {exc!r}") from None
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        if status not in ok:
            message = data.get("message", "") if isinstance(data, dict) else ""
            raise DockerError(status, f"{method} {path}: "
                              f"{(message or body.decode(errors='replace')).strip()}")
        return status, data

    async def ping(self) -> None:
        await self._call("GET", "/_ping")

    async def create_volume(self, name: str, labels: dict[str, str]) -> None:
        await self._call("POST", "/volumes/create", json={"Name": name, "Labels": labels})

    async def remove_volume(self, name: str) -> None:
        await self._call("DELETE", f"/volumes/{name}", params={"force": "true"},
                         ok=(204, 404))

    async def create(self, name: str, config: dict[str, Any]) -> None:
        await self._call("POST", "/containers/create", params={"name": name}, json=config)

    async def start(self, name: str) -> None:
        await self._call("POST", f"/containers/{name}/start", ok=(204, 304))

    async def inspect(self, name: str) -> dict[str, Any] | None:
        """The container's record, or None when there is no such container."""
        status, data = await self._call("GET", f"/containers/{name}/json", ok=(200, 404))
        return None if status == 404 else data  # type: ignore[no-any-return]

    async def wait(self, name: str) -> int:
        """Blocks until the container is not running; its exit status."""
        _, data = await self._call("POST", f"/containers/{name}/wait",
                                   params={"condition": "not-running"}, timeout=None)
        return int(data["StatusCode"])

    async def kill(self, name: str) -> None:
        await self._call("POST", f"/containers/{name}/kill", params={"signal": "SIGKILL"},
                         ok=(204, 404, 409))  # 409: not running

    async def remove(self, name: str) -> None:
        await self._call("DELETE", f"/containers/{name}", params={"force": "true"},
                         ok=(204, 404))

    async def logs(self, name: str, limit_bytes: int) -> tuple[bytes, bytes]:
        """The container's stdout and stderr (each cut at `limit_bytes`)."""
        out, err = bytearray(), bytearray()
        url = f"http://docker/{API_VERSION}/containers/{name}/logs"
        try:
            async with self._client().get(url, params={"stdout": "1", "stderr": "1"}) as r:
                if r.status != 200:
                    raise DockerError(r.status, f"logs of {name}: "
                                      f"{(await r.text(errors='replace')).strip()}")
                while True:  # frames: stream (1 out, 2 err), 3 zero bytes, size, data
                    try:
                        head = await r.content.readexactly(8)
                    except asyncio.IncompleteReadError:
                        break
                    stream, size = head[0], struct.unpack(">I", head[4:8])[0]
                    data = await r.content.readexactly(size)
                    target = err if stream == 2 else out
                    if len(target) < limit_bytes:
                        target += data[:limit_bytes - len(target)]
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
            raise DockerError(0, f"logs of {name}: {exc!r}") from None
        return bytes(out), bytes(err)

    async def put_archive(self, container: str, entries: list[tuple[str, bytes | None, int]]
                          ) -> None:
        """Writes (path below /, content or None for a folder, mode) entries into a created
        container, volumes included (Docker does so only where the root is writable)."""
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as tf:
            for path, data, mode in entries:
                info = tarfile.TarInfo(path)
                info.mode = mode
                if data is None:
                    info.type = tarfile.DIRTYPE
                    tf.addfile(info)
                else:
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        await self._call("PUT", f"/containers/{container}/archive", params={"path": "/"},
                         data=tar.getvalue(), headers={"Content-Type": "application/x-tar"})

    async def list(self, label: str) -> list[dict[str, Any]]:
        """Every container (running or not) that carries `label` (key=value)."""
        _, data = await self._call("GET", "/containers/json", params={
            "all": "true", "filters": json.dumps({"label": [label]})})
        return data  # type: ignore[no-any-return]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
