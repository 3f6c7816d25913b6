"""Who this process is to the other harnessrl services: its mTLS identity.

Every gRPC channel and server takes its credentials from here (harnessrl/rpc.py). A process
finds its identity, in this order:

1. `HARNESSRL_TLS_DIR`: a folder holding `ca.crt`, `tls.crt`, `tls.key` (harnessrl/pki.py
   makes them; a Kubernetes TLS Secret mounted as a volume has the same layout). Services,
   Compose and Kubernetes use this; a server re-reads the files when they change (rotation).
2. `HARNESSRL_TLS_PEM`: the same three files as JSON `{"ca", "cert", "key"}` (PEM text), with
   `HARNESSRL_SCOPE_TOKEN`: how the controller hands a grader its credentials (the `grader`
   identity, allowed nothing unless a scope token signed by the controller names what it may
   read; harnessrl/authz.py).
3. The operator identity of a local stack: `.harnessrl/tls/operator` under the current folder
   (the CLI's default `--state-dir`), so `harnessrl status` and the Python clients work in a
   folder where `harnessrl up` runs.
4. `HARNESSRL_INSECURE=1`: no TLS and no identity, asked for explicitly, for loopback
   addresses only (refused elsewhere) and logged loudly.

Otherwise a channel or server refuses to start, saying how to get an identity.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

from harnessrl.pki import server_name

log = logging.getLogger(__name__)

TLS_DIR_ENV = "HARNESSRL_TLS_DIR"
TLS_PEM_ENV = "HARNESSRL_TLS_PEM"
SCOPE_TOKEN_ENV = "HARNESSRL_SCOPE_TOKEN"
INSECURE_ENV = "HARNESSRL_INSECURE"
# What a child process must not inherit from its parent's environment: a rollout or grader
# gets only the credentials its launcher hands it on purpose.
IDENTITY_ENV = (TLS_DIR_ENV, TLS_PEM_ENV, SCOPE_TOKEN_ENV, INSECURE_ENV)
LOCAL_STACK_OPERATOR = Path(".harnessrl") / "tls" / "operator"
SCOPE_METADATA = "x-harnessrl-scope"


class NoIdentity(RuntimeError):
    """Neither an identity nor an explicit insecure mode was given."""


def common_name(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


@dataclass(frozen=True)
class Identity:
    """PEM credentials of one identity; `folder` when read from files (servers watch it)."""

    ca: bytes
    cert: bytes
    key: bytes
    folder: Path | None = None
    scope_token: str = ""
    name: str = field(default="", compare=False)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str], scope_token: str = "") -> Identity:
        f = Path(folder)
        try:
            ca, cert, key = ((f / n).read_bytes() for n in ("ca.crt", "tls.crt", "tls.key"))
        except OSError as exc:
            raise NoIdentity(f"identity folder {f}: {exc.strerror}: {exc.filename} (it needs "
                             "ca.crt, tls.crt and tls.key: python -m harnessrl.pki create)"
                             ) from exc
        return cls(ca, cert, key, f, scope_token, common_name(cert))

    @classmethod
    def from_pem_json(cls, text: str, scope_token: str = "") -> Identity:
        try:
            d = json.loads(text)
            ca, cert, key = (d[k].encode() for k in ("ca", "cert", "key"))
        except (ValueError, KeyError, AttributeError) as exc:
            raise NoIdentity(f"${TLS_PEM_ENV} is not JSON with ca, cert and key: {exc}"
                             ) from exc
        return cls(ca, cert, key, None, scope_token, common_name(cert))

    def pem_json(self) -> str:
        return json.dumps({"ca": self.ca.decode(), "cert": self.cert.decode(),
                           "key": self.key.decode()})

    def child_env(self, scope_token: str = "") -> dict[str, str]:
        """The environment that gives a child process this identity (and a scope token)."""
        env = {TLS_PEM_ENV: self.pem_json()}
        if scope_token:
            env[SCOPE_TOKEN_ENV] = scope_token
        return env

    def channel_credentials(self) -> grpc.ChannelCredentials:
        creds = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        if self.scope_token:
            token = self.scope_token

            def scope(_context: object, callback: object) -> None:
                callback(((SCOPE_METADATA, token),), None)  # type: ignore[operator]
            creds = grpc.composite_channel_credentials(
                creds, grpc.metadata_call_credentials(scope, name="harnessrl-scope"))
        return creds


def resolve(env: dict[str, str] | None = None) -> Identity | None:
    """This process's identity, or None in explicit insecure mode (see the module docstring);
    raises NoIdentity when there is neither."""
    e = os.environ if env is None else env
    token = e.get(SCOPE_TOKEN_ENV, "")
    if e.get(TLS_DIR_ENV):
        return Identity.from_folder(e[TLS_DIR_ENV], token)
    if e.get(TLS_PEM_ENV):
        return Identity.from_pem_json(e[TLS_PEM_ENV], token)
    if (LOCAL_STACK_OPERATOR / "tls.crt").exists():
        return Identity.from_folder(LOCAL_STACK_OPERATOR.resolve(), token)
    if e.get(INSECURE_ENV, "").lower() in ("1", "true", "yes"):
        return None
    raise NoIdentity(
        "no identity for gRPC: set HARNESSRL_TLS_DIR to a folder with ca.crt, tls.crt and "
        "tls.key (a local stack's operator identity is <state>/tls/operator), or "
        "HARNESSRL_INSECURE=1 for plaintext on loopback (docs/security.md)")


def is_loopback(address: str) -> bool:
    """Whether host:port (or a bind address) names this machine's loopback interface only."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback
                       for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def insecure_address(address: str, what: str) -> None:
    """Allows plaintext to or on `address` only on loopback, loudly."""
    if not is_loopback(address):
        raise NoIdentity(f"{what} {address}: insecure mode ({INSECURE_ENV}=1) is refused off "
                         "loopback; give this process an identity (HARNESSRL_TLS_DIR)")
    log.warning("INSECURE: %s %s without TLS or identities (%s=1): any process on this "
                "machine may call any RPC", what, address, INSECURE_ENV)


