"""The Redis of `harnessrl up` (issues #39, #40): with no Redis URL given the stack starts its
own, bound to 127.0.0.1 on a free port, AOF on, that lets in only the store's ACL user
`harnessrl-store`, whose password is kept in `<state>/redis/password` (0600): no password, the
default user or a wrong password are refused, and the store's user may not run Redis's admin
commands. The password is on no command line, in no log and not in stack.json; a restart (the
supervisor's, or the next `up` in the same state dir) keeps the port, the password and the
data, transactions included. A URL the user gives is used as it is, credentials included."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest
import redis

from harnessrl import procs, redis_server
from conftest import wait_aof_written
from harnessrl.clients import StoreClient
from harnessrl.identity import Identity
from harnessrl.local.stack import Stack, StackConfig
from harnessrl.v1 import common_pb2 as c


def _cfg(state: Path, redis_url: str | None = None) -> StackConfig:
    return StackConfig(state_dir=state, redis_url=redis_url, key_prefix="tsr:",
                       model_dir=None, weight_transfer_backend=None)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _as_controller(stack: Stack) -> Identity:
    """The stack's own controller identity (its PKI is not the test session's)."""
    return Identity.from_folder(stack.tls / "controller")


def _store_round_trip(stack: Stack, run_id: str) -> None:
    store = StoreClient.connect(stack.store_address, timeout=10, ident=_as_controller(stack))
    try:
        store.put_run(c.Run(run_id=run_id, status=c.RUN_STATUS_RUNNING))
        assert store.get_run(run_id).run_id == run_id
    finally:
        store.close()


def test_the_stacks_own_redis_answers_only_with_its_password(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with Stack(_cfg(state)) as stack:
        assert "redis" in stack.procs, "no URL given: the stack starts a Redis of its own"
        pw_file = state / "redis" / "password"
        password = pw_file.read_text().strip()
        assert len(password) >= 32
        assert _mode(pw_file) == 0o600 and _mode(state / "redis" / "redis.conf") == 0o600
        assert _mode(state / "redis") == 0o700
        kwargs = redis.Redis.from_url(stack.redis_url).connection_pool.connection_kwargs
        port = kwargs["port"]
        assert port != 6379 and kwargs["username"] == redis_server.STORE_USER
        _assert_only_the_stores_user_gets_in(port, password)
        r = redis.Redis(host="127.0.0.1", port=port, username=redis_server.STORE_USER,
                        password=password)
        conf = (state / "redis" / "redis.conf").read_text()  # CONFIG GET is refused (admin)
        assert "appendonly yes" in conf and "bind 127.0.0.1" in conf.splitlines()

        _store_round_trip(stack, "kept")  # the store reaches it (the URL came by env var)
        assert any(r.scan_iter("tsr:*"))
        # Redis replays its AOF as the default user: a transaction must survive the restart
        # below although that user is off (procs.start_redis gives it rights for the replay)
        r.pipeline(transaction=True).set("tsr:tx:a", "1").hset("tsr:tx:b", "f", "2").execute()

        # the password is on no command line, in no log or ready file, not in stack.json
        for name in ("redis", "store"):
            proc = stack.procs[name].proc
            assert proc is not None and password not in _cmdline(proc.pid)
        for f in stack.logs.iterdir():
            assert password not in f.read_text(errors="replace"), f
        assert password not in (state / "redis" / "redis.log").read_text()
        st = stack.addresses()
        assert password not in json.dumps(st)
        assert st["redis_password_file"] == str(pw_file)
        assert "***" in str(st["redis_url"])

        # the supervisor's restart comes back on the same port with the same password
        seen: list[str] = []
        stack.supervise(on_event=lambda ev: seen.append(f"{ev.service} {ev.kind}"))
        old = stack.procs["redis"]
        wait_aof_written(state / "redis", "tsr:tx:b")
        old.kill()
        deadline = time.monotonic() + 60
        while "redis restarted" not in seen:
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)
        assert stack.procs["redis"] is not old and procs.redis_alive(stack.redis_url)
        r = redis.Redis.from_url(stack.redis_url)
        assert r.get("tsr:tx:a") == b"1" and r.hget("tsr:tx:b", "f") == b"2", \
            "a MULTI/EXEC written before the kill -9 is lost from the AOF"
        url = stack.redis_url
    # the next `up` in this state dir: same password and data (AOF); the same port when free
    with Stack(_cfg(state)) as again:
        assert pw_file.read_text().strip() == password
        assert again.redis_url == url
        store = StoreClient.connect(again.store_address, timeout=10, ident=_as_controller(again))
        deadline = time.monotonic() + 20
        while True:  # the store reconnects to Redis on its own
            try:
                assert store.get_run("kept").run_id == "kept"
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        store.close()


def _assert_only_the_stores_user_gets_in(port: int, password: str) -> None:
    """No password, a guessed one, the default user (even with the store's password) and a
    wrong user are refused; the store's user gets in but may not run admin commands."""
    def client(**kw: str) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, **kw)

    for kw in ({}, {"password": "guess"}, {"password": password},
               {"username": "default", "password": password},
               {"username": redis_server.STORE_USER, "password": "guess"},
               {"username": "admin", "password": password}):
        with pytest.raises(redis.AuthenticationError):  # NOAUTH or WRONGPASS
            client(**kw).ping()
    store = client(username=redis_server.STORE_USER, password=password)
    assert store.ping() and store.acl_whoami() == redis_server.STORE_USER
    for refused in (lambda: store.config_set("dir", "/tmp"), lambda: store.config_get("*"),
                    store.flushall, lambda: store.keys("*"), lambda: store.acl_list(),
                    lambda: store.execute_command("MODULE", "LIST"),
                    lambda: store.eval("return redis.call('CONFIG', 'GET', 'dir')", 0)):
        with pytest.raises(redis.ResponseError, match="NOPERM|no permission|not allowed"):
            refused()


