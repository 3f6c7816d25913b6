"""Makes a job's sandbox with bubblewrap (`bwrap`), the tool Flatpak, Anthropic's
sandbox-runtime and OpenAI's Codex CLI build on.

Why bubblewrap: it is one small, audited, unprivileged binary in every distribution, it makes
exactly the namespaces and the allow-listed mount tree we ask for and nothing else, and it
needs no daemon or root (Landlock + seccomp would fence the filesystem too, but give no pid
or network namespace, so `/proc` and loopback ports stay reachable; containers need a daemon
and images per harness).

A sandboxed job runs as `job_wrapper -> bwrap -> init.py -> the command`:
- its own user, pid, ipc, uts, cgroup and network namespaces; uid 1000 inside, no
  capabilities, no new user namespaces inside (`--disable-userns`; a grader's may make one,
  `SandboxPolicy.nested`, for the sandbox its tests run in), no new privileges;
- the mount tree of `policy.SandboxPolicy`: the system and the command's code read-only, the
  work folder writable, a private `/tmp`, its own `/proc` (its own processes only) and a
  minimal `/dev`; the controller's records (exit status, job record, grader output) are in
  the attempt folder above the work folder, which the sandbox does not see;
- the environment the controller and the run spec set, nothing of the controller's own;
- network: loopback only, with the doors of `egress.py` forwarded onto it;
- limits: a cgroup per job (`cgroups.py`: memory, processes) and RLIMIT_CPU per process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harnessrl.bwrap_binds import system_binds
from services.controller.sandbox import cgroups
from services.controller.sandbox.egress import Doors
from services.controller.sandbox.policy import SandboxPolicy

log = logging.getLogger("harnessrl.controller.sandbox")

UID = 1000  # the job's user inside (mapped to the controller's own user outside)
INIT = Path(__file__).with_name("init.py")
INSIDE = Path("/run/harnessrl")  # where the sandbox sees its init and its doors
# The environment a sandboxed job starts from (the run's and the controller's come on top).
BASE_ENV = {"PATH": f"{Path(sys.prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8", "TMPDIR": "/tmp", "USER": "agent", "LOGNAME": "agent"}

FIX_USERNS = ("user namespaces must be allowed for unprivileged users: `sysctl -w "
              "kernel.unprivileged_userns_clone=1` (Debian before 11), `sysctl -w "
              "kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu 23.10+), or in a "
              "container `--security-opt seccomp=unconfined --security-opt apparmor=unconfined`")


class Unavailable(RuntimeError):
    """No sandbox can be made here; the message says why and the fix."""


class Sandbox:
    """The local backend's sandboxes: checks the machine once, then wraps each job."""

    def __init__(self, doors_root: Path) -> None:
        self.bwrap = shutil.which("bwrap") or ""
        self.doors = Doors(doors_root)
        self.runtime = Path(doors_root)  # the sandbox's passwd and group, beside the doors
        self.cgroups: cgroups.Cgroups | None = None

    def check(self) -> None:
        """Raises `Unavailable` (why, and the fix) unless namespaces and cgroups work here."""
        if not self.bwrap:
            raise Unavailable("bubblewrap (bwrap) is not installed: `apt-get install "
                              "bubblewrap` (or dnf/apk/pacman install bubblewrap)")
        probe = subprocess.run(
            [self.bwrap, *_namespaces(), *system_binds(), "--", "/bin/true"],
            capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            raise Unavailable(f"bubblewrap cannot make a sandbox here ({probe.stderr.strip()}"
                              f"); {FIX_USERNS}")
        try:
            self.cgroups = cgroups.Cgroups.detect(f"harnessrl-{self.doors.root.name[-10:]}")
        except cgroups.Unavailable as exc:
            raise Unavailable(str(exc)) from None
        self._write_runtime()
        log.info("sandbox: bubblewrap %s, cgroup v%d", self.bwrap, self.cgroups.version)

    def _write_runtime(self) -> None:
        """The sandbox's /etc/passwd and /etc/group (its user's name)."""
        self.runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.runtime / "passwd").write_text(
            f"root:x:0:0:root:/root:/bin/sh\nagent:x:{UID}:{UID}:agent:/tmp:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        (self.runtime / "group").write_text(
            f"root:x:0:\nagent:x:{UID}:\nnogroup:x:65534:\n")

    async def prepare(self, job_id: str, policy: SandboxPolicy, argv: list[str],
                      env: dict[str, str]) -> tuple[list[str], dict[str, str], list[str]]:
        """The sandboxed command, its environment and the job wrapper's flags (the cgroup it
        joins, the CPU limit) for one job; its cgroup is made now (`release` removes it)."""
        assert self.cgroups is not None, "check() first"
        limits = cgroups.Limits(policy.memory_mb * 1024 * 1024, policy.max_processes)
        procs = await asyncio.to_thread(self.cgroups.create, job_id, limits)
        if not (self.runtime / "group").exists():  # (a temp folder cleaner took it)
            self._write_runtime()
        forwards: list[str] = []
        door_binds: list[str] = []
        for target, port in policy.targets:
            folder = await self.doors.open(target)
            inside = INSIDE / target.door
            door_binds += ["--ro-bind", str(folder), str(inside)]
            forwards += ["--forward", f"{port}={inside / 's.sock'}"]
        cmd = [self.bwrap, *_namespaces(policy.host_network, policy.nested), *system_binds(),
               "--ro-bind", str(self.runtime / "passwd"), "/etc/passwd",
               "--ro-bind", str(self.runtime / "group"), "/etc/group",
               "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
               *_mounts(policy, (self.doors.root,)), *door_binds,
               "--ro-bind", str(INIT), str(INSIDE / "init.py"),
               "--remount-ro", "/",  # writable: the work folder and /tmp, nothing else
               "--chdir", str(policy.work), "--",
               sys.executable, "-I", "-S", str(INSIDE / "init.py"), *forwards, "--", *argv]
        inside_env = {**BASE_ENV, "HOME": str(policy.work), **env, **policy.env}
        flags = [f"--cgroup={p}" for p in procs]
        if policy.cpu_time_s:
            flags.append(f"--rlimit-cpu={policy.cpu_time_s}")
        return cmd, inside_env, flags

    async def reopen(self, policy: SandboxPolicy) -> None:
        """Opens the doors of a job an earlier controller launched (adopted after a crash):
        its sandbox reaches them through the same folders."""
        for target, _ in policy.targets:
            await self.doors.open(target)

    def release(self, job_id: str) -> None:
        """Empties and removes the job's cgroup (after the job ended)."""
        if self.cgroups is not None:
            self.cgroups.remove(job_id)

    async def close(self) -> None:
        """Controller shutdown, after its jobs were ended: the doors and the cgroup folder go
        (after a crash they stay, for the jobs the next controller adopts)."""
        await self.doors.close()
        shutil.rmtree(self.doors.root, ignore_errors=True)  # (the runtime files with it)
        if self.cgroups is not None:
            self.cgroups.close()


