"""The engine's door: vLLM answers only callers that hold one of the deployment's engine keys.

vLLM's `--api-key` guards only its `/v1`, `/v2`, `/inference` and `/cohere` routes; the routes a
deployment needs closed most (`/update_weights`, `/collective_rpc`, `/sleep`, `/pause`, ...)
answer anyone who reaches the port. `RequireKey` is an ASGI middleware that vLLM loads itself:

    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware harnessrl.engine_guard.RequireKey      # + env HARNESSRL_ENGINE_KEYS_FILE

Every HTTP request and websocket then needs `Authorization: Bearer <key>` for a key of the file
$HARNESSRL_ENGINE_KEYS_FILE (one a line; blank lines and `#` comments ignored), except
`GET /health` and `GET /ping` (probes). Anything else gets 401 in OpenAI's error shape. The file
is looked at (one stat: 2-16 us here) at most once a second and read again when it changed, so
keys rotate without a restart (add the new key, move the clients to it, remove the old one) and
a removed key is refused within a second. A missing or empty file refuses everything. Keys are
compared as SHA-256 digests, with `hmac.compare_digest`, against every key.

Without the variable, or with a file that holds no key, the middleware refuses the server its
start (vLLM exits; `RequireKey` says how), unless HARNESSRL_INSECURE=1 and the server's `--host`
is a loopback address: then it lets everything through and says so loudly.

Clients (the gateway, the trainer) send the key that $HARNESSRL_ENGINE_API_KEY_FILE names (the
file's first key; read again when it changes) or $HARNESSRL_ENGINE_API_KEY: `ClientKey`. The judge
has a key of its own ($HARNESSRL_JUDGE_API_KEY[_FILE], harnessrl/graders/judge.py). A
deployment's keys: `python -m harnessrl.engine_guard keys DIR` (`EngineKeys`).

Standard library only: vLLM imports it in its API server process.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger("harnessrl.engine_guard")

KEYS_FILE_ENV = "HARNESSRL_ENGINE_KEYS_FILE"
API_KEY_ENV = "HARNESSRL_ENGINE_API_KEY"  # + "_FILE"
INSECURE_ENV = "HARNESSRL_INSECURE"
MIDDLEWARE = "harnessrl.engine_guard.RequireKey"
OPEN = frozenset({(b"GET", "/health"), (b"GET", "/ping")})  # method, path: what probes call
MIN_KEY_CHARS = 16
RECHECK_S = 1.0  # a changed keys file is obeyed within this many seconds

Scope = MutableMapping[str, Any]
ASGIApp = Callable[..., Awaitable[None]]


class GuardError(RuntimeError):
    """The engine has no keys to check (and insecure mode was not asked for)."""


def valid_key(key: str) -> bool:
    """At least 16 printable ASCII characters, no spaces (it goes into an HTTP header)."""
    return len(key) >= MIN_KEY_CHARS and key.isascii() and key.isprintable() and " " not in key


def read_keys(path: Path) -> list[str]:
    """The keys of a keys file: one a line, blank lines and `#` comments skipped; a line that
    cannot be a key (shorter than 16 characters, or not printable ASCII) is skipped, logged."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not valid_key(key):
            log.warning("%s line %d: not a key (at least %d printable ASCII characters, no "
                        "spaces): skipped", path, n, MIN_KEY_CHARS)
            continue
        out.append(key)
    return out


class _Watched:
    """A file's parsed content, parsed again when its inode, size or times changed; looked at
    (one stat) at most every `recheck_s` seconds (a stat costs 2-16 us on these machines)."""

    def __init__(self, path: Path, parse: Callable[[Path], Any], empty: Any,
                 recheck_s: float = RECHECK_S) -> None:
        self.path, self.parse, self.empty, self.recheck_s = path, parse, empty, recheck_s
        self.stamp: tuple[int, ...] | None = None
        self.value = empty
        self.checked = -float("inf")

    def _stat(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def get(self) -> Any:
        now = time.monotonic()
        if now - self.checked < self.recheck_s:
            return self.value
        self.checked = now
        stamp = self._stat()
        if stamp != self.stamp:
            try:
                self.value = self.parse(self.path) if stamp else self.empty
            except OSError as exc:
                log.warning("%s: cannot be read (%s)", self.path, exc)
                self.value = self.empty
            # a file rewritten while it was read is read again at the next request
            self.stamp = stamp if self._stat() == stamp else None
        return self.value


def _digests(path: Path) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(k.encode()).digest() for k in read_keys(path))


def _loopback_host(argv: list[str]) -> str | None:
    """The server's `--host` when it is a loopback address, else None (vLLM's default binds
    every interface)."""
    host = None
    for i, arg in enumerate(argv):
        if arg == "--host" and i + 1 < len(argv):
            host = argv[i + 1]
        elif arg.startswith("--host="):
            host = arg.split("=", 1)[1]
    if host == "localhost":
        return host
    try:
        return host if host and ipaddress.ip_address(host.strip("[]")).is_loopback else None
    except ValueError:
        return None


