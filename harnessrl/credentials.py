"""Per-rollout credentials: the API key a harness gets is a signed, expiring token bound to one
rollout and attempt.

Format: `hrl1.<payload>.<signature>`, payload = base64url(JSON {r: rollout_id, a: attempt,
e: expiry unix seconds, n: random nonce}), signature = base64url(HMAC-SHA256(secret,
"hrl1." + payload)). The controller mints them, the gateway verifies them; both read the same
secret (`HARNESSRL_SECRET`, or a 0600 file created on first use).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from harnessrl.errors import Unauthenticated

PREFIX = "hrl1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class RolloutCredential:
    rollout_id: str
    attempt: int
    expires_at: float


class CredentialSigner:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the credential secret must be at least 16 bytes")
        self._secret = secret

    def _sign(self, payload: str) -> str:
        mac = hmac.new(self._secret, f"{PREFIX}.{payload}".encode(), hashlib.sha256)
        return _b64(mac.digest())

    def tag(self, data: str) -> str:
        """A MAC of `data` for a message between gateway replicas (a forwarded call's mark),
        never valid as a credential (another domain of the same secret)."""
        mac = hmac.new(self._secret, f"replica.{data}".encode(), hashlib.sha256)
        return _b64(mac.digest()[:16])

    def mint(self, rollout_id: str, attempt: int, ttl_s: float) -> str:
        body = {"r": rollout_id, "a": attempt, "e": round(time.time() + ttl_s, 3),
                "n": secrets.token_hex(8)}
        payload = _b64(json.dumps(body, separators=(",", ":")).encode())
        return f"{PREFIX}.{payload}.{self._sign(payload)}"

    def verify(self, token: str, now: float | None = None) -> RolloutCredential:
        """The credential a token carries; `Unauthenticated` says why when it is not valid."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != PREFIX or not token.isascii():
            raise Unauthenticated("malformed API key: not a harnessrl rollout credential")
        payload, sig = parts[1], parts[2]
        if not hmac.compare_digest(self._sign(payload), sig):
            raise Unauthenticated("invalid API key: bad signature")
        try:
            body = json.loads(_unb64(payload))
            cred = RolloutCredential(str(body["r"]), int(body["a"]), float(body["e"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise Unauthenticated("malformed API key payload") from exc
        if (now if now is not None else time.time()) >= cred.expires_at:
            raise Unauthenticated("API key expired")
        return cred


def load_secret(secret: str | None, secret_file: str | os.PathLike[str]) -> bytes:
    """The shared secret: `secret` when given, else the file's content (created, 0600, with 32
    random bytes when missing)."""
    if secret:
        return secret.encode()
    path = Path(secret_file)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:  # first writer wins; a concurrent starter reads the winner's secret
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip().encode()
