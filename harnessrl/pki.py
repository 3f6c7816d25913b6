"""The deployment's own certificate authority: one CA, one certificate per identity.

Every harnessrl gRPC connection is mutual TLS (docs/security.md says why mTLS rather than
tokens). A deployment makes its CA once and issues each identity a folder laid out like a
Kubernetes TLS Secret (what cert-manager writes), so the same files serve `harnessrl up`,
Compose volumes and Kubernetes Secrets:

    <root>/ca/ca.crt, ca.key         the CA (ca.key 0600; only this tool reads it)
    <root>/<identity>/ca.crt         the CA's certificate, to verify peers
    <root>/<identity>/tls.crt        the identity's certificate: CN=<identity>, O=harnessrl,
                                     DNS <identity>.harnessrl (the name clients verify)
    <root>/<identity>/tls.key        its EC P-256 key (0600)

    python -m harnessrl.pki create DIR [--identity NAME ...] [--days N] [--renew]
    python -m harnessrl.pki kube-secrets DIR [--namespace NS]   # Secrets for kubectl apply

`create` makes what is missing and renews certificates within 30 days of expiry (all of them
with `--renew`); services read renewed files on their next handshake, no restart needed.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The identities a deployment issues (harnessrl/authz.py says what each may call). `admin` may
# call everything: for recovery and the test suite; `harnessrl up` issues it to nobody.
SERVICE_IDENTITIES = ("store", "controller", "gateway", "trainer")
DEPLOYMENT_IDENTITIES = (*SERVICE_IDENTITIES, "grader", "operator", "reader")
ALL_IDENTITIES = (*DEPLOYMENT_IDENTITIES, "admin")
SERVER_NAME_SUFFIX = ".harnessrl"
RENEW_WITHIN = dt.timedelta(days=30)


def server_name(identity: str) -> str:
    """The DNS name in an identity's certificate that clients verify (not a real host name:
    clients reach a service at any address and check they talk to this identity)."""
    return identity + SERVER_NAME_SUFFIX


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "harnessrl"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class Pki:
    """A CA folder and the identity folders beside it."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def folder(self, identity: str) -> Path:
        return self.root / identity

    def _ca(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        crt, key = self.root / "ca" / "ca.crt", self.root / "ca" / "ca.key"
        if not crt.exists():
            k = ec.generate_private_key(ec.SECP256R1())
            name = _name("harnessrl CA")
            cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                    .public_key(k.public_key()).serial_number(x509.random_serial_number())
                    .not_valid_before(_now() - dt.timedelta(minutes=5))
                    .not_valid_after(_now() + dt.timedelta(days=3650))
                    .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                    .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                                 False, False), critical=True)
                    .add_extension(x509.SubjectKeyIdentifier.from_public_key(k.public_key()),
                                   critical=False)
                    .sign(k, hashes.SHA256()))
            (self.root / "ca").mkdir(parents=True, exist_ok=True)
            os.chmod(self.root / "ca", 0o700)
            _write(key, _key_pem(k), private=True)
            _write(crt, cert.public_bytes(serialization.Encoding.PEM))
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
        loaded = serialization.load_pem_private_key(key.read_bytes(), None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key}: not an EC key (harnessrl.pki makes EC P-256 keys)")
        return cert, loaded

    def issue(self, identity: str, days: int = 365, dns: tuple[str, ...] = ()) -> Path:
        """Issues (or re-issues) `identity` a key and certificate; returns its folder."""
        ca, ca_key = self._ca()
        k = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName(server_name(identity)), *(x509.DNSName(d) for d in dns)]
        cert = (x509.CertificateBuilder().subject_name(_name(identity))
                .issuer_name(ca.subject).public_key(k.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(_now() - dt.timedelta(minutes=5))
                .not_valid_after(_now() + dt.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                # Which CA key signed it: while a CA is rolled over, peers trust a bundle of
                # two CAs of the same name, and TLS picks the issuer by this identifier.
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        out = self.folder(identity)
        out.mkdir(parents=True, exist_ok=True)
        os.chmod(out, 0o700)
        _write(out / "ca.crt", ca.public_bytes(serialization.Encoding.PEM))
        # Key before certificate: a reader that sees the new certificate finds its key.
        _write(out / "tls.key", _key_pem(k), private=True)
        _write(out / "tls.crt", cert.public_bytes(serialization.Encoding.PEM))
        return out

    def needs_issue(self, identity: str) -> bool:
        crt = self.folder(identity) / "tls.crt"
        if not crt.exists() or not (self.folder(identity) / "tls.key").exists():
            return True
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
        return cert.not_valid_after_utc - _now() < RENEW_WITHIN

    def ensure(self, identities: tuple[str, ...] = DEPLOYMENT_IDENTITIES, days: int = 365,
               renew: bool = False) -> list[str]:
        """Issues each identity that has no certificate, or one near its expiry (all with
        `renew`); returns those issued."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        issued = [i for i in identities if renew or self.needs_issue(i)]
        for identity in issued:
            self.issue(identity, days)
        return issued


def kube_secrets(root: Path, identities: tuple[str, ...], namespace: str) -> str:
    """Kubernetes TLS Secrets `harnessrl-tls-<identity>` (keys ca.crt, tls.crt, tls.key: the
    layout cert-manager writes), as one YAML stream."""
    docs = []
    for identity in identities:
        folder = root / identity
        data = {k: base64.b64encode((folder / k).read_bytes()).decode()
                for k in ("ca.crt", "tls.crt", "tls.key")}
        docs.append("\n".join([
            "apiVersion: v1", "kind: Secret", "type: kubernetes.io/tls", "metadata:",
            f"  name: harnessrl-tls-{identity}", f"  namespace: {namespace}",
            "  labels: {app.kubernetes.io/part-of: harnessrl}", "data:",
            *(f"  {k}: {v}" for k, v in data.items())]))
    return "---\n" + "\n---\n".join(docs) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harnessrl.pki", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="make the CA and identities that are missing or expiring")
    c.add_argument("root", type=Path)
    c.add_argument("--identity", action="append", choices=ALL_IDENTITIES,
                   help=f"issue this identity (repeatable; default: {', '.join(DEPLOYMENT_IDENTITIES)})")
    c.add_argument("--days", type=int, default=365, help="certificate lifetime (default 365)")
    c.add_argument("--renew", action="store_true", help="re-issue even valid certificates")
    k = sub.add_parser("kube-secrets", help="print Kubernetes Secrets of a created folder")
    k.add_argument("root", type=Path)
    k.add_argument("-n", "--namespace", default="harnessrl")
    k.add_argument("--identity", action="append", choices=ALL_IDENTITIES)
    a = ap.parse_args(argv)
    identities = tuple(a.identity or DEPLOYMENT_IDENTITIES)
    pki = Pki(a.root)
    if a.cmd == "create":
        if a.days < 1:
            ap.error("--days must be at least 1")
        issued = pki.ensure(identities, a.days, a.renew)
        print(f"pki: {a.root}: issued {', '.join(issued) or 'nothing (all valid)'}",
              file=sys.stderr)
        return 0
    missing = [i for i in identities if not (a.root / i / "tls.crt").exists()]
    if missing:
        ap.error(f"{a.root} holds no certificate for {', '.join(missing)} (run create first)")
    sys.stdout.write(kube_secrets(a.root, identities, a.namespace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
