"""How the fake kubelet runs a container: the interface a runtime offers it (`Runtime`, and
`Running` for one started container), and the default one, `ProcessRuntime`, which runs a
container's command as a local process. `container_runtime.ContainerRuntime` runs real Docker
containers instead (the fake API server's `--kubelet container`).

The process runtime simulates a container's file system by rewriting paths: in `workingDir`,
`command`, `args` and env values, a volumeMount's `mountPath` (at a path boundary) is replaced
by that volume's directory under `<root>/pods/<ns>/<pod>/volumes/`. Nothing else is isolated:
the process sees the host's file system, network and users, and the image only decides
whether the pull succeeds (the node's `--images` list).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

Obj = dict[str, Any]
STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ConfigError(Exception):
    """A container cannot be configured yet (CreateContainerConfigError)."""


@dataclass(frozen=True)
class Launch:
    """One container to start, as the kubelet resolved it."""
    namespace: str
    pod: str            # the pod's name
    uid: str            # the pod's uid
    spec: Obj           # the pod's spec
    container: Obj      # its entry in spec.containers / spec.initContainers
    env: dict[str, str]  # the declared environment, resolved (`$(VAR)` expanded)
    volumes: dict[str, Path]  # volume name -> its host directory (set up by the kubelet)
    pod_dir: Path       # <root>/pods/<ns>/<pod>
    log: Path           # where stdout and stderr go, merged (the pod log)
    restart: int        # the container's restartCount
    labels: dict[str, str] = field(default_factory=dict)  # the pod's labels


@dataclass(frozen=True)
class Exit:
    """How a container ended: a terminated state's exitCode, reason and message."""
    code: int
    reason: str          # Completed, Error, OOMKilled, StartError
    message: str | None = None


class Running(Protocol):
    """A started container."""
    container_id: str
    image_id: str

    def poll(self) -> Exit | None:
        """How it ended, or None while it runs (does not block)."""

    def signal(self, sig: int) -> None:
        """Sends `sig` to the container's main process (ignored once it is gone)."""

    def wait_gone(self) -> Exit:
        """Blocks (bounded) until nothing of the container runs; how it ended."""

    def remove(self) -> None:
        """Kills whatever is left of it and frees what it holds."""


class Runtime(Protocol):
    """What the kubelet needs from a container runtime."""

    def has_image(self, image: str) -> bool:
        """Whether the node can "pull" `image` (else ErrImagePull)."""

    def check(self, spec: Obj, container: Obj) -> None:
        """Raises ConfigError when the container cannot be created as configured."""

    def start(self, launch: Launch) -> Running | str:
        """Starts the container; or why it could not start (a StartError's message)."""

    def shutdown(self) -> None:
        """Server shutdown: removes every container this runtime started."""

    def pod_gone(self, uid: str) -> None:
        """The pod `uid` is over (its containers removed): frees what the runtime holds for
        the pod itself (container mode: its network)."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables are replaced, `$$` escapes, anything
    else is left as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env[name] if name in env else text[i:end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def exit_of(code: int) -> Exit:
    """A main process's exit status as a terminated state (a signal N reads as 128+N)."""
    code = code if code >= 0 else 128 - code
    return Exit(code, "Completed" if code == 0 else "Error")


class PathMap:
    """Container paths → host directories, longest mountPath first."""

    def __init__(self, mounts: list[tuple[str, Path]]) -> None:
        mounts = [(m.rstrip("/"), d) for m, d in mounts if m.rstrip("/")]
        mounts.sort(key=lambda m: -len(m[0]))
        self.mounts = mounts
        self.pattern = re.compile("|".join(
            rf"(?<![\w./-]){re.escape(m)}(?=/|$|[^\w.-])" for m, _ in mounts)) if mounts else None
        self.dirs = {m: str(d) for m, d in mounts}

    def __call__(self, text: str) -> str:
        if self.pattern is None:
            return text
        return self.pattern.sub(lambda m: self.dirs[m.group(0)], text)

    def directory(self, path: str) -> Path | None:
        for mount, d in self.mounts:
            if path == mount or path.startswith(mount + "/"):
                return Path(str(d) + path[len(mount):])
        return None


def _wait_group_gone(pgid: int, bound_s: float = 5.0) -> None:
    """Waits until no live (non-zombie) process is left in process group `pgid`."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        alive = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                alive = True
                break
        if not alive:
            return
        time.sleep(0.01)


class _Process:
    """A container that is a process group; its processes die with its main process."""

    def __init__(self, proc: subprocess.Popen[bytes], container_id: str, image: str) -> None:
        self.proc = proc
        self.container_id = container_id
        self.image_id = image

    def poll(self) -> Exit | None:
        code = self.proc.poll()
        return None if code is None else exit_of(code)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait_gone(self) -> Exit:
        _wait_group_gone(self.proc.pid)
        return exit_of(self.proc.wait())

    def remove(self) -> None:
        self.signal(signal.SIGKILL)


class ProcessRuntime:
    """Containers as local processes; `images`: what the node can pull."""

    def __init__(self, images: list[str]) -> None:
        self.images = set(images)

    def has_image(self, image: str) -> bool:
        return image in self.images

    def check(self, spec: Obj, container: Obj) -> None:
        pass

    def shutdown(self) -> None:
        pass  # the kubelet kills each pod's process groups

    def pod_gone(self, uid: str) -> None:
        pass  # processes share the host's network: nothing per pod

    def start(self, launch: Launch) -> Running | str:
        c = launch.container
        pmap = PathMap([(m["mountPath"], launch.volumes[m["name"]] / m.get("subPath", ""))
                        for m in c.get("volumeMounts") or []])
        home = str(launch.pod_dir / "root")
        env = {"PATH": STANDARD_PATH, "HOSTNAME": launch.pod, "HOME": home}
        env.update({k: pmap(v) for k, v in launch.env.items()})
        lookup = {"PATH": STANDARD_PATH, "HOSTNAME": launch.pod, "HOME": "/root", **launch.env}
        argv = [pmap(expand(a, lookup)) for a in (c.get("command") or []) + (c.get("args") or [])]
        if not c.get("command"):
            return ("the fake kubelet runs only a container's `command`: images have no "
                    "entrypoint here")
        cwd = Path(home)
        if c.get("workingDir"):
            cwd = pmap.directory(c["workingDir"]) or \
                launch.pod_dir / "fs" / c["workingDir"].lstrip("/")
            cwd.mkdir(parents=True, exist_ok=True)
        with open(launch.log, "ab") as log:
            try:
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, close_fds=True)
            except OSError as e:
                return f'exec: "{argv[0]}": {e.strerror}'
        return _Process(proc, f"fake://{launch.uid}/{c['name']}/{launch.restart}", c["image"])
