"""What one sandboxed job may reach: its `SandboxPolicy`, built from the run's spec.

The filesystem is an allow-list. Read-only: the system (`harnessrl.bwrap_binds`), the Python
the controller runs on (the sandbox's first process needs it, and `python3` on the sandbox's PATH
is it), the interpreter and code its command names (each absolute path in the argv: a file's
folder, a folder itself; a venv's interpreter brings its venv and base Python), and the run's
`sandbox.read_only_paths`. Writable: the attempt's work folder. Hidden even inside those: the
controller's secret, its rollout folders, every task file the controller was handed, and the
run's `sandbox.hidden_paths`. Network: the gateway's port, and the run's `egress`.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from harnessrl.errors import InvalidArgument
from harnessrl.v1 import common_pb2 as c
from services.controller.sandbox.egress import Target

DEFAULT_MEMORY_MB = 4096
DEFAULT_MAX_PROCESSES = 512
HOST_NETWORK = "*"


@dataclass(frozen=True)
class SandboxPolicy:
    """One job's sandbox (`JobSpec.sandbox`); `bwrap.Sandbox` makes it."""
    work: Path  # the attempt's work folder: writable, the job's working directory
    read_only: tuple[Path, ...] = ()  # host paths readable inside, besides the system
    hidden: tuple[Path, ...] = ()  # masked even under a read-only path
    # TCP targets, each reached inside at 127.0.0.1:<port> (the target's own port, but for
    # the gateway on a port below 1024, which the sandbox's user cannot listen on)
    targets: tuple[tuple[Target, int], ...] = ()
    host_network: bool = False  # egress "*": the host's network, everything on it
    memory_mb: int = DEFAULT_MEMORY_MB
    max_processes: int = DEFAULT_MAX_PROCESSES
    cpu_time_s: int = 0  # CPU seconds of one process (RLIMIT_CPU); 0: none
    env: dict[str, str] = field(default_factory=dict)  # set inside over the job's env
    # read-only paths as the command spells them, where that goes through a symlink:
    # (spelled, real); the real path is what is bound (and masked), the spelled one links to it
    aliases: tuple[tuple[Path, Path], ...] = ()
    # may make one sandbox more inside: a grader's, whose tests of the agent's code run in a
    # nested sandbox (harnessrl.graders.nested_sandbox, which forbids nesting further); never
    # a harness's
    nested: bool = False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_egress(entries: list[str], what: str = "egress") -> tuple[list[Target], bool]:
    """`host:port` entries (loopback hosts) -> targets; "*" -> the host network. Raises
    `InvalidArgument` with what is wrong."""
    targets, host_net = [], False
    for entry in entries:
        if entry == HOST_NETWORK:
            host_net = True
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
            raise InvalidArgument(f"sandbox.{what} {entry!r}: give host:port")
        if int(port) < 1024:
            raise InvalidArgument(f"sandbox.{what} {entry!r}: ports below 1024 cannot be "
                                  "forwarded into a sandbox (its user may not listen there)")
        if not is_loopback(host):
            raise InvalidArgument(
                f"sandbox.{what} {entry!r}: only loopback addresses can be forwarded into a "
                f"sandbox; {HOST_NETWORK!r} gives the harness the host's whole network")
        targets.append(Target(host.strip("[]"), int(port)))
    return targets, host_net


def check_spec(spec: c.RunSpec) -> None:
    """`InvalidArgument` for a sandbox section that cannot be made (at CreateRun)."""
    sb = spec.sandbox
    if sb.memory_mb < 0 or sb.max_processes < 0 or sb.cpu_time_s < 0:
        raise InvalidArgument("sandbox.memory_mb, max_processes and cpu_time_s must be >= 0 "
                              "(0: the default)")
    if sb.max_processes and sb.max_processes < 8:
        raise InvalidArgument("sandbox.max_processes must be at least 8 (the sandbox itself "
                              "takes a few)")
    if sb.memory_mb and sb.memory_mb < 64:
        raise InvalidArgument("sandbox.memory_mb must be at least 64")
    for what in ("read_only_paths", "hidden_paths"):
        for p in getattr(sb, what):
            if not os.path.isabs(p):
                raise InvalidArgument(f"sandbox.{what}: {p!r} is not an absolute path")
    for p in sb.read_only_paths:
        if Path(os.path.realpath(p)) in SHARED_FOLDERS:
            raise InvalidArgument(f"sandbox.read_only_paths: {p!r} is a folder the whole "
                                  "machine shares; name the files or folders the harness needs")
    parse_egress(list(sb.egress))
    parse_egress(list(sb.grader_egress), "grader_egress")


