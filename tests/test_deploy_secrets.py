"""harnessrl/deploy_secrets.py, what docker-compose.yml's one-shot `pki` runs: the files, their
modes, a second run keeping the secrets, and a real redis-server enforcing the ACL file it
writes (the store's user and password, nothing without them, no admin commands)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from harnessrl import deploy_secrets as ds
from harnessrl.engine_guard import read_keys
from harnessrl.procs import free_port


def run(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "harnessrl.deploy_secrets", *args], check=True,
                   capture_output=True, timeout=60)


def mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


def test_engine_keys_one_per_client_kept_on_a_second_run(tmp_path: Path) -> None:
    keys, gw, tr = tmp_path / "e" / "keys", tmp_path / "g" / "key", tmp_path / "t" / "key"
    argv = ("engine-keys", "--keys", str(keys), "--client", f"gateway={gw}",
            "--client", f"trainer={tr}")
    run(*argv)
    first = {p: p.read_text() for p in (keys, gw, tr)}
    assert all(mode(p) == 0o600 for p in first)
    assert read_keys(keys) == [gw.read_text().strip(), tr.read_text().strip()]
    assert gw.read_text() != tr.read_text()
    run(*argv)
    assert {p: p.read_text() for p in (keys, gw, tr)} == first  # nothing changed
    gw.unlink()  # rotation of one client's key: the list follows, the other key stays
    run(*argv)
    assert tr.read_text() == first[tr] and gw.read_text() != first[gw]
    assert read_keys(keys) == [gw.read_text().strip(), tr.read_text().strip()]


def test_a_bad_client_spec_is_refused(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "harnessrl.deploy_secrets", "engine-keys",
                          "--keys", str(tmp_path / "k"), "--client", "gateway"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "NAME=FILE" in out.stderr


@pytest.fixture
def acl_redis(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A redis-server reading the ACL file `redis` wrote; yields (port, password, files)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    password, acl = tmp_path / "pw" / "password", tmp_path / "acl" / "users.acl"
    run("redis", "--password", str(password), "--acl", str(acl))
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--aclfile",
                             str(acl), "--save", "", "--appendonly", "no", "--dir",
                             str(tmp_path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(["redis-cli", "-p", str(port), "ping"],
                             capture_output=True).returncode != 0:
            assert time.monotonic() < deadline and proc.poll() is None, "redis did not start"
            time.sleep(0.1)
        yield port, password.read_text().strip(), (password, acl)
    finally:
        proc.terminate()
        proc.wait(10)


def test_redis_acl_admits_the_store_alone(acl_redis) -> None:  # type: ignore[no-untyped-def]
    port, password, (pw_file, acl) = acl_redis
    assert mode(pw_file) == 0o600 and mode(acl) == 0o644
    assert password not in acl.read_text()  # Redis's file holds the hash, not the password
    store = redis.Redis(port=port, username=ds.STORE_REDIS_USER, password=password)
    assert store.set("k", "v") and store.get("k") == b"v"
    with store.pipeline(transaction=True) as p:  # the store's MULTI/EXEC
        p.incr("n")
        p.incr("n")
        assert p.execute() == [1, 2]
    with pytest.raises(redis.exceptions.NoPermissionError):
        store.config_get("dir")  # @admin: no CONFIG SET dir / dbfilename from the store
    with pytest.raises(redis.exceptions.NoPermissionError):
        store.flushall()  # @dangerous
    store.close()
    for kw in ({}, {"username": ds.STORE_REDIS_USER, "password": "wrong"},
               {"password": password}):  # no user: the default user, which is off
        r = redis.Redis(port=port, **kw)  # type: ignore[arg-type]
        with pytest.raises(redis.exceptions.AuthenticationError):
            r.get("k")
        r.close()
    # the healthcheck's probe: NOAUTH, exit 0
    out = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "NOAUTH" in out.stdout


def test_a_second_run_keeps_the_password(tmp_path: Path) -> None:
    password, acl = tmp_path / "password", tmp_path / "users.acl"
    run("redis", "--password", str(password), "--acl", str(acl))
    first = password.read_text(), acl.read_text()
    acl.unlink()
    run("redis", "--password", str(password), "--acl", str(acl))
    assert (password.read_text(), acl.read_text()) == first
