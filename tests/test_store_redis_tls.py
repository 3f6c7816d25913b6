"""The store and a Redis across the network (issue #40): TLS with a rediss:// URL and an ACL user.

A real redis-server speaks TLS only (`port 0`, a `tls-port`), asks clients for a certificate
(`tls-auth-clients yes`, Redis's default) and lets in only the store's ACL user. Its
certificate comes from a harnessrl.pki CA, issued for `localhost` (the host of the URL: the
store verifies it). A real store (`python -m services.store`) reaches it with
HARNESSRL_STORE_REDIS_URL=rediss://harnessrl-store@localhost:P/0, the password from
HARNESSRL_STORE_REDIS_PASSWORD_FILE and HARNESSRL_STORE_REDIS_TLS_{CA,CERT,KEY}_FILE; what it
writes through gRPC is read back through gRPC. A plaintext URL, a wrong CA, no CA (the system's
trust store), a host the certificate does not name, no client certificate and a wrong password
each keep the store from starting, with a log line that says why.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harnessrl import pki, procs, redis_server
from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c
from services.store.config import StoreConfig

PASSWORD = "tls-redis-pw-0123456789"
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


class TlsRedis:
    def __init__(self, root: Path) -> None:
        self.pki = pki.Pki(root / "pki")
        self.pki.ensure(("store",))
        self.server = self.pki.issue("redis", dns=("localhost",))
        self.client = self.pki.folder("store")  # the store's certificate, from the same CA
        self.port = procs.free_port()
        conf = [
            "port 0", f"tls-port {self.port}", "bind 127.0.0.1", f"dir {root}", 'save ""',
            f"tls-cert-file {self.server / 'tls.crt'}", f"tls-key-file {self.server / 'tls.key'}",
            f"tls-ca-cert-file {self.server / 'ca.crt'}", "tls-auth-clients yes",
            "user default off resetpass ~* &* +@all",
            f"user {redis_server.STORE_USER} on >{PASSWORD} {redis_server.STORE_ACL}"]
        procs.write_private(root / "redis.conf", "\n".join(conf) + "\n")
        self.proc = procs.ServiceProcess("redis", [str(shutil.which("redis-server")),
                                                    str(root / "redis.conf")], root).start()
        self.password_file = root / "password"
        procs.write_private(self.password_file, PASSWORD + "\n")
        deadline = time.monotonic() + 20
        while not self._answers():
            assert self.proc.alive and time.monotonic() < deadline, self.proc.log_tail()
            time.sleep(0.05)

    def direct(self) -> redis.Redis:
        return redis.Redis(host="localhost", port=self.port, ssl=True,
                           username=redis_server.STORE_USER, password=PASSWORD,
                           ssl_ca_certs=str(self.client / "ca.crt"),
                           ssl_certfile=str(self.client / "tls.crt"),
                           ssl_keyfile=str(self.client / "tls.key"), socket_timeout=2)

    def _answers(self) -> bool:
        try:
            return bool(self.direct().ping())
        except (redis.RedisError, OSError):
            return False

    def store_env(self, **over: str) -> dict[str, str]:
        env = {"HARNESSRL_STORE_REDIS_URL":
               f"rediss://{redis_server.STORE_USER}@localhost:{self.port}/0",
               "HARNESSRL_STORE_REDIS_PASSWORD_FILE": str(self.password_file),
               "HARNESSRL_STORE_REDIS_TLS_CA_FILE": str(self.client / "ca.crt"),
               "HARNESSRL_STORE_REDIS_TLS_CERT_FILE": str(self.client / "tls.crt"),
               "HARNESSRL_STORE_REDIS_TLS_KEY_FILE": str(self.client / "tls.key")}
        env.update(over)
        return {k: v for k, v in env.items() if v}


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    r = TlsRedis(tmp_path_factory.mktemp("tls-redis"))
    yield r
    r.proc.stop()


def _start_store(workdir: Path, env: dict[str, str]) -> tuple[procs.ServiceProcess, Any]:
    # the URL, its password file and the TLS files by env: nothing secret on the argv
    return procs.start_service("store", "services.store",
                               ["--bind", "127.0.0.1:0", "--key-prefix", "tls:"], workdir,
                               env=env, timeout=30)


def test_the_store_keeps_rollouts_in_a_tls_redis(tls_redis: TlsRedis, tmp_path: Path) -> None:
    proc, info = _start_store(tmp_path, tls_redis.store_env())
    try:
        assert info["redis_url"].startswith(f"rediss://{redis_server.STORE_USER}:***@")
        store = StoreClient.connect(f"127.0.0.1:{info['grpc_port']}", timeout=10)
        rid = "tls-run/t/0"
        store.create_rollouts([c.Rollout(rollout_id=rid, run_id="tls-run", task_id="t",
                                         group_id="tls-run/t", group_size=1, max_attempts=1,
                                         task_json='{"x": 1}', stream="train")])
        store.start_attempt(rid, 1)
        got = store.get_rollout(rid)
        assert got.rollout_id == rid and got.task_json == '{"x": 1}'
        store.close()
        assert any(tls_redis.direct().scan_iter("tls:*"))  # it is in that Redis
        assert PASSWORD not in (tmp_path / "store.log").read_text()
    finally:
        proc.stop()


@pytest.mark.parametrize("case, why", [
    ("plaintext", "give it a rediss:// URL"),
    # another CA of the same name: not the key the certificate names as its issuer's
    ("wrong-ca", "certificate verify failed: self-signed certificate in certificate chain"),
    # the system's CAs do not know the deployment's
    ("no-ca", "certificate verify failed: self-signed certificate in certificate chain"),
    ("wrong-host", "IP address mismatch"),  # 127.0.0.1: not a name in the certificate
    ("no-client-cert", "CERTIFICATE_REQUIRED"),  # tls-auth-clients yes
    ("wrong-password", "invalid username-password pair"),
])
def test_the_store_refuses_a_redis_it_cannot_verify(tls_redis: TlsRedis, tmp_path: Path,
                                                    case: str, why: str) -> None:
    url = f"rediss://{redis_server.STORE_USER}@localhost:{tls_redis.port}/0"
    other = pki.Pki(tmp_path / "other")
    over = {
        "plaintext": {"HARNESSRL_STORE_REDIS_URL": url.replace("rediss://", "redis://"),
                      "HARNESSRL_STORE_REDIS_TLS_CA_FILE": "",
                      "HARNESSRL_STORE_REDIS_TLS_CERT_FILE": "",
                      "HARNESSRL_STORE_REDIS_TLS_KEY_FILE": ""},
        "wrong-ca": {"HARNESSRL_STORE_REDIS_TLS_CA_FILE":
                     str(other.folder("store") / "ca.crt")},
        "no-ca": {"HARNESSRL_STORE_REDIS_TLS_CA_FILE": ""},
        "wrong-host": {"HARNESSRL_STORE_REDIS_URL": url.replace("localhost", "127.0.0.1")},
        "no-client-cert": {"HARNESSRL_STORE_REDIS_TLS_CERT_FILE": "",
                           "HARNESSRL_STORE_REDIS_TLS_KEY_FILE": ""},
        "wrong-password": {"HARNESSRL_STORE_REDIS_PASSWORD_FILE": str(tmp_path / "wrong")},
    }[case]
    (tmp_path / "wrong").write_text("not-the-password\n")
    if case == "wrong-ca":
        other.ensure(("store",))
    with pytest.raises(RuntimeError, match="exited with 1") as err:
        proc, _ = _start_store(tmp_path, tls_redis.store_env(**over))
        proc.stop()
    assert why in str(err.value), str(err.value)
    assert PASSWORD not in str(err.value)


def _cfg(**kw: Any) -> StoreConfig:
    return StoreConfig.model_validate(kw)


def test_tls_settings_need_a_rediss_url(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    ok = _cfg(redis_url="rediss://u@h:1/0", redis_tls_ca_file=str(ca))
    assert ok.redis_tls_kwargs() == {"ssl_ca_certs": str(ca)}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"redis_url": "redis://h:1/0", "redis_tls_ca_file": str(ca)}, "need a rediss://"),
        ({"redis_url": f"redis://h:1/0?ssl_ca_certs={ca}"}, "need a rediss://"),
        ({"redis_url": f"rediss://h:1/0?ssl_ca_certs={ca}", "redis_tls_ca_file": str(ca)},
         "one place"),
        ({"redis_url": "rediss://h:1/0", "redis_tls_key_file": str(ca)}, "without"),
        ({"redis_url": "rediss://h:1/0", "redis_tls_ca_file": str(tmp_path / "no")},
         "no such file"),
        ({"redis_url": "rediss://h:1/0", "start_redis": True}, "plaintext"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _cfg(**kw)
