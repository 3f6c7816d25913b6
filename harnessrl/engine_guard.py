"""The engine's door: vLLM answers only callers that hold one of the deployment's engine keys.

vLLM's `--api-key` guards only its `/v1`, `/v2`, `/inference` and `/cohere` routes; the routes a
deployment needs closed most (`/update_weights`, `/collective_rpc`, `/sleep`, `/pause`, ...)
answer anyone who reaches the port. `RequireKey` is an ASGI middleware that vLLM loads itself:

    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware harnessrl.engine_guard.RequireKey      # + env HARNESSRL_ENGINE_KEYS_FILE

Every HTTP request and websocket then needs `Authorization: Bearer <key>` for a key of the file
$HARNESSRL_ENGINE_KEYS_FILE (one a line; blank lines and `#` comments ignored), except
`GET /health` and `GET /ping` (probes). Anything else gets 401 in OpenAI's error shape. The file
is looked at on every request (one stat) and read again when it changed, so keys rotate without
a restart: add the new key, move the clients to it, remove the old one. A missing or empty file
refuses everything. Keys are compared as SHA-256 digests, with `hmac.compare_digest`, against
every key.

The middleware refuses to be built (vLLM does not start) without the variable or with a file
that holds no key, unless HARNESSRL_INSECURE=1 and the server's `--host` is a loopback address:
then it lets everything through and says so loudly.

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

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


class GuardError(RuntimeError):
    """The engine has no keys to check (and insecure mode was not asked for)."""


def read_keys(path: Path) -> list[str]:
    """The keys of a keys file: one a line, blank lines and `#` comments skipped; a line that
    cannot be a key (shorter than 16 characters, or not printable ASCII) is skipped, logged."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if len(key) < MIN_KEY_CHARS or not (key.isascii() and key.isprintable()) or " " in key:
            log.warning("%s line %d: not a key (at least %d printable ASCII characters, no "
                        "spaces): skipped", path, n, MIN_KEY_CHARS)
            continue
        out.append(key)
    return out


class _Watched:
    """A file's parsed content, parsed again when its inode, size or times change."""

    def __init__(self, path: Path, parse: Callable[[Path], Any], empty: Any) -> None:
        self.path, self.parse, self.empty = path, parse, empty
        self.stamp: tuple[int, ...] | None = None
        self.value = empty

    def _stat(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def get(self) -> Any:
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


class RequireKey:
    """ASGI middleware: see the module docstring. `keys_file` defaults to
    $HARNESSRL_ENGINE_KEYS_FILE; `argv` (for insecure mode's loopback check) to sys.argv."""

    def __init__(self, app: ASGIApp, keys_file: str | os.PathLike[str] | None = None,
                 environ: Mapping[str, str] | None = None, argv: list[str] | None = None
                 ) -> None:
        self.app = app
        env = os.environ if environ is None else environ
        path = str(keys_file or env.get(KEYS_FILE_ENV, ""))
        self.insecure = False
        if not path:
            if env.get(INSECURE_ENV, "").lower() not in ("1", "true", "yes"):
                raise GuardError(f"engine guard: no keys: set {KEYS_FILE_ENV} to a file of "
                                 "accepted keys, one a line (python -m harnessrl.engine_guard "
                                 f"keys DIR makes one), or {INSECURE_ENV}=1 on a loopback "
                                 "--host")
            host = _loopback_host(sys.argv if argv is None else argv)
            if host is None:
                raise GuardError(f"engine guard: {INSECURE_ENV}=1 is refused unless the server "
                                 "binds a loopback --host (127.0.0.1): set "
                                 f"{KEYS_FILE_ENV}")
            self.insecure = True
            log.warning("INSECURE: engine on %s without keys (%s=1): every process on this "
                        "machine may push weights, pause, sleep and load adapters", host,
                        INSECURE_ENV)
            return
        self.keys = _Watched(Path(path), _digests, ())
        if not self.keys.get():
            raise GuardError(f"engine guard: {path} ({KEYS_FILE_ENV}) "
                             f"{'holds no key' if Path(path).exists() else 'does not exist'}")
        log.warning("engine guard on: every route but GET /health and /ping needs a key of %s",
                    path)

    def accepts(self, authorization: bytes) -> bool:
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        digest = hashlib.sha256(token).digest()
        ok = False
        for known in self.keys.get():  # every key, no early exit
            ok |= hmac.compare_digest(digest, known)
        return ok

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        kind = scope["type"]
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


class ClientKey:
    """The engine key a client sends: the first key of `path` (looked at again at most every
    `recheck_s`, so a rotated file is picked up), else `value`; "" sends none."""

    def __init__(self, value: str = "", path: str | os.PathLike[str] | None = None,
                 recheck_s: float = 1.0) -> None:
        self.file: _Watched | None = None
        self._value = value.strip()
        if path:
            self.file = _Watched(Path(path), lambda p: (read_keys(p) or [""])[0], "")
            self._value = self.file.get()  # a missing or empty file fails here, not later
            if not self._value:
                raise GuardError(f"{path}: no engine key there")
        self.recheck_s, self._checked = recheck_s, time.monotonic()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, name: str = API_KEY_ENV
                 ) -> ClientKey:
        """`$<name>_FILE` (a file) or `$<name>` (the value)."""
        env = os.environ if environ is None else environ
        return cls(env.get(name, ""), env.get(name + "_FILE") or None)

    def value(self) -> str:
        if self.file is not None and time.monotonic() - self._checked >= self.recheck_s:
            self._checked = time.monotonic()
            new = self.file.get()
            if new:
                self._value = new
            else:  # removed or emptied mid-rotation: keep sending the last key
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
        if len(api) < MIN_KEY_CHARS:
            raise GuardError(f"engine key: at least {MIN_KEY_CHARS} characters")
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
