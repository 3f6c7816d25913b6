"""Child processes of harnessrl: services started on port 0 that announce their ports through
a ready file, and Redis started on demand. Used by `harnessrl up`, the benchmarks and tests.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

from harnessrl import identity


# A launcher's PKI folder (harnessrl/pki.py): each service it starts gets its own identity.
TLS_ROOT_ENV = "HARNESSRL_TLS_ROOT"
SERVICE_IDENTITY = {"services.store": "store", "services.controller": "controller",
                    "services.gateway": "gateway", "services.trainer": "trainer"}
_NOT_INHERITED = (TLS_ROOT_ENV, identity.TLS_DIR_ENV, identity.TLS_PEM_ENV,
                  identity.SCOPE_TOKEN_ENV)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    """A child process (its own process group) whose output goes to a log file and which
    writes a JSON ready file once it serves. It inherits no identity; a harnessrl service
    (`python -m services.X`) gets its own from the PKI folder `tls_root` (`identity_env`)."""

    def __init__(self, name: str, argv: list[str], workdir: Path,
                 env: dict[str, str] | None = None, ready_file: Path | None = None,
                 tls_root: str | os.PathLike[str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{name}.log"
        self.ready_file = ready_file
        # No child inherits its parent's identity: a service gets its own (`identity_env`).
        module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
        self.env = {**{k: v for k, v in os.environ.items() if k not in _NOT_INHERITED},
                    **identity_env(module, tls_root), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.restart = "always"
        """Supervisor policy: "always" (any exit), "on-failure" (non-zero exit), "no"."""
        self.restart_argv: list[str] | None = None
        """argv of a restart when it differs (the trainer restarts with --resume)."""
        self.started_at = 0.0

    def start(self) -> "ServiceProcess":
        if self.ready_file is not None and self.ready_file.exists():
            self.ready_file.unlink()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
            cwd=self.workdir, start_new_session=True,
        )
        log.close()
        self.started_at = time.time()
        return self

    def respawn(self) -> "ServiceProcess":
        """A new process with the same flags (ports included), log and ready file."""
        new = copy.copy(self)
        new.proc = None
        new.argv = list(self.restart_argv or self.argv)
        return new.start()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc is not None and self.ready_file is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was "
                                   f"ready; log {self.log_path}:\n{self.log_tail()}")
            if self.ready_file.exists():
                return json.loads(self.ready_file.read_text())
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready after {timeout}s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.proc is not None
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """kill -9 the whole process group."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`."""
        if not self.alive:
            return
        assert self.proc is not None
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def identity_env(module: str, tls_root: str | os.PathLike[str] | None = None
                 ) -> dict[str, str]:
    """The environment that gives the service `module` its own identity from the PKI folder
    `tls_root` (harnessrl/pki.py; default $HARNESSRL_TLS_ROOT): $HARNESSRL_TLS_DIR, and the
    controller the `grader` identity it hands its graders. Empty for other modules."""
    root = tls_root or os.environ.get(TLS_ROOT_ENV, "")
    own = SERVICE_IDENTITY.get(module)
    if not root or own is None:
        return {}
    env = {identity.TLS_DIR_ENV: str(Path(root) / own)}
    if own == "controller":
        env["HARNESSRL_CONTROLLER_GRADER_TLS_DIR"] = str(Path(root) / "grader")
    return env


def start_service(name: str, module: str, args: list[str], workdir: Path,
                  env: dict[str, str] | None = None, timeout: float = 60.0,
                  tls_root: str | os.PathLike[str] | None = None
                  ) -> tuple[ServiceProcess, dict[str, Any]]:
    """Starts `python -m module *args --ready-file <workdir>/<name>.ready` and waits for its
    ready file; returns the process and what the file announced (ports, pid)."""
    ready = Path(workdir) / f"{name}.ready"
    proc = ServiceProcess(name, python_module(module, *args, "--ready-file", str(ready)),
                          workdir, env=env, ready_file=ready, tls_root=tls_root).start()
    return proc, proc.wait_ready(timeout)


