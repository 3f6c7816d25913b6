"""Doors out of the sandboxes: one Unix socket per allowed TCP target, served by the controller.

A sandbox has a network namespace of its own with nothing but loopback in it. For each target
its policy allows (the gateway always; a run's `egress` entries), the controller listens on a
Unix socket `<root>/<door>/s.sock` and carries every connection to the target; the sandbox
gets the door's *folder* bound read-only, and its first process (`init.py`) listens on
127.0.0.1:<port> inside and forwards there. So a harness reaches exactly the targets its policy
names, at their usual port, and nothing else of the machine.

The folder, not the socket, is bound: a controller restarted after a crash opens the same
door again (same path, new socket), and the sandboxes of the attempts it adopts reach it
through their old bind. The root is a short, fixed path per rollout folder (a Unix socket path
has at most 107 bytes), private to this user (0700).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harnessrl.streams import splice

log = logging.getLogger("harnessrl.controller.sandbox")


@dataclass(frozen=True)
class Target:
    host: str
    port: int

    @property
    def door(self) -> str:
        """The door's folder name: stable for a target, a file-name-safe word."""
        return hashlib.sha1(f"{self.host}:{self.port}".encode()).hexdigest()[:12]

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def default_root(workdir_root: Path) -> Path:
    """`<tmp>/harnessrl-doors-<hash of the rollout folder>`: short, and the same for every
    controller of that folder (so a restarted one reopens the doors its jobs hold)."""
    tag = hashlib.sha1(str(Path(workdir_root).resolve()).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"harnessrl-doors-{tag}"


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a folder of this user (uid {os.getuid()}): remove it "
                           "or set the controller's sandbox_doors to another folder")
    path.chmod(0o700)


class Doors:
    """The controller's open doors, one server per target, opened on first use."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._servers: dict[Target, asyncio.AbstractServer] = {}
        self._lock = asyncio.Lock()

    async def open(self, target: Target) -> Path:
        """The folder to bind into a sandbox for `target` (its socket is `s.sock` in it)."""
        folder = self.root / target.door
        async with self._lock:
            if target not in self._servers:
                _private_dir(self.root)
                folder.mkdir(mode=0o700, exist_ok=True)  # kept: sandboxes bind the folder
                sock = folder / "s.sock"
                sock.unlink(missing_ok=True)
                self._servers[target] = await asyncio.start_unix_server(
                    lambda r, w: self._carry(target, r, w), path=str(sock))
                log.info("sandbox door to %s open at %s", target, sock)
        return folder

    async def _carry(self, target: Target, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        try:
            await splice(reader, writer, target.host, target.port)
        except OSError as exc:
            log.warning("sandbox door to %s: cannot connect (%s)", target, exc)

    async def close(self) -> None:
        for server in self._servers.values():
            server.close()
        for server in self._servers.values():
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()

