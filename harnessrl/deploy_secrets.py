"""A deployment's secrets besides its certificates (harnessrl/pki.py): Redis's password with
the ACL file that enforces it, and the engine's API keys. docker-compose.yml's one-shot `pki`
service runs it, writing each secret into the volume of the one service that holds it;
scripts/k8s-secrets.sh makes the Kubernetes Secrets' Redis files with it.

    python -m harnessrl.deploy_secrets redis --password FILE --acl FILE [--user NAME]
    python -m harnessrl.deploy_secrets engine-keys --keys FILE --client NAME=FILE ...

`redis`: the password (FILE, 0600; the store's, which puts it in its Redis URL) and a Redis
ACL file (0644: it holds the password's SHA-256 only, not the password) in which the user NAME
(default `harnessrl-store`) may run every command but @admin and @dangerous ones (no CONFIG,
no FLUSHALL, no ACL), and the default user is off: a client without the password gets NOAUTH
for every command (`redis-cli ping` still gets that answer: the container's healthcheck).
Redis reads it with `--aclfile FILE`.

`engine-keys`: one random key per client (each FILE 0600, the key alone: what a client names
in HARNESSRL_ENGINE_API_KEY_FILE) and the engine's list of accepted keys (--keys, one a line,
0600: HARNESSRL_ENGINE_KEYS_FILE of harnessrl/engine_guard.py).

Idempotent: a password or key whose file exists is kept (a second `docker compose up` changes
nothing); the files derived from them (the ACL file, the accepted keys) are rewritten from
them, so they always agree. Delete a client's key file and run it again to rotate that key.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import sys
from pathlib import Path

STORE_REDIS_USER = "harnessrl-store"


def _write(path: Path, text: str, mode: int) -> None:
    """Writes `text` to `path` atomically with `mode` (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)  # whatever the umask
    tmp.replace(path)


def kept_or_new(path: Path, make: str) -> str:
    """The secret in `path` if it holds one, else `make` written there (0600)."""
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    _write(path, make + "\n", 0o600)
    return make


def redis_acl(user: str, password: str) -> str:
    """A Redis ACL file: `user` with the password's SHA-256, everything but admin and
    dangerous commands; the default user off (a client without the password gets NOAUTH) but
    with every right: Redis before 8.4 replays its AOF as the default user and re-checks each
    replayed EXEC against its rights, so a restricted one silently drops every transaction of
    the store at a restart (redis/redis#14541; harnessrl/procs.py's stack Redis does the same;
    tests/test_k8s_auth.py restarts one)."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return (f"user default off resetpass ~* &* +@all\n"
            f"user {user} on #{digest} ~* &* +@all -@admin -@dangerous\n")


def make_redis(password_file: Path, acl_file: Path, user: str = STORE_REDIS_USER) -> None:
    password = kept_or_new(password_file, secrets.token_hex(32))
    _write(acl_file, redis_acl(user, password), 0o644)


def make_engine_keys(keys_file: Path, clients: dict[str, Path]) -> None:
    keys = [kept_or_new(path, secrets.token_urlsafe(32)) for path in clients.values()]
    _write(keys_file, "".join(k + "\n" for k in keys), 0o600)


def _client(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{spec!r}: give NAME=FILE")
    return name, Path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harnessrl.deploy_secrets", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("redis", help="Redis's password (the store's) and its ACL file (Redis's)")
    r.add_argument("--password", type=Path, required=True)
    r.add_argument("--acl", type=Path, required=True)
    r.add_argument("--user", default=STORE_REDIS_USER)
    e = sub.add_parser("engine-keys", help="one key per engine client, and the engine's list")
    e.add_argument("--keys", type=Path, required=True)
    e.add_argument("--client", type=_client, action="append", required=True,
                   metavar="NAME=FILE")
    a = ap.parse_args(argv)
    if a.cmd == "redis":
        make_redis(a.password, a.acl, a.user)
        print(f"deploy_secrets: redis user {a.user}: {a.password}, {a.acl}", file=sys.stderr)
    else:
        clients = dict(a.client)
        make_engine_keys(a.keys, clients)
        print(f"deploy_secrets: engine keys of {', '.join(clients)}: {a.keys}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