def _venv_paths(exe: Path) -> list[Path]:
    """A venv's root and its base Python's prefix, when `exe` is a venv's interpreter."""
    root = exe.parent.parent
    cfg = root / "pyvenv.cfg"
    if not cfg.is_file():
        return []
    paths = [root]
    for line in cfg.read_text(errors="replace").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home" and value.strip():
            paths.append(Path(value.strip()).resolve().parent)
    return paths


# Folders shared by everything on a machine: a file named in one of them is shown alone, never
# the folder with it (a harness at /tmp/agent.py must not see the rest of /tmp).
SHARED_FOLDERS = frozenset(map(Path, ("/", "/tmp", "/var", "/var/tmp", "/home", "/root", "/run",
                                      "/dev", "/dev/shm", "/srv", "/mnt", "/media", "/opt",
                                      "/etc", os.path.expanduser("~"))))


def code_paths(argv: list[str]) -> list[Path]:
    """What a command names of the machine: each absolute path in it (a file's folder, or the
    file alone in a shared folder such as /tmp; a folder itself; a venv interpreter's venv and
    base Python)."""
    paths: list[Path] = []
    for arg in argv:
        if not os.path.isabs(arg) or not os.path.exists(arg):
            continue
        p = Path(os.path.abspath(arg))
        if p.is_dir():
            paths.append(p)
        else:
            paths.append(p if p.parent in SHARED_FOLDERS or
                         Path(os.path.realpath(p.parent)) in SHARED_FOLDERS else p.parent)
        if p.is_file():
            paths.extend(_venv_paths(p))
    return paths


def real(path: Path) -> Path:
    """`path` with every symlink and `..` resolved (what a bind or a mask must name)."""
    return Path(os.path.realpath(path))


def runtime_paths() -> list[Path]:
    """The Python this controller runs on (the sandbox's first process runs on it) and the
    `harnessrl` package (its graders, such as the judge, and client helpers; code only)."""
    import harnessrl

    exe = Path(sys.executable)
    return [Path(sys.prefix), Path(sys.base_prefix), exe.resolve().parent.parent,
            Path(harnessrl.__file__).resolve().parent]


GATEWAY_LOW_PORT_INSIDE = 18080  # the gateway's port inside when its own is below 1024


def inside_url(url: str) -> tuple[str, tuple[Target, int]]:
    """A URL as the sandbox reaches it (127.0.0.1, its own port where that is 1024 or above)
    and its target outside with the port inside."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = Target(parts.hostname or "127.0.0.1", port)
    inside = port if port >= 1024 else GATEWAY_LOW_PORT_INSIDE
    netloc = f"127.0.0.1:{inside}"
    return (urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)),
            (target, inside))


def build(spec: c.RunSpec, *, argv: list[str], work: Path, timeout_s: float,
          hidden: list[Path], egress: list[str], gateway_url: str = "",
          read_only: Sequence[Path] = (), nested: bool = False) -> SandboxPolicy:
    """The policy of one job of the run `spec` (its harness or its grader)."""
    sb = spec.sandbox
    egress_targets, host_net = parse_egress(egress)
    targets = [(t, t.port) for t in egress_targets]
    env: dict[str, str] = {}
    if gateway_url and not host_net:
        env["OPENAI_BASE_URL"], gw = inside_url(gateway_url)
        targets.insert(0, gw)
    spelled = [*runtime_paths(), *code_paths(argv), *map(Path, sb.read_only_paths), *read_only]
    ro, aliases = [], []
    for p in spelled:  # bound where they really are, so that the masks below cover them
        if p.exists():
            ro.append(real(p))
            if Path(os.path.abspath(p)) != real(p):
                aliases.append((Path(os.path.abspath(p)), real(p)))
    return SandboxPolicy(
        work=work, read_only=tuple(dict.fromkeys(ro)), aliases=tuple(dict.fromkeys(aliases)),
        hidden=tuple(dict.fromkeys(real(p) for p in [*hidden, *map(Path, sb.hidden_paths)])),
        targets=tuple(dict.fromkeys(targets)), host_network=host_net,
        memory_mb=sb.memory_mb or DEFAULT_MEMORY_MB,
        max_processes=sb.max_processes or DEFAULT_MAX_PROCESSES,
        cpu_time_s=int(sb.cpu_time_s or timeout_s) + 1, env=env, nested=nested)
