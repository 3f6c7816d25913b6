"""Per-attempt limits through cgroups: memory and processes of the attempt as a whole.

Each sandboxed job gets a cgroup `<base>/harnessrl-<tag>/<job_id>` (tag: the controller's) (on cgroup v1: one in the memory
and one in the pids hierarchy) with `memory` and `pids` limits; the job's wrapper joins it
before it starts the sandbox, so everything the harness starts counts against the attempt's
limits. A fork bomb meets `pids.max`; a memory hog meets the OOM killer inside its own cgroup;
other rollouts and the services go on. After the job, the cgroup is emptied and removed.

`<base>` is the controller's own cgroup. cgroup v2 (most machines now): the controller's
cgroup must let it enable the memory and pids controllers for its children; when it holds
processes itself (the "no internal processes" rule) the controller moves itself into a leaf
`<base>/controller` first. cgroup v1 (this project's CI machines): the memory and pids
hierarchies must be writable. Where neither works, `detect` raises `Unavailable` with the
reason and the fix.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("harnessrl.controller.sandbox")

_CONTROLLERS = ("memory", "pids")


class Unavailable(RuntimeError):
    """This machine cannot limit an attempt as asked; the message says why and the fix."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    max_processes: int


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fs type, super options) of each cgroup mount, from mountinfo."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts, rparts = left.split(), right.split()
            if rparts and rparts[0] in ("cgroup", "cgroup2"):
                found.append((parts[3], parts[4], rparts[0], set(rparts[-1].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """controller name (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                paths[name] = path
    return paths


def _under(mount_root: str, mount_point: str, path: str) -> Path:
    rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else "."
    return Path(mount_point) / ("" if rel == "." else rel)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class Cgroups:
    """Creates, fills and removes the attempts' cgroups on this machine."""

    def __init__(self, version: int, bases: dict[str, Path]) -> None:
        self.version = version
        self.bases = bases  # v1: controller -> <hierarchy>/<own>/harnessrl; v2: "" -> the same

    @classmethod
    def detect(cls, name: str = "harnessrl") -> "Cgroups":
        """The cgroups of this machine for the jobs of one controller: `<own cgroup>/<name>`
        (name it after what the controller owns, its rollout folder, so that two controllers
        never share one, and a restarted one finds its jobs')."""
        try:
            mounts, own = _mounts(), _own_paths()
        except OSError as exc:
            raise Unavailable(f"cannot read this process's cgroups ({exc}); /proc must be "
                              "mounted") from None
        v1 = {c: m for m in mounts for c in _CONTROLLERS if m[2] == "cgroup" and c in m[3]}
        v2 = next((m for m in mounts if m[2] == "cgroup2"), None)
        problems: list[str] = []
        if v2 is not None and "" in own:
            try:
                return cls._v2(v2, own[""], name)
            except (OSError, Unavailable) as exc:
                problems.append(f"cgroup v2 at {v2[1]}: {exc}")
        if all(c in v1 for c in _CONTROLLERS):
            try:
                return cls._v1(v1, own, name)
            except OSError as exc:
                problems.append(f"cgroup v1: {exc}")
        else:
            problems.append("cgroup v1: the " + " and ".join(
                c for c in _CONTROLLERS if c not in v1) + " hierarchy is not mounted")
        raise Unavailable(
            "no cgroup can limit the rollouts' memory and processes (" + "; ".join(problems)
            + "). Fix: run the controller where it may create cgroups: as root, or under "
            "`systemd-run --user --scope -p Delegate=yes`, or in a container with a "
            "delegated, writable cgroup (docker run --cgroupns=private on a v2 host); or "
            "switch the sandbox off (controller --sandbox false, logged as unsafe)")

    @classmethod
    def _v1(cls, v1: dict[str, tuple[str, str, str, set[str]]], own: dict[str, str],
            name: str) -> "Cgroups":
        bases = {}
        for c in _CONTROLLERS:
            root, point, _, _ = v1[c]
            base = _under(root, point, own.get(c, "/")) / name
            base.mkdir(exist_ok=True)
            bases[c] = base
        return cls(1, bases)

    @classmethod
    def _v2(cls, mount: tuple[str, str, str, set[str]], own: str, name: str) -> "Cgroups":
        here = _under(mount[0], mount[1], own)
        available = set((here / "cgroup.controllers").read_text().split())
        missing = [c for c in _CONTROLLERS if c not in available]
        if missing:
            raise Unavailable(f"the controllers {missing} are not delegated to {here}")
        enable = " ".join(f"+{c}" for c in _CONTROLLERS)
        try:
            _write(here / "cgroup.subtree_control", enable)
        except OSError:  # processes in `here` itself: move this one into a leaf, try again
            leaf = here / "controller"
            leaf.mkdir(exist_ok=True)
            _write(leaf / "cgroup.procs", str(os.getpid()))
            _write(here / "cgroup.subtree_control", enable)
        base = here / name
        base.mkdir(exist_ok=True)
        _write(base / "cgroup.subtree_control", enable)
        return cls(2, {"": base})

    def create(self, job_id: str, limits: Limits) -> list[str]:
        """The job's cgroup(s), limited; returns the `cgroup.procs` files its wrapper joins."""
        procs = []
        for name, base in self.bases.items():
            path = base / job_id
            path.mkdir(exist_ok=True)
            if self.version == 2:
                _write(path / "memory.max", str(limits.memory_bytes))
                if (path / "memory.swap.max").exists():
                    _write(path / "memory.swap.max", "0")
                _write(path / "pids.max", str(limits.max_processes))
            elif name == "memory":
                _write(path / "memory.limit_in_bytes", str(limits.memory_bytes))
                try:  # swap accounting may be off: then there is no memsw file
                    _write(path / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
                except OSError:
                    pass
            else:
                _write(path / "pids.max", str(limits.max_processes))
            procs.append(str(path / "cgroup.procs"))
        return procs

    def remove(self, job_id: str, timeout_s: float = 5.0) -> None:
        """Kills whatever still runs in the job's cgroup(s) and removes them."""
        for base in self.bases.values():
            path = base / job_id
            deadline = time.monotonic() + timeout_s
            while path.exists():
                try:
                    pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                try:
                    path.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        log.warning("cgroup %s: not removed (processes %s remain)", path, pids)
                        break
                    time.sleep(0.02)

    def close(self) -> None:
        """Removes the controller's cgroup folder(s) when no job's is left in them."""
        for base in self.bases.values():
            try:
                base.rmdir()
            except OSError:
                pass