def _namespaces(host_network: bool = False, nested: bool = False) -> list[str]:
    return ["--unshare-all", "--unshare-user", *([] if nested else ["--disable-userns"]),
            "--die-with-parent",
            "--cap-drop", "ALL", "--uid", str(UID), "--gid", str(UID),
            "--hostname", "sandbox", *(["--share-net"] if host_network else [])]


def _inside(path: Path, parents: tuple[Path, ...]) -> bool:
    return any(path == p or p in path.parents for p in parents)


def _mounts(policy: SandboxPolicy, own: tuple[Path, ...] = ()) -> list[str]:
    """Read-only binds, then the masks over what they must not show, then the work folder and
    the read-only paths named inside a hidden folder (the grader's view of the harness's
    output); a path hidden itself is never bound. `own`: the sandbox's own folders (doors,
    runtime files), hidden too."""
    args: list[str] = []
    hidden = (*policy.hidden, *(Path(os.path.realpath(p)) for p in own))
    later = [p for p in policy.read_only if _inside(p, hidden)]
    for p in policy.read_only:
        if p not in later:
            args += ["--ro-bind", str(p), str(p)]
    emptied = []
    for h in hidden:
        if not _inside(h, policy.read_only) or not h.exists():
            continue  # not under anything bound: not there to hide
        if _inside(h, tuple(o for o in hidden if o != h and o.is_dir())):
            continue  # inside a folder hidden as a whole
        if h.is_dir():
            args += ["--tmpfs", str(h)]
            emptied.append(h)
        else:
            args += ["--ro-bind", "/dev/null", str(h)]
    args += ["--bind", str(policy.work), str(policy.work)]
    for p in later:
        if p not in hidden:
            args += ["--ro-bind", str(p), str(p)]
    for spelled, target in policy.aliases:  # the command's spelling, a link to what is bound
        if not _inside(spelled, policy.read_only) and not _inside(spelled, (policy.work,)):
            args += ["--symlink", str(target), str(spelled)]
    for h in emptied:  # read-only once the work folder's mount point is made in it
        args += ["--remount-ro", str(h)]
    return args