def test_a_user_url_with_a_password_is_used_as_given(tmp_path: Path) -> None:
    url, theirs = procs.start_redis(tmp_path / "theirs", password="their pw/1", username="alice")
    try:
        assert "alice:their%20pw%2F1@" in url
        assert not procs.redis_alive(url.replace("their%20pw%2F1", "other"))
        with Stack(_cfg(tmp_path / "state", url)) as stack:
            assert "redis" not in stack.procs and stack.redis_url == url
            assert not (tmp_path / "state" / "redis" / "password").exists()
            assert stack.addresses()["redis_password_file"] == ""
            assert "their" not in json.dumps(stack.addresses())
            _store_round_trip(stack, "theirs")
            store_pid = stack.procs["store"].proc.pid  # type: ignore[union-attr]
            assert "their" not in _cmdline(store_pid)
            assert "their%20pw" not in (stack.logs / "store.log").read_text()
        assert any(redis.Redis.from_url(url).scan_iter("tsr:*"))
        # a wrong password is refused with a clear error, not a failed start on its port
        with pytest.raises(RuntimeError, match="refuses"):
            procs.ensure_redis(url.replace("their%20pw%2F1", "wrong"), tmp_path / "x")
    finally:
        theirs.stop()


@pytest.mark.parametrize("auth", [":pw1", "bob:pw2"])
def test_a_user_url_on_loopback_where_none_answers_starts_one_with_its_password(
        tmp_path: Path, auth: str) -> None:
    port = procs.free_port()
    url = f"redis://{auth}@127.0.0.1:{port}/3"
    with Stack(_cfg(tmp_path / "state", url)) as stack:
        assert "redis" in stack.procs and stack.redis_url == url  # as given: db 3 included
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping()
        _store_round_trip(stack, "started")
        assert any(redis.Redis.from_url(url).scan_iter("tsr:*"))
        assert not any(redis.Redis.from_url(url.replace("/3", "/0")).scan_iter("tsr:*"))


def test_no_redis_is_started_for_a_url_off_this_machine(tmp_path: Path) -> None:
    try:
        _, proc = procs.ensure_redis("redis://:secret@192.0.2.1:6390/0", tmp_path)
    except RuntimeError as exc:
        assert "only a Redis on this machine" in str(exc) and "secret" not in str(exc)
    else:
        if proc is not None:
            proc.stop()
        pytest.fail("a Redis was started for a URL off this machine")


def test_the_password_file_is_made_once_and_kept_private(tmp_path: Path) -> None:
    first = redis_server.password(tmp_path)
    (tmp_path / "password").chmod(0o644)
    assert redis_server.password(tmp_path) == first
    assert _mode(tmp_path / "password") == 0o600
