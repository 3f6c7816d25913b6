"""The Redis of a stack of its own (`harnessrl up` when no --redis-url is given): a
redis-server bound to 127.0.0.1 on a free port, AOF on, that answers only the store.

Redis belongs to the store alone (the design's trust boundaries): an open Redis on this
machine would let any local process, a rollout's included, rewrite rewards and runs. Only one
ACL user gets in, `harnessrl-store`, with a password the store alone is given (by env var);
the default user is off, so a client without that user and password gets NOAUTH or WRONGPASS.
The user may run every command but Redis's @admin and @dangerous ones (STORE_ACL says why).
The password is generated once and kept in `<data_dir>/password` (0600); the port and password
are in `<data_dir>/redis.conf` (0600), which the server reads, so neither is on a command line.
Both are reused by the next start in the same state directory (`up --resume`: the AOF data
and the password stay together) and by the supervisor's restart (the same argv, the same
file: same port, same password).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
from pathlib import Path

from harnessrl import procs

log = logging.getLogger("harnessrl.redis")

PASSWORD_FILE = "password"
STORE_USER = "harnessrl-store"
# Every key (`~*`: the store is this server's only client and owns all of it; a key pattern of
# its prefix would guard nothing more) and every command but @admin and @dangerous: the store
# runs none of those (services/store: strings, hashes, lists, sets, a sorted set, streams,
# SCAN, MULTI/WATCH and EVALSHA scripts, whose calls Redis checks against the same rules), and
# they are what turns a leaked password into more than the data: CONFIG SET dir/dbfilename
# (writing files as the Redis user), MODULE LOAD, DEBUG, REPLICAOF, MIGRATE, SHUTDOWN, ACL,
# MONITOR, FLUSHALL, KEYS. No pub/sub channel (the store subscribes to none).
STORE_ACL = "~* resetchannels +@all -@admin -@dangerous"


def password(data_dir: Path) -> str:
    """The stack's Redis password: `<data_dir>/password`, created (0600) on first use."""
    path = data_dir / PASSWORD_FILE
    if not path.exists():
        procs.write_private(path, secrets.token_hex(32) + "\n")
    os.chmod(path, 0o600)
    return path.read_text().strip()


def _saved_port(data_dir: Path) -> int | None:
    try:
        m = re.search(r"^port (\d+)$", (data_dir / "redis.conf").read_text(), re.MULTILINE)
    except FileNotFoundError:
        return None
    return int(m.group(1)) if m else None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis-server binds: the
        try:  # connections it closed, in TIME_WAIT, do not keep it from the port
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_private(data_dir: Path) -> tuple[str, procs.ServiceProcess | None]:
    """The stack's own Redis in `data_dir`: its URL (password included: keep it out of logs and
    world-readable files; `harnessrl.config.mask_passwords`) and its process. The port of the
    last start when it is free; a server of this data dir that still answers there with this
    password (left by a stack that was killed) is used as it is (no process returned)."""
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)  # the AOF holds every run, rollout and recorded call
    pw = password(data_dir)
    port = _saved_port(data_dir)
    if port is not None:
        url = procs.redis_url(port, pw, STORE_USER)
        if procs.redis_alive(url):
            log.warning("the Redis of %s still answers on port %d: using it", data_dir, port)
            return url, None
        if not _port_free(port):
            port = None
    return procs.start_redis(data_dir, port, password=pw, username=STORE_USER, acl=STORE_ACL)