def redis_alive(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except (redis.RedisError, OSError):
        return False


def redis_refuses(url: str) -> bool:
    """A Redis answers at `url` but refuses its credentials (or their absence)."""
    try:
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
    except redis.AuthenticationError:
        return True
    except redis.ResponseError as exc:
        return str(exc).startswith(("NOAUTH", "WRONGPASS"))
    except (redis.RedisError, OSError):
        return False
    return False


def redis_url(port: int, password: str | None = None, username: str | None = None,
              host: str = "127.0.0.1", db: int = 0) -> str:
    auth = ""
    if password:
        auth = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
    return f"redis://{auth}{host}:{port}/{db}"


def write_private(path: Path, text: str) -> None:
    """Writes `text` to `path`, readable by this user only (0600) from its first byte."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _conf_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def start_redis(data_dir: Path, port: int | None = None, appendfsync: str = "everysec",
                password: str | None = None, username: str | None = None,
                acl: str | None = None) -> tuple[str, ServiceProcess]:
    """Starts a private redis-server with AOF persistence in `data_dir`; returns its URL and
    process. `appendfsync everysec` (the default, and what `harnessrl up` uses): a write is
    in the AOF (the OS page cache) before Redis replies, so a kill -9 of Redis loses nothing
    acknowledged, except while a background fsync is slow: Redis then replies first and holds
    the write back for up to 2 s, which a kill -9 or a crash of the machine can lose (about
    the last 1-2 s; docs/reliability.md). `always` fsyncs before replying (nothing lost even
    then, at several times the write cost).
    `password` becomes its requirepass (and `username`'s, an ACL user with every right, when
    that is not "default"); the URL returned carries it. With `acl` (ACL rules, such as
    `~* +@all -@admin -@dangerous`), `username` alone gets in, with those rights: the default
    user is off and there is no requirepass. The settings are in
    `<data_dir>/redis.conf` (0600), not on the command line, which any user can read; a
    `respawn` of the process reads the same file: same port, same password."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found: install Redis 7 (apt-get install "
                           "redis-server) or point --redis-url at a running server")
    port = port or free_port()
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    conf = [f"port {port}", "bind 127.0.0.1", f"dir {_conf_str(str(data_dir))}",
            "appendonly yes", f"appendfsync {appendfsync}", 'save ""', "daemonize no"]
    if acl is not None:
        if not (password and username and username != "default"):
            raise ValueError("acl needs a password and a username other than default")
        # default: off, no password (none logs in as it), but every right: Redis replays its
        # AOF as the default user and re-checks each MULTI/EXEC against that user's rights, so
        # a default user with none silently drops every transaction on restart (seen with
        # Redis 7.0.15; redis/redis#14541, valkey-io/valkey#3983).
        conf += ["user default off resetpass ~* &* +@all",
                 f"user {_conf_str(username)} on {_conf_str('>' + password)} {acl}"]
    elif password:
        conf.append(f"requirepass {_conf_str(password)}")
        if username and username != "default":
            conf.append(f"user {_conf_str(username)} on {_conf_str('>' + password)} ~* &* "
                        "+@all")
    write_private(data_dir / "redis.conf", "\n".join(conf) + "\n")
    proc = ServiceProcess("redis", [exe, str(data_dir / "redis.conf")], data_dir).start()
    url = redis_url(port, password, username)
    deadline = time.monotonic() + 20
    while not redis_alive(url):
        if not proc.alive or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"redis-server did not start: {proc.log_tail()}")
        time.sleep(0.05)
    return url, proc


LOOPBACK = ("localhost", "127.0.0.1", "::1")


def ensure_redis(url: str, data_dir: Path) -> tuple[str, ServiceProcess | None]:
    """`url` as given when a Redis answers there; otherwise, when `url` is on this machine,
    starts one with AOF on its port (its password, if any, as requirepass) and returns `url`."""
    if redis_alive(url):
        return url, None
    from harnessrl.config import mask_passwords

    if redis_refuses(url):
        raise RuntimeError(f"the Redis at {mask_passwords(url)} refuses these credentials")
    parts = redis.connection.parse_url(url)
    host = str(parts.get("host", ""))
    if "path" in parts or not (host in LOOPBACK or host.startswith("127.")):
        raise RuntimeError(f"no Redis answers at {mask_passwords(url)} (only a Redis on this "
                           "machine's loopback is started when none answers)")
    _, proc = start_redis(data_dir, int(parts.get("port", 6379)), password=parts.get("password"),
                          username=parts.get("username"))
    return url, proc