def _refusal(message: str) -> bytes:
    import json

    return json.dumps({"error": {"message": message, "type": "authentication_error",
                                 "param": None, "code": "invalid_api_key"}}).encode()


_NO_KEY = _refusal("this engine needs 'Authorization: Bearer <engine key>' "
                   "(docs/security.md)")
_BAD_KEY = _refusal("engine key not accepted")


def guard_keys(keys_file: str | os.PathLike[str] | None = None,
               environ: Mapping[str, str] | None = None, argv: list[str] | None = None,
               recheck_s: float = RECHECK_S) -> _Watched | None:
    """The keys a guard checks: `keys_file`, default $HARNESSRL_ENGINE_KEYS_FILE. None in
    insecure mode (HARNESSRL_INSECURE=1 with a loopback `--host` in `argv`, default sys.argv;
    logged). Raises GuardError when there are none."""
    env = os.environ if environ is None else environ
    path = str(keys_file or env.get(KEYS_FILE_ENV, ""))
    if not path:
        if env.get(INSECURE_ENV, "").lower() not in ("1", "true", "yes"):
            raise GuardError(f"engine guard: no keys: set {KEYS_FILE_ENV} to a file of "
                             "accepted keys, one a line (python -m harnessrl.engine_guard "
                             f"keys DIR makes one), or {INSECURE_ENV}=1 on a loopback --host")
        host = _loopback_host(sys.argv if argv is None else argv)
        if host is None:
            raise GuardError(f"engine guard: {INSECURE_ENV}=1 is refused unless the server "
                             f"binds a loopback --host (127.0.0.1): set {KEYS_FILE_ENV}")
        log.warning("INSECURE: engine on %s without keys (%s=1): every process on this "
                    "machine may push weights, pause, sleep and load adapters", host,
                    INSECURE_ENV)
        return None
    keys = _Watched(Path(path), _digests, (), recheck_s)
    if not keys.get():
        raise GuardError(f"engine guard: {path} ({KEYS_FILE_ENV}) "
                         f"{'holds no key' if Path(path).exists() else 'does not exist'}")
    log.warning("engine guard on: every route but GET /health and /ping needs a key of %s",
                path)
    return keys


class RequireKey:
    """ASGI middleware: see the module docstring; the arguments are `guard_keys`'.

    Without keys it refuses the server its start: Starlette builds its middleware on the first
    ASGI call, the lifespan startup, where uvicorn's default lifespan mode swallows an
    exception (the server would start and answer every request 500), so the guard answers that
    startup `lifespan.startup.failed` with the reason instead, and uvicorn exits (code 3).
    Served without a lifespan, it answers everything 503."""

    def __init__(self, app: ASGIApp, keys_file: str | os.PathLike[str] | None = None,
                 environ: Mapping[str, str] | None = None, argv: list[str] | None = None,
                 recheck_s: float = RECHECK_S) -> None:
        self.app = app
        self.refused = ""  # why it serves nothing
        try:
            self.keys = guard_keys(keys_file, environ, argv, recheck_s)
        except GuardError as exc:
            self.keys, self.refused = None, str(exc)
            log.critical("%s: the server must not start", exc)
        self.insecure = self.keys is None and not self.refused

    def accepts(self, authorization: bytes) -> bool:
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        digest = hashlib.sha256(token).digest()
        ok = False
        assert self.keys is not None
        for known in self.keys.get():  # every key, no early exit
            ok |= hmac.compare_digest(digest, known)
        return ok

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        kind = scope["type"]
        if self.refused:
            return await self._refuse_all(kind, receive, send)
        if self.insecure or kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        method = scope.get("method", "GET").encode()
        if kind == "http" and (method, scope["path"]) in OPEN:
            return await self.app(scope, receive, send)
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if authorization is not None and self.accepts(authorization):
            return await self.app(scope, receive, send)
        if kind == "websocket":  # closed before accept: the server answers 403
            return await send({"type": "websocket.close", "code": 1008})
        body = _NO_KEY if authorization is None else _BAD_KEY
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="harnessrl-engine"')]})
        await send({"type": "http.response.body", "body": body})


    async def _refuse_all(self, kind: str, receive: Callable[[], Awaitable[Any]],
                          send: Callable[[Any], Awaitable[None]]) -> None:
        if kind == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.failed", "message": self.refused})
                elif msg["type"] == "lifespan.shutdown":
                    return await send({"type": "lifespan.shutdown.complete"})
        if kind == "websocket":
            return await send({"type": "websocket.close", "code": 1011})
        body = _refusal("this engine has no keys configured: it serves nothing")
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class ClientKey:
    """The engine key a client sends: the first key of `path` (looked at again at most every
    `recheck_s`, so a rotated file is picked up), else `value`; "" sends none."""

    def __init__(self, value: str = "", path: str | os.PathLike[str] | None = None,
                 recheck_s: float = RECHECK_S) -> None:
        self.file: _Watched | None = None
        self._value, self._stale = value.strip(), False
        if self._value and not valid_key(self._value):
            raise GuardError(f"engine key: at least {MIN_KEY_CHARS} printable ASCII "
                             "characters, no spaces")
        if path:
            self.file = _Watched(Path(path), lambda p: (read_keys(p) or [""])[0], "", recheck_s)
            self._value = self.file.get()  # a missing or empty file fails here, not later
            if not self._value:
                raise GuardError(f"{path}: no engine key there")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, name: str = API_KEY_ENV
                 ) -> ClientKey:
        """`$<name>_FILE` (a file) or `$<name>` (the value)."""
        env = os.environ if environ is None else environ
        return cls(env.get(name, ""), env.get(name + "_FILE") or None)

    def value(self) -> str:
        if self.file is not None:
            new = self.file.get()
            if new:
                self._value, self._stale = new, False
            elif not self._stale:  # removed or emptied mid-rotation: the last key goes on
                self._stale = True
                log.warning("%s: no engine key in it now; still sending the previous one",
                            self.file.path)
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def headers(self) -> dict[str, str]:
        v = self.value()
        return {"Authorization": f"Bearer {v}"} if v else {}

    def __call__(self, request: Any) -> Any:
        """httpx's function auth (`httpx.Client(auth=key)`): adds the header."""
        v = self.value()
        if v:
            request.headers["Authorization"] = f"Bearer {v}"
        return request


