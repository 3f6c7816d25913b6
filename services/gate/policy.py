"""What the gate lets through to the Docker daemon: the calls of the controller's docker backend
(`services/controller/backends/docker.py`), on rollout containers and volumes alone.

A request is allowed when its method and path are one of `ROUTES` and its body (container
and volume creation) has exactly the shape below; every other request is refused with 403 and
the reason. Calls on one container or volume go through only when that object carries
`harnessrl.managed-by=harnessrl` (the server looks it up first), so the gate cannot reach the
other containers of the machine, the gate's own included.

A container may be created only:
- from one of the configured images, named `hrl-...`, labelled as managed;
- with its root read-only (but a `...-seed` container, which the gate never starts: Docker
  copies a file into a volume only through a container with a writable root), every
  capability dropped, `no-new-privileges`, limits on memory,
  processes and CPU within the configured bounds;
- on the configured rollout network or none;
- with volumes `hrl-...` mounted at /workspace and /var/run/harnessrl, a /tmp tmpfs, no bind
  mount, device, host namespace, port, privilege or security option beyond the above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

MANAGED_KEY, MANAGED_VALUE = "harnessrl.managed-by", "harnessrl"
NAME = re.compile(r"^hrl-[a-z0-9][a-z0-9.-]{0,100}$")
MOUNT_TARGETS = ("/workspace", "/var/run/harnessrl")
SEED = "-seed"  # the container a job's task file goes in through; it never starts
_VERSION = r"(?:/v1\.\d+)?"
_ID = r"(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]{0,127})"


class Refused(Exception):
    """The gate does not forward this request; the message says why."""


@dataclass(frozen=True)
class Limits:
    images: tuple[str, ...]
    network: str
    max_memory: int  # bytes
    max_pids: int
    max_nano_cpus: int


# (method, path pattern, what it acts on: "" nothing, "container" or "volume" by name)
ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    (m, re.compile(f"^{_VERSION}{p}$"), kind) for m, p, kind in [
        ("GET", "/_ping", ""), ("HEAD", "/_ping", ""), ("GET", "/version", ""),
        ("POST", "/volumes/create", ""), ("DELETE", f"/volumes/{_ID}", "volume"),
        ("POST", "/containers/create", ""), ("GET", "/containers/json", ""),
        ("GET", f"/containers/{_ID}/json", "container"),
        ("POST", f"/containers/{_ID}/start", "container"),
        ("POST", f"/containers/{_ID}/wait", "container"),
        ("POST", f"/containers/{_ID}/kill", "container"),
        ("GET", f"/containers/{_ID}/logs", "container"),
        ("PUT", f"/containers/{_ID}/archive", "container"),
        ("DELETE", f"/containers/{_ID}", "container"),
    ]]


def route(method: str, path: str) -> tuple[str, str]:
    """(kind, name) of an allowed call, or `Refused`."""
    for m, pattern, kind in ROUTES:
        match = pattern.match(path)
        if m == method and match:
            return kind, match.groupdict().get("name", "")
    raise Refused(f"{method} {path} is not a call rollouts need")


def _only(what: str, obj: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(k for k, v in obj.items() if k not in allowed and v not in (None, "", [], {}))
    if extra:
        raise Refused(f"{what}: {', '.join(extra)} not allowed")


def _within(what: str, value: Any, most: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= most:
        raise Refused(f"{what} must be set, at most {most} (got {value!r})")


def check_container(name: str, body: Any, limits: Limits) -> None:
    """Refused unless `body` (POST /containers/create?name=`name`) is a rollout container."""
    if not NAME.match(name or ""):
        raise Refused(f"container name {name!r}: must be hrl-<job>")
    if not isinstance(body, dict):
        raise Refused("the body must be a JSON object")
    _only("container", body, {"Image", "Cmd", "Env", "WorkingDir", "Labels", "HostConfig"})
    if body.get("Image") not in limits.images:
        raise Refused(f"image {body.get('Image')!r} is not a rollout image")
    if (body.get("Labels") or {}).get(MANAGED_KEY) != MANAGED_VALUE:
        raise Refused(f"the container must carry the label {MANAGED_KEY}={MANAGED_VALUE}")
    host = body.get("HostConfig")
    if not isinstance(host, dict):
        raise Refused("HostConfig must be given")
    _only("HostConfig", host, {"NetworkMode", "ReadonlyRootfs", "CapDrop", "SecurityOpt",
                               "Init", "Memory", "MemorySwap", "PidsLimit", "NanoCpus",
                               "Tmpfs", "Mounts"})
    if host.get("NetworkMode") not in ("none", limits.network):
        raise Refused(f"network {host.get('NetworkMode')!r}: only {limits.network!r} or 'none'")
    if host.get("ReadonlyRootfs") is not True and not name.endswith(SEED):
        raise Refused("ReadonlyRootfs must be true (a ...-seed container, which never starts, "
                      "may have a writable root: Docker writes archives into it only then)")
    if host.get("CapDrop") != ["ALL"]:
        raise Refused("CapDrop must be ['ALL']")
    if host.get("SecurityOpt") != ["no-new-privileges"]:
        raise Refused("SecurityOpt must be ['no-new-privileges'], nothing else")
    _within("Memory", host.get("Memory"), limits.max_memory)
    if host.get("MemorySwap") not in (None, host.get("Memory")):
        raise Refused("MemorySwap: none beyond Memory")
    _within("PidsLimit", host.get("PidsLimit"), limits.max_pids)
    _within("NanoCpus", host.get("NanoCpus"), limits.max_nano_cpus)
    tmpfs = host.get("Tmpfs") or {}
    if not isinstance(tmpfs, dict) or set(tmpfs) - {"/tmp"}:
        raise Refused("Tmpfs: /tmp only")
    for mount in host.get("Mounts") or []:
        if not isinstance(mount, dict):
            raise Refused("Mounts: objects only")
        _only("mount", mount, {"Type", "Source", "Target", "ReadOnly", "VolumeOptions"})
        if mount.get("VolumeOptions") not in (None, {"NoCopy": True}):
            raise Refused("mount VolumeOptions: {'NoCopy': true} only")
        if mount.get("Type") != "volume" or not NAME.match(str(mount.get("Source", ""))):
            raise Refused(f"mount {mount.get('Source')!r}: only the job's own hrl-... volumes")
        if mount.get("Target") not in MOUNT_TARGETS:
            raise Refused(f"mount target {mount.get('Target')!r}: only {', '.join(MOUNT_TARGETS)}")


def check_volume(body: Any) -> None:
    """Refused unless `body` (POST /volumes/create) is a job's local volume."""
    if not isinstance(body, dict):
        raise Refused("the body must be a JSON object")
    _only("volume", body, {"Name", "Labels"})
    if not NAME.match(str(body.get("Name", ""))):
        raise Refused(f"volume name {body.get('Name')!r}: must be hrl-<job>-...")
    if (body.get("Labels") or {}).get(MANAGED_KEY) != MANAGED_VALUE:
        raise Refused(f"the volume must carry the label {MANAGED_KEY}={MANAGED_VALUE}")


def check_archive(name: str) -> None:
    """Archives go into a job's seed container alone (its volumes: the task file and the
    workspace folder); the seed never starts, so nothing else it holds is ever used."""
    if not name.endswith(SEED):
        raise Refused(f"archives go into a job's {SEED} container only, not {name!r}")