def target_options(peer: str) -> list[tuple[str, str]]:
    """Channel options that make TLS verify the server as the identity `peer` (a service name:
    store, controller, gateway, trainer), whatever address reaches it."""
    return [("grpc.ssl_target_name_override", server_name(peer))]


def server_credentials(identity: Identity) -> grpc.ServerCredentials:
    """mTLS server credentials that require a client certificate from the same CA. Read from a
    folder, they follow its files: a renewed certificate or CA is used from the next
    handshake on, with no restart."""
    def config(ident: Identity) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(ident.key, ident.cert)], ident.ca)

    if identity.folder is None:
        return grpc.ssl_server_credentials([(identity.key, identity.cert)], identity.ca,
                                           require_client_auth=True)
    folder = identity.folder
    seen = {"stamp": _stamp(folder)}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        stamp = _stamp(folder)
        if stamp == seen["stamp"]:
            return None
        try:
            fresh = Identity.from_folder(folder)
            _check_pair(fresh)
        except (NoIdentity, ValueError) as exc:  # half-written: keep the old one for now
            log.warning("identity folder %s changed but does not load yet: %s", folder, exc)
            return None
        seen["stamp"] = stamp
        log.info("identity: reloaded %s (%s)", folder, fresh.name)
        return config(fresh)

    return grpc.dynamic_ssl_server_credentials(config(identity), fetch,
                                               require_client_authentication=True)


def _check_pair(ident: Identity) -> None:
    """Raises ValueError unless the key is the certificate's (a renewal caught between its
    two writes)."""
    from cryptography.hazmat.primitives import serialization

    cert_pub = x509.load_pem_x509_certificate(ident.cert).public_key()
    key_pub = serialization.load_pem_private_key(ident.key, None).public_key()
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert_pub.public_bytes(*fmt) != key_pub.public_bytes(*fmt):
        raise ValueError("tls.key is not the key of tls.crt")


def _stamp(folder: Path) -> tuple[float, ...]:
    out = []
    for name in ("ca.crt", "tls.crt", "tls.key"):
        try:
            out.append(os.stat(folder / name).st_mtime_ns)
        except OSError:
            out.append(-1)
    return tuple(out)