@lru_cache(maxsize=1)
def process_key() -> ClientKey:
    """This process's engine key, from its environment (`ClientKey.from_env`)."""
    key = ClientKey.from_env()
    if not key:
        log.info("no engine key (%s_FILE or %s): engines are called without one",
                 API_KEY_ENV, API_KEY_ENV)
    return key


@dataclass(frozen=True)
class EngineKeys:
    """A deployment's engine keys in one folder (0700, files 0600): `keys` (what the engines
    accept: HARNESSRL_ENGINE_KEYS_FILE), `api.key` (what the gateway and the trainer send:
    HARNESSRL_ENGINE_API_KEY_FILE) and `judge.key` (the judge's own:
    HARNESSRL_JUDGE_API_KEY_FILE)."""

    folder: Path

    @property
    def keys_file(self) -> Path:
        return self.folder / "keys"

    @property
    def api_key_file(self) -> Path:
        return self.folder / "api.key"

    @property
    def judge_key_file(self) -> Path:
        return self.folder / "judge.key"

    @property
    def api_key(self) -> str:
        return read_keys(self.api_key_file)[0]

    @classmethod
    def ensure(cls, folder: str | os.PathLike[str], api_key: str = "") -> EngineKeys:
        """Makes the folder's keys, keeping those it holds; `api_key`: the clients' key to use
        (e.g. one that external engines already accept) instead of the folder's or a new one."""
        keys = cls(Path(folder))
        keys.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        keys.folder.chmod(0o700)

        def kept(path: Path) -> str:
            found = read_keys(path) if path.exists() else []
            return found[0] if found else ""

        api = api_key.strip() or kept(keys.api_key_file) or secrets.token_urlsafe(32)
        judge = kept(keys.judge_key_file) or secrets.token_urlsafe(32)
        if not valid_key(api):
            raise GuardError(f"engine key: at least {MIN_KEY_CHARS} printable ASCII "
                             "characters, no spaces")
        for path, text in ((keys.api_key_file, api + "\n"), (keys.judge_key_file, judge + "\n"),
                           (keys.keys_file, f"# accepted engine keys: clients', judge's\n"
                                            f"{api}\n{judge}\n")):
            _write_private(path, text)
        return keys


def _write_private(path: Path, text: str) -> None:
    """Writes `text` to `path` (0600) unless it holds it already; atomically."""
    if path.exists() and path.read_text() == text:
        path.chmod(0o600)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m harnessrl.engine_guard",
                                 description="Makes a deployment's engine keys.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("keys", help="DIR/keys (engines), DIR/api.key (gateway, trainer), "
                                     "DIR/judge.key; existing keys are kept")
    mk.add_argument("dir", type=Path)
    a = ap.parse_args(argv)
    keys = EngineKeys.ensure(a.dir)
    print(f"{KEYS_FILE_ENV}={keys.keys_file}\n{API_KEY_ENV}_FILE={keys.api_key_file}\n"
          f"HARNESSRL_JUDGE_API_KEY_FILE={keys.judge_key_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
