"""A Docker daemon for the container tests and `scripts/images.sh`: the one `DOCKER_HOST` (or
the default socket) answers on, or a private `dockerd` started here and stopped by its pid.

On these machines no daemon runs and no registry is reachable (`shared/CONTAINERS.md`): the
private daemon runs without iptables and without the default bridge (`--iptables=false
--ip6tables=false --bridge=none`, so it never touches the host's firewall), with overlay2. Its
data root is kept between runs (`~/.cache/harnessrl/docker`, or `$HARNESSRL_DOCKER_ROOT`) so
that built images are reused by the next run (they are labelled with the hash of their
inputs, `scripts/images.py`); the socket and the daemon's runtime state are in a fresh
temporary folder.

    eval "$(python -m harnessrl.testing.dockerd start)"  # sets DOCKER_HOST (and
                                          # HARNESSRL_DOCKERD_STARTED=1 when it started one)
    python -m harnessrl.testing.dockerd stop    # stops the one `start` left running

Stdlib only: `scripts/images.py` runs it before any virtual environment exists.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATE = Path(tempfile.gettempdir()) / "harnessrl-dockerd.env"
"""Where `start` leaves the private daemon's DOCKER_HOST and pid (for `stop`)."""


def data_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "harnessrl/docker"
    return Path(os.environ.get("HARNESSRL_DOCKER_ROOT", default))


def answers(host: str | None, timeout: float = 10.0) -> bool:
    """Whether a Docker daemon answers at `host` (None: the client's default)."""
    docker = shutil.which("docker")
    if docker is None:
        return False
    env = dict(os.environ)
    if host:
        env["DOCKER_HOST"] = host
    else:
        env.pop("DOCKER_HOST", None)
    try:
        out = subprocess.run([docker, "version", "--format", "{{.Server.Version}}"],
                             capture_output=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0


def remove_run_dir(run_dir: Path) -> None:
    """Removes a stopped daemon's run folder. dockerd leaves its default network namespace
    mounted there (`exec/netns/default`, nsfs): unmounted first, deepest first."""
    with open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f]
    for point in sorted((m for m in mounts if m.startswith(f"{run_dir}/")), reverse=True):
        subprocess.run(["umount", point], capture_output=True)
    shutil.rmtree(run_dir, ignore_errors=True)


class Dockerd:
    """A daemon to talk to: `host` is its DOCKER_HOST; `owned` says whether we started it
    (and so stop it)."""

    def __init__(self, host: str, proc: subprocess.Popen[bytes] | None = None,
                 run_dir: Path | None = None) -> None:
        self.host = host
        self.proc = proc
        self.run_dir = run_dir

    @property
    def owned(self) -> bool:
        return self.proc is not None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host}

    @classmethod
    def find_or_start(cls, timeout: float = 120.0) -> "Dockerd":
        """The daemon DOCKER_HOST (or the default socket) names, if one answers; else a
        private one. Raises RuntimeError when there is no dockerd to start or it never
        answers (the log's tail in the message)."""
        for host in (os.environ.get("DOCKER_HOST"), "unix:///var/run/docker.sock"):
            if host and answers(host):
                return cls(host)
        return cls.start_private(timeout)

    @classmethod
    def start_private(cls, timeout: float = 120.0) -> "Dockerd":
        exe = shutil.which("dockerd")
        if exe is None or shutil.which("docker") is None:
            raise RuntimeError("no container runtime: dockerd and docker are not installed "
                               "(scripts/setup.sh installs docker.io)")
        run_dir = Path(tempfile.mkdtemp(prefix="hrl-dockerd-"))  # short: the socket's path
        host = f"unix://{run_dir}/docker.sock"
        root = data_root()
        root.mkdir(parents=True, exist_ok=True)
        log = open(run_dir / "dockerd.log", "ab")
        proc = subprocess.Popen(
            [exe, "--data-root", str(root), "--exec-root", str(run_dir / "exec"),
             "--pidfile", str(run_dir / "dockerd.pid"), "-H", host,
             "--iptables=false", "--ip6tables=false", "--bridge=none",
             "--storage-driver=overlay2"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        daemon = cls(host, proc, run_dir)
        deadline = time.monotonic() + timeout
        while not answers(host, timeout=5):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (run_dir / "dockerd.log").read_text(errors="replace")[-3000:]
                daemon.stop()
                raise RuntimeError(f"dockerd did not start (log {run_dir}/dockerd.log):\n{tail}")
            time.sleep(0.5)
        return daemon

    def stop(self, timeout: float = 60.0) -> None:
        """Stops a daemon we started (SIGTERM to its pid, SIGKILL after `timeout`); a daemon
        found running is left alone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
        if self.run_dir is not None:  # the socket, pid file, log and exec root
            remove_run_dir(self.run_dir)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["start"]:
        daemon = Dockerd.find_or_start()
        print(f"export DOCKER_HOST={daemon.host}")
        if daemon.owned:  # `stop` stops it; one found running is left alone
            assert daemon.proc is not None
            STATE.write_text(f"{daemon.host}\n{daemon.proc.pid}\n")
            print("export HARNESSRL_DOCKERD_STARTED=1")
        return 0
    if argv[:1] == ["stop"]:
        if not STATE.exists():
            print("dockerd: none started by `start`", file=sys.stderr)
            return 0
        host, pid = STATE.read_text().split()
        try:
            os.kill(int(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        STATE.unlink()
        remove_run_dir(Path(host.removeprefix("unix://")).parent)
        print(f"dockerd: stopped {pid} ({host})")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
