"""docker-compose.yml, run for real: the CPU profile's images built (or reused by input hash),
the stack started with Debian's docker-compose 1.29 against a real dockerd (a private one
when none runs), the example trained end to end in containers with two crashes mid-run, and
what only containers show checked from inside each running service.

One module-scoped run (`compose`) does the work and records what it saw; the tests below
assert on it. Only the number of steps is overridden (an override file), and the merged
config is checked to equal the base file's but for that one variable. Ports move to free ports
through the file's own variables; offline (no registry here) Redis is the Debian stand-in that
`scripts/images.sh --offline` builds, through the file's REDIS_IMAGE.

The crashes are kill -9 of the container's init process from the host (what an OOM kill or a
crash of the runtime's child looks like), not `docker kill`: Docker counts `docker kill` as a
manual stop and ignores the restart policy after it (measured here; docs/deploy.md).

Authentication is on as the file ships it: the one-shot `pki` makes the credentials, and the
run checks from the running containers who holds which (Docker's own record of each
container's mounts), that Redis refuses a client without the store's password, that the
engine refuses a caller without a key from where the rollouts run (the controller's
container), and that the operator identity `scripts/compose-identity.sh` copies out works and
is refused what the table refuses it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import yaml

from harnessrl.procs import free_port
from harnessrl.engine_guard import ClientKey
from harnessrl.testing import chaos_accounting as ca, trained_probe
from harnessrl.v1 import common_pb2 as c

REPO = Path(__file__).resolve().parent.parent
STEPS = 3
PORT_VARS = ("REDIS_PORT", "STORE_PORT", "GATEWAY_HTTP_PORT", "GATEWAY_GRPC_PORT",
             "STORE_METRICS_PORT", "CONTROLLER_METRICS_PORT", "TRAINER_METRICS_PORT",
             "CONTROLLER_PORT", "TRAINER_PORT", "ENGINE_PORT")
RUNNING = ("redis", "store", "gateway", "controller", "engine-cpu",  # serve after training
           "gate", "gateway-door")
PYTHON_SERVICES = ("store", "gateway", "controller", "engine-cpu", "trainer-cpu", "pki")
SECRET_READERS = {"gateway", "controller"}
IDENTITY_OF = {"store": "store", "gateway": "gateway", "controller": "controller",
               "trainer-cpu": "trainer"}
# Who mounts which credential volume (docker-compose.yml; tests/test_deploy.py checks the file)
HOLDERS = {"pki": set(), "tls-store": {"store"}, "tls-gateway": {"gateway"},
           "tls-controller": {"controller"}, "tls-trainer": {"trainer-cpu"},
           "tls-grader": {"controller"}, "redis-acl": {"redis"}, "redis-password": {"store"},
           "engine-keys": {"engine-cpu"}, "engine-key-gateway": {"gateway"},
           "engine-key-trainer": {"trainer-cpu"}}
STORE_REDIS_USER = "harnessrl-store"
SECRET = "/run/secrets/harnessrl_secret"
REDTEAM = REPO / "harnessrl" / "testing" / "redteam_harness.py"
ROLLOUT_LABEL = "harnessrl.managed-by=harnessrl"  # the docker backend's containers
NETWORK_PROBES = ("connect_store", "connect_controller", "connect_gateway_admin",
                  "connect_engine", "redis")
KEY_PREFIX = "hrl:"  # docker-compose.yml's HARNESSRL_STORE_KEY_PREFIX
STATUS_FIELDS = ("Uid", "Gid", "CapEff", "CapPrm", "CapBnd", "NoNewPrivs")

pytestmark = [pytest.mark.slow, pytest.mark.containers, pytest.mark.timeout(3600)]


@dataclass
class ComposeRun:
    """What the run saw, for the tests to assert on."""

    base: dict[str, Any] = field(default_factory=dict)
    merged: dict[str, Any] = field(default_factory=dict)
    up_s: float = 0.0
    kills: list[dict[str, Any]] = field(default_factory=list)
    trainer_exit: int | None = None
    train_s: float = 0.0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str = ""
    checkpoint_files: list[str] = field(default_factory=list)
    accounting: dict[str, Any] = field(default_factory=dict)
    inside: dict[str, dict[str, Any]] = field(default_factory=dict)  # service -> checks
    mounts: dict[str, dict[str, bool]] = field(default_factory=dict)  # service -> volume: rw
    pki_exit: int | None = None
    identities: dict[str, str] = field(default_factory=dict)  # volume -> its certificate's CN
    redis_auth: dict[str, str] = field(default_factory=dict)
    engine_from_rollouts: dict[str, int] = field(default_factory=dict)  # route -> status
    probe: Any = None  # the engine's probe logprobs after training (trained_probe.Probe)
    healthcheck: dict[str, int] = field(default_factory=dict)
    operator: dict[str, Any] = field(default_factory=dict)
    auth_checks_s: float = 0.0
    # the red-team harness: as a rollout (its own container), and in the controller's
    # container (the control); the rollout's record
    redteam: dict[str, dict[str, Any]] = field(default_factory=dict)
    redteam_control: dict[str, dict[str, Any]] = field(default_factory=dict)
    redteam_rollout: Any = None
    redteam_s: float = 0.0
    leftover_rollouts: list[str] = field(default_factory=list)
    logs: Path | None = None


class Compose:
    """docker-compose (1.29) and docker for one project, against the test's daemon."""

    def __init__(self, project: str, files: list[Path], env: dict[str, str]) -> None:
        exe = shutil.which("docker-compose")
        assert exe, "docker-compose is needed (scripts/setup.sh installs it)"
        self.exe, self.project, self.files, self.env = exe, project, files, env

    def compose(self, *args: str, timeout: float = 600, check: bool = True
                ) -> subprocess.CompletedProcess[str]:
        cmd = [self.exe, "--project-directory", str(REPO), "-p", self.project]
        for f in self.files:
            cmd += ["-f", str(f)]
        out = subprocess.run([*cmd, *args], capture_output=True, text=True, env=self.env,
                             timeout=timeout)
        if check:
            assert out.returncode == 0, f"docker-compose {' '.join(args)}:\n{out.stderr[-4000:]}"
        return out

    def docker(self, *args: str, timeout: float = 120, check: bool = True
               ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(["docker", *args], capture_output=True, text=True, env=self.env,
                             timeout=timeout)
        if check:
            assert out.returncode == 0, f"docker {' '.join(args)}:\n{out.stderr[-4000:]}"
        return out

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).stdout.strip()
        assert cid, f"no container for {service}"
        return cid

    def state(self, service: str) -> dict[str, Any]:
        cid = self.container(service)
        info = json.loads(self.docker("inspect", cid).stdout)[0]
        return {"id": cid, "restarts": info["RestartCount"], **info["State"]}

    def ip(self, service: str) -> str:
        cid = self.container(service)
        return self.docker("inspect", "-f",
                           "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                           cid).stdout.strip()

    def volume(self, name: str) -> Path:
        return Path(self.docker("volume", "inspect", "-f", "{{.Mountpoint}}",
                                f"{self.project}_{name}").stdout.strip())

    def exec(self, service: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return self.docker("exec", self.container(service), *argv, check=False)

    def crash(self, service: str) -> dict[str, Any]:
        """kill -9 of the container's init (pid 1) from the host; returns the kill's record
        once the restart policy has brought the service back (running, and healthy where it
        has a healthcheck)."""
        before = self.state(service)
        assert before["Running"], before
        t0 = time.time()
        os.kill(before["Pid"], signal.SIGKILL)
        deadline = time.monotonic() + 300
        while True:
            st = self.state(service)
            health = (st.get("Health") or {}).get("Status", "healthy")
            if st["restarts"] > before["restarts"] and st["Running"] and health == "healthy":
                break
            assert time.monotonic() < deadline, f"{service} not back after 300 s: {st}"
            time.sleep(0.5)
        return {"service": service, "at": t0, "back_s": round(time.time() - t0, 1),
                "exit": 137, "restarts": st["restarts"]}


def wait_for(what: str, probe: Any, timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := probe()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f} s"
        time.sleep(every)
    return got


def proc_status(compose: Compose, service: str) -> dict[str, Any]:
    """/proc/1/status (the container's init) and the service process's, read inside the
    container, plus a write outside its volumes, a read of the credential secret, and its
    identity folder (HARNESSRL_TLS_DIR: the files, the key's mode and owner, no CA key)."""
    out: dict[str, Any] = {}
    code = ("import os,re,json,sys\n"
            "def st(p):\n"
            "    t=open(f'/proc/{p}/status').read()\n"
            f"    return {{k: re.search(rf'^{{k}}:\\s*(.*)$', t, re.M)[1] for k in {STATUS_FIELDS!r}}}\n"
            "pids=[p for p in os.listdir('/proc') if p.isdigit() and p!=str(os.getpid())]\n"
            "svc=[p for p in pids if b'python' in open(f'/proc/{p}/cmdline','rb').read()"
            " and p!='1']\n"
            "d=os.environ.get('HARNESSRL_TLS_DIR')\n"
            "k=os.stat(f'{d}/tls.key') if d else None\n"
            "tls={'dir': d, 'files': sorted(os.listdir(d)) if d else [],"
            " 'key_mode': oct(k.st_mode & 0o777) if k else None,"
            " 'key_uid': k.st_uid if k else None,"
            " 'ca_key_here': bool(d) and any(os.path.exists(p) for p in"
            " (f'{d}/ca.key', f'{d}/../ca/ca.key', '/var/lib/harnessrl/tls/ca/ca.key'))}\n"
            "print(json.dumps({'init': st(1), 'service': st(min(svc, key=int)) if svc else None,"
            " 'cmd': open(f'/proc/{min(svc, key=int)}/cmdline','rb').read().decode()"
            ".replace(chr(0),' ') if svc else None, 'tls': tls}))\n")
    r = compose.exec(service, "python", "-c", code)
    assert r.returncode == 0, f"{service}: {r.stderr}"
    out.update(json.loads(r.stdout))
    write = compose.exec(service, "python", "-c",
                         "import sys\nfor p in sys.argv[1:]:\n"
                         "    try: open(p + '/.hrl-write-probe', 'w').write('x'); print(p)\n"
                         "    except OSError as e: pass\n",
                         "/", "/opt", "/usr", "/etc", "/var/lib/harnessrl", "/tmp")
    out["writable"] = write.stdout.split()
    secret = compose.exec(service, "python", "-c", f"print(len(open({SECRET!r}).read()))")
    out["reads_secret"] = secret.returncode == 0
    return out


def redis_status(compose: Compose) -> dict[str, Any]:
    """Redis's image has no Python: its checks through the shell tools it has."""
    out: dict[str, Any] = {}
    status = compose.exec("redis", "cat", "/proc/1/status").stdout
    out["init"] = {k: re.search(rf"^{k}:\s*(.*)$", status, re.M)[1]  # type: ignore[index]
                   for k in STATUS_FIELDS}
    out["reads_secret"] = compose.exec("redis", "cat", SECRET).returncode == 0
    return out


# the kills that can fail a rollout's attempt: its harness's calls go through the gateway (a
# trainer's kill fails none: the restarted trainer redoes its step on the same rollouts)
FAILS_ATTEMPTS = {"gateway"}


def kills_explaining(dropped: dict[str, str], view: ca.RedisView,
                     kills: list[dict[str, Any]], end: float) -> dict[str, list[str]]:
    """Each dropped rollout's kills (as chaos_accounting ties them): every attempt the store
    records for it ran during the window of a kill that can fail an attempt, from the kill -9
    to the service serving again; a succeeded rollout dropped with its group, by the kills of
    its group's failed rollouts. [] for a drop no kill explains."""
    windows = [ca.KillWindow(k["service"], k["at"], k["at"] + k["back_s"],
                             f"{k['service']}@{k['at']:.1f}") for k in kills
               if k["service"] in FAILS_ATTEMPTS]

    def of_attempts(ro: c.Rollout) -> list[str]:
        found: list[str] = []
        for a in ro.attempts:
            ks = [w.label for w in windows if w.covers(a.started_at, a.finished_at or end)]
            if not ks:
                return []
            found += [k for k in ks if k not in found]
        return found

    out = {rid: of_attempts(view.rollouts[rid]) if view.rollouts[rid].status != ca.SUCCEEDED
           else [] for rid in dropped}
    for rid in dropped:
        ro = view.rollouts[rid]
        if ro.status == ca.SUCCEEDED and not out[rid]:
            failed = [r for r, x in view.rollouts.items() if x.group_id == ro.group_id
                      and x.status != ca.SUCCEEDED]
            if failed and all(out.get(r) for r in failed):
                out[rid] = sorted({k for r in failed for k in out[r]})
    return out


def account(compose: Compose, expected: dict[str, int], prefix: str,
            metrics_file: Path, password: str, kills: list[dict[str, Any]]) -> dict[str, Any]:
    """Every expected rollout (the trainer's documented task rule, recomputed) is in Redis
    (read directly, on the compose network's address), and is trained (claimed by the
    trainer and its group acknowledged in Redis) or dropped with a reason and a kill that
    explains it (`kills_explaining`), or in a group whose succeeded rollouts all have one reward
    in Redis (the trainer's zero-variance drop, by design); none twice."""
    url = (f"redis://{STORE_REDIS_USER}:{password}@{compose.ip('redis')}:"
           f"{compose.env['REDIS_PORT']}/0")
    view = ca.read_redis(url, KEY_PREFIX, prefix, set(expected))
    claims = ca.read_claims(metrics_file)
    entry = {e.group_id: e for e in view.entries}
    acked = {g for g, e in entry.items() if e.acked and e.dead_reason is None}
    # The trainer trims acknowledged entries below its checkpoint (services/trainer/
    # checkpoint.py): a claimed group without an entry counts as acknowledged only if the
    # stream trimmed at least that many entries.
    r = redis.Redis.from_url(url)
    info = r.xinfo_stream(f"{KEY_PREFIX}stream:{ca.STREAM}")
    r.close()
    trimmed = int(info["entries-added"]) - int(info["length"])
    gone = {rid.rsplit("/", 1)[0] for rid in expected if claims.trained[rid] == 1} - set(entry)
    assert len(gone) <= trimmed, f"{len(gone)} claimed groups have no entry, {trimmed} trimmed"
    acked |= gone
    lost = sorted(set(expected) - set(view.rollouts))
    twice = sorted(r for r, n in claims.trained.items() if n > 1)
    trained = sorted(r for r in expected if claims.trained[r] == 1
                     and r.rsplit("/", 1)[0] in acked)
    dropped: dict[str, str] = {}
    unexplained = []
    by_design: list[str] = []
    for rid in sorted(set(expected) - set(trained) - set(lost)):
        ro = view.rollouts[rid]
        reason = claims.dropped.get(rid) or (ro.error or "").strip()
        if reason == ca.ZERO_VARIANCE:  # the trainer's own drop: no signal, no kill behind it
            if ca.equal_rewards(rid, view.rollouts):
                by_design.append(rid)
            else:
                unexplained.append(f"{rid}: dropped ({reason}), but its group's succeeded "
                                   "rollouts have different rewards in the store")
            continue
        if reason and ro.status != ca.SUCCEEDED or rid in claims.dropped:
            dropped[rid] = reason
        else:
            e = entry.get(rid.rsplit("/", 1)[0])
            unexplained.append(
                f"{rid}: {c.RolloutStatus.Name(ro.status)}, claimed trained "
                f"{claims.trained[rid]}x, its group's stream entry: "
                f"{e if e else 'none'}")
    tied = kills_explaining(dropped, view, kills, time.time())
    unexplained += [f"{rid}: dropped ({dropped[rid]}), no kill explains it: attempts "
                    f"{[(a.started_at, a.finished_at) for a in view.rollouts[rid].attempts]}, "
                    f"kills {kills}" for rid, ks in tied.items() if not ks]
    return {"expected": len(expected), "trained": len(trained), "lost": lost, "trimmed": trimmed,
            "trained_twice": twice, "dropped": {rid: f"{why} [{', '.join(tied[rid])}]"
                                                for rid, why in dropped.items()},
            "unexplained": unexplained, "zero_variance": len(by_design),
            "dropped_by_reason": dict(Counter(
                re.sub(r"[0-9a-f]{8,}|\d+", "#", r)[:80] for r in dropped.values()))}


def auth_checks(dc: Compose, run: ComposeRun, tmp: Path) -> None:
    """What authentication looks like in the running project (see the module docstring)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    for cid in dc.compose("ps", "-a", "-q").stdout.split():
        info = json.loads(dc.docker("inspect", cid).stdout)[0]
        service = info["Config"]["Labels"]["com.docker.compose.service"]
        run.mounts[service] = {m["Name"].removeprefix(f"{dc.project}_"): m["RW"]
                               for m in info["Mounts"] if m["Type"] == "volume"}
        if service == "pki":
            run.pki_exit = info["State"]["ExitCode"]
    for volume in HOLDERS:
        crt = dc.volume(volume) / "tls.crt"
        if crt.exists():
            cert = x509.load_pem_x509_certificate(crt.read_bytes())
            run.identities[volume] = str(
                cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)
    # Redis: nothing without the store's password, a wrong one refused; the healthcheck's
    # `redis-cli ping` (exit 0 on NOAUTH too) from inside
    port = int(dc.env["REDIS_PORT"])
    for who, kw, call in (("none", {}, "get"), ("none_ping", {}, "ping"),
                          ("wrong", {"username": STORE_REDIS_USER, "password": "x"}, "get")):
        r = redis.Redis(host=dc.ip("redis"), port=port, **kw)  # type: ignore[arg-type]
        try:
            r.get(f"{KEY_PREFIX}anything") if call == "get" else r.ping()
            run.redis_auth[who] = "allowed"
        except redis.RedisError as exc:
            run.redis_auth[who] = f"{type(exc).__name__}: {exc}"
        finally:
            r.close()
    probe = dc.exec("redis", "redis-cli", "-p", str(port), "ping")
    run.redis_auth["healthcheck"] = f"{probe.returncode} {probe.stdout.strip()}"
    # The engine, from where the rollouts run (the controller's container): no key, no entry
    engine = f"http://engine:{dc.env['ENGINE_PORT']}"
    code = ("import sys, urllib.request, urllib.error\n"
            "for method, path in (('GET', '/health'), ('GET', '/v1/models'), ('POST', '/pause'),"
            " ('POST', '/update_weights'), ('POST', '/v1/completions')):\n"
            "    req = urllib.request.Request(sys.argv[1] + path, method=method,"
            " data=b'{}' if method == 'POST' else None,"
            " headers={'Content-Type': 'application/json'})\n"
            "    try: status = urllib.request.urlopen(req, timeout=10).status\n"
            "    except urllib.error.HTTPError as e: status = e.code\n"
            "    print(method, path, status)\n")
    out = dc.exec("controller", "python", "-c", code, engine)
    assert out.returncode == 0, out.stderr
    run.engine_from_rollouts = {" ".join(line.split()[:2]): int(line.split()[2])
                                for line in out.stdout.splitlines()}
    # A container's probe runs as its own identity (Compose's last probe of the store passed);
    # without it the same probe fails
    cid = dc.container("store")
    health = json.loads(dc.docker("inspect", cid).stdout)[0]["State"]["Health"]
    run.healthcheck["own"] = health["Log"][-1]["ExitCode"] if health["Log"] else -1
    grpc_probe = json.loads(dc.docker("inspect", cid).stdout)[0]["Config"]["Healthcheck"][
        "Test"][1:]
    assert grpc_probe[:4] == ["python", "-m", "harnessrl.healthcheck", "grpc"], grpc_probe
    run.healthcheck["none"] = dc.docker("exec", "-e", "HARNESSRL_TLS_DIR=", cid, *grpc_probe,
                                        check=False).returncode
    # The operator's identity, copied out as docs/deploy.md says, on the published port
    out_dir = tmp / "operator-tls"
    cmd = ["bash", str(REPO / "scripts" / "compose-identity.sh"), "operator",
           "--project-directory", str(REPO), "-p", dc.project,
           *[x for f in dc.files for x in ("-f", str(f))]]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env={**dc.env, "HARNESSRL_COMPOSE_TLS": str(out_dir)})
    assert got.returncode == 0, got.stdout + got.stderr
    folder = out_dir / "operator"
    run.operator["files"] = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()}
    run.operator["folder_mode"] = oct(folder.stat().st_mode & 0o777)
    from harnessrl import rpc
    from harnessrl.identity import Identity
    from harnessrl.v1 import controller_pb2, controller_pb2_grpc

    operator = Identity.from_folder(folder)
    address = f"127.0.0.1:{dc.env['CONTROLLER_PORT']}"
    run.operator["name"] = operator.name
    run.operator["health"] = rpc.health_check(address, timeout=10, peer="controller",
                                              ident=operator)
    with rpc.channel(address, "controller", operator) as ch:
        stub = controller_pb2_grpc.ControllerStub(ch)
        try:
            stub.GetRun(c.GetRunRequest(run_id="no-such-run"), timeout=10)
            run.operator["get_run"] = "OK"
        except grpc.RpcError as exc:
            run.operator["get_run"] = exc.code().name
        try:  # the trainer's alone
            stub.AdmissionUpdate(controller_pb2.AdmissionUpdateRequest(), timeout=10)
            run.operator["admission_update"] = "OK"
        except grpc.RpcError as exc:
            run.operator["admission_update"] = f"{exc.code().name}: {exc.details()}"
    # and a caller with a certificate of another CA (this test session's admin) is refused
    run.operator["foreign_ca"] = rpc.health_check(address, timeout=10, peer="controller")


def redteam(dc: Compose, run: ComposeRun, tmp: Path) -> None:
    """The red-team harness (harnessrl/testing/redteam_harness.py) as a rollout of the running
    project, created by the operator through the controller: it runs in a container of its
    own (the docker backend, through the gate) and probes the project's real service names and
    ports. Then the same harness in the controller's container, where Compose ran every
    rollout before (the control: there the probes succeed, so the test can fail)."""
    from harnessrl.clients import ControllerClient
    from harnessrl.identity import Identity

    e = dc.env
    targets = {"secret_file": SECRET, "workdir_root": "/var/lib/harnessrl/rollouts",
               "tasks_file": "/opt/examples/calc/tasks.jsonl", "tls": "/etc/harnessrl/tls",
               "more_secrets": ["/etc/harnessrl/tls/tls.key", "/etc/harnessrl/grader-tls/tls.key"],
               "tcp": {"store": f"store:{e['STORE_PORT']}",
                       "controller": f"controller:{e['CONTROLLER_PORT']}",
                       "gateway_admin": f"gateway:{e['GATEWAY_GRPC_PORT']}",
                       "engine": f"engine:{e['ENGINE_PORT']}"},
               "redis": f"redis:{e['REDIS_PORT']}", "gateway_port": 8080,
               "bomb": 700, "hog_mb": 2400}  # past the rollout containers' 512 and 2048 MB
    source = REDTEAM.read_text()  # run as `python -c` (the image has no harnessrl)
    operator = Identity.from_folder(tmp / "operator-tls" / "operator")
    ctl = ControllerClient.connect(f"127.0.0.1:{e['CONTROLLER_PORT']}", ident=operator)
    try:
        spec = ctl.create_run(c.RunSpec(
            name="redteam-compose", harness_command=["python", "-c", source, json.dumps(targets)],
            grader_command=["false"], reward_source=c.REWARD_SOURCE_GRADER_EXIT_CODE,
            timeout_s=300, concurrency=1, stream="-", tasks=[c.Task(data_json="{}")]))
        list(ctl.watch_run(spec.run_id, timeout=600))
        [ro] = ctl.list_rollouts(spec.run_id).rollouts
    finally:
        ctl.close()
    run.redteam_rollout = ro
    workdir = Path(ro.attempts[-1].workdir).relative_to("/var/lib/harnessrl/rollouts")
    out = (dc.volume("rollouts") / workdir / "stdout.log").read_text().strip().splitlines()
    run.redteam = json.loads(out[-1]) if out else {}
    control = dc.docker(  # as a harness there got its gateway (limits: not what this is about)
        "exec", "-e", f"OPENAI_BASE_URL=http://gateway:{e['GATEWAY_HTTP_PORT']}/v1", "-e",
        "OPENAI_API_KEY=none", "-w", "/tmp", dc.container("controller"), "python", "-c", source,
        json.dumps({**targets, "bomb": 20, "hog_mb": 16}), check=False)
    lines = control.stdout.strip().splitlines()
    run.redteam_control = json.loads(lines[-1]) if lines else {"error": control.stderr[-2000:]}


def project_env(docker_daemon: Any, built_images: dict[str, Any], tmp: Path, steps: int,
                project: str) -> tuple[dict[str, str], Path]:
    """The environment of a compose project on the CPU profile (a new secret, free published
    ports, the built redis image, the daemon's socket for the gate, a rollout network of the
    project's own) and an override file that trains for `steps` steps."""
    secret = tmp / "secret-dir" / "secret"
    subprocess.run(["bash", str(REPO / "scripts" / "compose-secret.sh")], check=True,
                   env={**os.environ, "HARNESSRL_SECRET_FILE": str(secret)}, timeout=30)
    env = {k: v for k, v in docker_daemon.env.items() if not k.startswith("COMPOSE_")}
    env.update({var: str(free_port()) for var in PORT_VARS})
    env.update({"COMPOSE_PROFILES": "cpu", "HARNESSRL_SECRET_FILE": str(secret),
                "REDIS_IMAGE": built_images["redis"]["tag"],
                "DOCKER_SOCKET": docker_daemon.env["DOCKER_HOST"].removeprefix("unix://"),
                "ROLLOUT_NETWORK": f"{project}-rollouts"})
    override = tmp / "steps.override.yml"
    override.write_text(yaml.safe_dump({"services": {"trainer-cpu": {
        "environment": {"HARNESSRL_TRAINER_STEPS": str(steps)}}}}))
    return env, override


def seed_models(dc: Compose, project: str, model_dir: Path, trainer_image: str) -> None:
    """The tiny model in the project's `models` volume (model-cpu then finds it and exits at
    once), owned by the images' user."""
    vol = f"{project}_models"
    dc.docker("volume", "create", "--label", f"com.docker.compose.project={project}",
              "--label", "com.docker.compose.volume=models", vol)
    dc.docker("run", "--rm", "--network", "none", "--user", "0:0", "-v", f"{vol}:/models",
              "-v", f"{model_dir}:/src:ro", trainer_image,
              "sh", "-c", "cp -a /src /models/tiny-qwen3 && chown -R 10001:10001 /models",
              timeout=300)


@pytest.fixture(scope="module")
def compose(docker_daemon, built_images, tiny_model_dir: Path,  # type: ignore[no-untyped-def]
            tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("compose")
    project = f"hrltest{secrets.token_hex(3)}"
    env, override = project_env(docker_daemon, built_images, tmp, STEPS, project)
    base = Compose(project, [REPO / "docker-compose.yml"], env)
    dc = Compose(project, [REPO / "docker-compose.yml", override], env)
    run = ComposeRun(logs=tmp / "compose.log")
    run.base = yaml.safe_load(base.compose("config").stdout)
    run.merged = yaml.safe_load(dc.compose("config").stdout)
    try:
        seed_models(dc, project, tiny_model_dir, built_images["trainer"]["tag"])
        t0 = time.monotonic()
        dc.compose("up", "-d", "--no-build", timeout=900)
        run.up_s = round(time.monotonic() - t0, 1)
        checkpoints = dc.volume("checkpoints") / "calc"
        # the store's Redis password (the test reads Redis as the store does, to account)
        password = (dc.volume("redis-password") / "password").read_text().strip()
        r = redis.Redis(host=dc.ip("redis"), port=int(env["REDIS_PORT"]),
                        username=STORE_REDIS_USER, password=password)

        def rollouts_of_step(step: int) -> int:
            return sum(1 for _ in r.scan_iter(match=f"{KEY_PREFIX}ro:*-step{step:06d}/*",
                                              count=1000))

        t_train = time.monotonic()
        # the trainer's view from inside, while it runs (it exits when training is done)
        wait_for("step 1's first rollout", lambda: rollouts_of_step(1), 600)
        run.inside["trainer-cpu"] = proc_status(dc, "trainer-cpu")
        run.kills.append(dc.crash("gateway"))  # step 1's rollouts in flight
        metrics = checkpoints / "metrics.jsonl"

        def steps_done() -> int:
            return len(metrics.read_text().splitlines()) if metrics.exists() else 0

        wait_for("step 1 trained", lambda: steps_done() >= 1, 900)
        wait_for("step 2's first rollout", lambda: rollouts_of_step(2), 600)
        run.kills.append(dc.crash("trainer-cpu"))  # mid step 2: it resumes and redoes it

        def trainer_done() -> bool:
            st = dc.state("trainer-cpu")
            return st["Status"] == "exited" and not st["Restarting"]

        wait_for("the trainer's last step", trainer_done, 1500, every=2.0)
        run.train_s = round(time.monotonic() - t_train, 1)
        run.trainer_exit = dc.state("trainer-cpu")["ExitCode"]
        run.metrics = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        latest = checkpoints / "checkpoints" / "latest"
        run.checkpoint = latest.read_text().strip() if latest.exists() else ""
        if run.checkpoint:
            ck = checkpoints / "checkpoints" / run.checkpoint
            run.checkpoint_files = sorted(p.name for p in ck.iterdir()) if ck.is_dir() else []
        # training seen from outside the trainer: the engine container asked over HTTP (with
        # the trainer's engine key), the checkpoint read from the volume
        key = ClientKey((dc.volume("engine-key-trainer") / "key").read_text().strip())
        run.probe = trained_probe.probe_engine(
            f"http://{dc.ip('engine-cpu')}:{env['ENGINE_PORT']}", tiny_model_dir, "tiny", key,
            checkpoints / "checkpoints" / run.checkpoint if run.checkpoint else None)
        prefix = json.loads((checkpoints / "run.json").read_text())["run_prefix"]
        tasks = REPO / "examples" / "calc" / "tasks.jsonl"  # the trainer image's copy
        from services.trainer.config import TrainerConfig

        tc = TrainerConfig.model_fields
        expected = ca.expected_sync(tasks, tc["seed"].default, STEPS,
                                    tc["tasks_per_step"].default, tc["group_size"].default,
                                    prefix)
        run.accounting = account(dc, expected, prefix, metrics, password, run.kills)
        r.close()
        for svc in RUNNING:
            run.inside[svc] = redis_status(dc) if svc == "redis" else proc_status(dc, svc)
        t_auth = time.monotonic()
        auth_checks(dc, run, tmp)
        run.auth_checks_s = round(time.monotonic() - t_auth, 1)
        t_red = time.monotonic()
        redteam(dc, run, tmp)
        run.redteam_s = round(time.monotonic() - t_red, 1)
        yield run
    finally:
        logs = dc.compose("logs", "--no-color", "--timestamps", timeout=120, check=False)
        (tmp / "compose.log").write_text(logs.stdout + logs.stderr)
        run.leftover_rollouts = dc.docker("ps", "-aq", "--filter", f"label={ROLLOUT_LABEL}",
                                          "--filter", f"network={env['ROLLOUT_NETWORK']}",
                                          check=False).stdout.split()
        for cid in run.leftover_rollouts:  # (a failed run's; the controller cleans up its own)
            dc.docker("rm", "-f", cid, check=False)
        dc.compose("down", "-v", "--remove-orphans", "-t", "20", timeout=300, check=False)


# -- the tests ---------------------------------------------------------------------------------

def test_images_built_and_light_services_hold_no_torch(built_images, docker_daemon) -> None:  # type: ignore[no-untyped-def]
    """Every compose image exists with its input-hash label; the gateway, store and
    controller images cannot import torch (they install their own locks only)."""
    for name, row in built_images.items():
        assert row["size_mb"] > 0, name
    for name in ("gateway", "store", "controller", "controller-example"):
        out = subprocess.run(["docker", "run", "--rm", "--network", "none",
                              built_images[name]["tag"], "python", "-c", "import torch"],
                             capture_output=True, text=True, env=docker_daemon.env, timeout=120)
        assert out.returncode != 0 and "No module named 'torch'" in out.stderr, (name, out)
    out = subprocess.run(["docker", "run", "--rm", "--network", "none",
                          built_images["trainer"]["tag"], "python", "-c",
                          "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, env=docker_daemon.env, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("2."), out.stderr  # so the probe works


def test_images_are_reused_when_inputs_are_unchanged(built_images, docker_daemon) -> None:  # type: ignore[no-untyped-def]
    """A second `scripts/images.sh` builds nothing (every image's label matches its inputs)."""
    import sys

    mode = [] if os.environ.get("HARNESSRL_IMAGES_ONLINE") == "1" else ["--offline"]
    report = REPO / ".harnessrl" / "images-again.json"
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "images.py"), *mode,
                          "--only", "store", "gateway", "controller-example", "--report",
                          str(report)], env=docker_daemon.env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr
    rows = json.loads(report.read_text())
    assert [r["built"] for r in rows if r["name"] != "python-standin"] == [False] * 3, rows


def test_merged_config_differs_from_the_base_only_in_the_steps(compose: ComposeRun) -> None:
    base, merged = compose.base, compose.merged
    env = merged["services"]["trainer-cpu"]["environment"]
    assert env.pop("HARNESSRL_TRAINER_STEPS") == str(STEPS)
    for cfg in (base, merged):  # compose merges a service's volumes as a set: order is noise
        for svc in cfg["services"].values():
            if "volumes" in svc:
                svc["volumes"] = sorted(svc["volumes"], key=str)
    assert merged == base
    for name in PYTHON_SERVICES:  # the security fields, spelled out
        svc = base["services"][name]
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
        assert svc["security_opt"] == ["no-new-privileges:true"] and svc["init"] is True, name


def test_compose_trains_through_a_gateway_and_a_trainer_crash(compose: ComposeRun) -> None:
    """Every expected rollout is trained once or dropped, and each drop is tied to a kill that
    can cause it (`kills_explaining`: the gateway's, over every attempt of the rollout); a
    trainer that dropped groups on its own would leave drops no kill explains."""
    print(json.dumps({k: v for k, v in compose.__dict__.items()
                      if k not in ("base", "merged", "inside")}, indent=1, default=str))
    assert compose.trainer_exit == 0, f"trainer exited {compose.trainer_exit}; {compose.logs}"
    assert [m["step"] for m in compose.metrics] == list(range(1, STEPS + 1))
    for m in compose.metrics:
        assert "reward_mean" in m and 0.0 <= m["reward_mean"] <= 1.0, m
    assert compose.checkpoint.endswith(f"{STEPS:06d}") and compose.checkpoint_files
    assert [k["service"] for k in compose.kills] == ["gateway", "trainer-cpu"]
    acc = compose.accounting
    assert not acc["lost"] and not acc["trained_twice"] and not acc["unexplained"], acc
    assert acc["trained"] + len(acc["dropped"]) + acc["zero_variance"] == acc["expected"] > 0, acc
    assert acc["trained"] > 0, acc


def test_the_engine_serves_what_the_trainer_trained(compose: ComposeRun) -> None:
    """From outside the trainer (harnessrl/testing/trained_probe.py): the engine container's
    logprobs of a fixed probe moved from the base model's and equal the last checkpoint's in
    the volume, computed offline. A trainer that drops every group pushes nothing: the engine
    then serves the base weights, and this fails."""
    assert compose.probe is not None and compose.probe.checkpoint, compose.probe
    assert trained_probe.check(compose.probe) == []


@pytest.mark.parametrize("service", [*RUNNING, "trainer-cpu"])
def test_each_service_runs_unprivileged_and_read_only(compose: ComposeRun, service: str) -> None:
    """From /proc inside: uid 10001 (Redis: 999), no effective capabilities, NoNewPrivs set;
    a write outside the service's volumes (and its tmpfs /tmp) fails; only the gateway and
    the controller can read the credential secret."""
    seen = compose.inside[service]
    uid = {"redis": "999", "gate": "0"}.get(service, "10001")  # (the gate: the Docker socket's
    if service == "gate":  # owner, with no capability at all, not even in its bounding set)
        assert int(seen["init"]["CapBnd"], 16) == 0, seen
    procs = [seen["init"]] + ([seen["service"]] if seen.get("service") else [])
    if service != "redis":
        assert seen["service"], f"{service}: no service process found"
    for st in procs:
        assert st["Uid"].split()[0] == uid and st["Gid"].split()[0] == uid, st
        assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0, st
        if service != "redis":  # Redis's service has no hardening in the file (it has no
            assert st["NoNewPrivs"] == "1", st  # Python, runs Debian's or the official image)
    if service != "redis":
        assert seen["writable"] == ["/tmp"], seen["writable"]
    assert seen["reads_secret"] == (service in SECRET_READERS), seen


def test_each_credential_reaches_only_its_holders(compose: ComposeRun) -> None:
    """Docker's record of every container's mounts: the one-shot `pki` (exited 0) mounts every
    credential volume and is the only one with the CA's; each service its own identity (its
    certificate's CN is that identity) and its own secrets, read-only, nothing else's."""
    assert compose.pki_exit == 0
    assert set(compose.mounts["pki"]) >= set(HOLDERS) and all(
        compose.mounts["pki"][v] for v in HOLDERS)
    for service, mounts in compose.mounts.items():
        if service == "pki":
            continue
        held = {v for v in mounts if v in HOLDERS}
        assert held == {v for v, who in HOLDERS.items() if service in who}, (service, held)
        assert not any(mounts[v] for v in held), f"{service} mounts a credential writable"
    for volume, cn in compose.identities.items():
        assert volume == f"tls-{cn}", (volume, cn)
    assert set(compose.identities) == {v for v in HOLDERS if v.startswith("tls-")}


@pytest.mark.parametrize("service", list(IDENTITY_OF))
def test_each_service_runs_as_its_own_identity(compose: ComposeRun, service: str) -> None:
    """Inside: HARNESSRL_TLS_DIR=/etc/harnessrl/tls with the CA's certificate, its own
    certificate and key (0600, the service's uid), and no CA key anywhere it looks."""
    tls = compose.inside[service]["tls"]
    assert tls["dir"] == "/etc/harnessrl/tls", tls
    assert tls["files"] == ["ca.crt", "tls.crt", "tls.key"], tls
    assert tls["key_mode"] == "0o600" and tls["key_uid"] == 10001, tls
    assert tls["ca_key_here"] is False


def test_redis_refuses_all_but_the_store(compose: ComposeRun) -> None:
    """Without the store's password every command (PING too) is refused, a wrong password
    too (redis-py says AuthenticationError: its HELLO refused); the healthcheck's probe gets
    NOAUTH and exits 0 (it tells that Redis answers)."""
    auth = compose.redis_auth
    for who in ("none", "none_ping"):
        assert auth[who].startswith("AuthenticationError") and "authenticated" in auth[who], auth
    assert auth["wrong"].startswith("AuthenticationError") and "invalid" in auth["wrong"], auth
    assert auth["healthcheck"].startswith("0 ") and "NOAUTH" in auth["healthcheck"], auth


def test_the_redteam_harness_as_a_rollout_container(compose: ComposeRun) -> None:
    """Issue 41, Compose: the red-team harness as a rollout runs in its own container (the
    docker backend through the gate) on the rollout network: every probe of the project's
    services (store, controller, the gateway's admin port, the engine, Redis), files (the
    secret, the identities, the rollout records, the task file), processes and limits is
    refused or contained, its own key reaches the gateway through the door, and the reward is
    the grader's. The control: the same harness in the controller's container, where Compose
    ran rollouts before, connects to every service and reads the secret."""
    seen = dict(compose.redteam)
    print(json.dumps({"rollout": seen, "control": compose.redteam_control}, indent=1))
    outcomes = {name: r["outcome"] for name, r in seen.items()}
    assert outcomes.pop("own_key", None) == "ok", seen
    ro = compose.redteam_rollout
    assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED and ro.has_reward and ro.reward == 0.0, ro
    assert set(NETWORK_PROBES) <= set(outcomes), seen
    assert all(o in ("refused", "contained") for o in outcomes.values()), seen
    assert outcomes["fork_bomb"] == outcomes["memory_hog"] == "contained", seen
    assert "error" not in compose.redteam_control, compose.redteam_control["error"]
    control = {name: r["outcome"] for name, r in compose.redteam_control.items()}
    connects = [p for p in NETWORK_PROBES if p.startswith("connect_")]
    assert {p: control.get(p) for p in connects} == dict.fromkeys(connects, "succeeded"), \
        compose.redteam_control
    assert control["read_secret"] == "succeeded", compose.redteam_control
    assert compose.leftover_rollouts == [], "rollout containers left behind"


def test_engine_refuses_callers_without_a_key_from_the_rollouts_container(
        compose: ComposeRun) -> None:
    """From the controller's container (where the harnesses ran before they got containers
    of their own, which do not reach the engine at all): /health answers, every other route
    (the OpenAI API, pause, weight updates) is 401 without a key."""
    seen = compose.engine_from_rollouts
    assert seen.pop("GET /health") == 200, seen
    assert seen and all(status == 401 for status in seen.values()), seen


def test_grpc_healthchecks_run_as_the_services_identity(compose: ComposeRun) -> None:
    """The store's probe, as Compose ran it last in its container, passed; the same probe
    with HARNESSRL_TLS_DIR emptied (no identity) fails."""
    assert compose.healthcheck["own"] == 0 and compose.healthcheck["none"] != 0, \
        compose.healthcheck


def test_the_operator_identity_copied_to_the_host_works_and_is_scoped(
        compose: ComposeRun) -> None:
    """scripts/compose-identity.sh: the folder 0700, the key 0600; as the operator the
    controller answers (GetRun of an unknown run: NOT_FOUND) and refuses the trainer's RPC
    naming the identity; a certificate of another CA is refused at the handshake."""
    op = compose.operator
    assert op["folder_mode"] == "0o700" and op["files"] == {
        "ca.crt": "0o644", "tls.crt": "0o644", "tls.key": "0o600"}, op
    assert op["name"] == "operator" and op["health"] is True, op
    assert op["get_run"] == "NOT_FOUND", op
    assert op["admission_update"].startswith("PERMISSION_DENIED") and \
        "operator" in op["admission_update"], op
    assert op["foreign_ca"] is False, op
