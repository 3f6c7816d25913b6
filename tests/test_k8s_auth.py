"""k8s/ with authentication on (issue 40), checked without a cluster.

- Who holds which credential, in every overlay: each gRPC service mounts its own identity
  (Secret harnessrl-tls-<identity>) at /etc/harnessrl/tls, the controller also the grader's;
  Redis's password only the store, its ACL file only Redis; the engine's keys only the engine,
  the client key the gateway and the trainer; rollout pods nothing and no token. Every file a
  variable names is a key of the Secret mounted there. The check fails on each planted leak.
- The engine and Redis are also fenced by NetworkPolicies (gateway and trainer; the store).
- scripts/k8s-secrets.sh: the Secrets it prints validate, are the ones the manifests name,
  and a second run prints the same; the CA's key never leaves its folder.
- k8s/components/cert-manager: its Issuers and Certificates render with the overlays, make
  every Secret the manifests mount, and ask for what harnessrl/pki.py issues.
- Real processes from what the manifests and the script say: Redis with the ACL file refuses
  a client without the password; the store reaches it with its password file; the exec probes
  pass with the container's own identity and fail with another's or none (what one costs is
  printed); readiness fails and liveness holds while Redis is down.

A rollout pod refused by the engine and the gRPC services, as a real container:
tests/test_k8s_containers.py.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from harnessrl import engine_guard, pki, procs
from harnessrl.deploy_secrets import STORE_REDIS_USER
from test_deploy import (K8S_VERSION, OVERLAYS, containers, env_of, find, job_template,
                         pod_labels, pod_spec, render, traffic_allowed)

REPO = Path(__file__).resolve().parent.parent
TLS_DIR = "/etc/harnessrl/tls"
# Secret -> the workloads that may mount it or read a key of it (and must).
HOLDERS = {
    "harnessrl-tls-store": {"harnessrl-store"},
    "harnessrl-tls-gateway": {"harnessrl-gateway"},
    "harnessrl-tls-controller": {"harnessrl-controller"},
    "harnessrl-tls-grader": {"harnessrl-controller"},
    "harnessrl-tls-trainer": {"harnessrl-trainer"},
    "harnessrl-redis-password": {"harnessrl-store"},
    "harnessrl-redis-acl": {"harnessrl-redis"},
    "harnessrl-engine-keys": {"harnessrl-engine"},
    "harnessrl-engine-api-key": {"harnessrl-gateway", "harnessrl-trainer"},
    "harnessrl-secret": {"harnessrl-gateway", "harnessrl-controller"},
}
OWN_IDENTITY = {"harnessrl-store": "store", "harnessrl-gateway": "gateway",
                "harnessrl-controller": "controller", "harnessrl-trainer": "trainer"}
# Variables that name a file (or a folder: its tls.crt) in a mounted Secret.
FILE_ENV = ("HARNESSRL_CONTROLLER_GRADER_TLS_DIR", "HARNESSRL_ENGINE_KEYS_FILE",
            "HARNESSRL_ENGINE_API_KEY_FILE", "HARNESSRL_STORE_REDIS_PASSWORD_FILE")
ROLLOUT = "rollout pods (the Job template)"


# -- the Secrets scripts/k8s-secrets.sh makes --------------------------------------------------

def run_script(folder: Path, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run(["bash", str(REPO / "scripts" / "k8s-secrets.sh"), str(folder), *args],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("k8s-secrets") / "deploy"
    return folder, run_script(folder, "-n", "harnessrl")


def secret_files(secrets: list[dict[str, Any]]) -> dict[str, dict[str, bytes]]:
    """Secret name -> {key: content}."""
    return {s["metadata"]["name"]: {k: base64.b64decode(v) for k, v in s["data"].items()}
            for s in secrets}


def test_script_makes_every_secret_the_manifests_name(made) -> None:  # type: ignore[no-untyped-def]
    folder, secrets = made
    by_name = secret_files(secrets)
    assert set(by_name) == set(HOLDERS) | {"harnessrl-engine-judge-key"}
    for s in secrets:
        kubernetes_validate.validate(s, K8S_VERSION, strict=True)
        assert s["metadata"]["namespace"] == "harnessrl"
    for name, files in by_name.items():
        if name.startswith("harnessrl-tls-"):
            identity = name.removeprefix("harnessrl-tls-")
            [doc] = [s for s in secrets if s["metadata"]["name"] == name]
            assert doc["type"] == "kubernetes.io/tls" and set(files) == {
                "ca.crt", "tls.crt", "tls.key"}
            cert = x509.load_pem_x509_certificate(files["tls.crt"])
            assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == identity
            ca = x509.load_pem_x509_certificate(files["ca.crt"])
            cert.verify_directly_issued_by(ca)
    # the CA's key, the operator's and the reader's stay in the folder (0700)
    text = json.dumps(by_name, default=lambda b: b.decode())
    for kept in ("ca/ca.key", "operator/tls.key", "reader/tls.key"):
        assert (folder / "pki" / kept).read_text() not in text
    assert (folder.stat().st_mode & 0o777) == 0o700
    # the ACL file holds the password's hash, the keys file the client's and the judge's key
    password = by_name["harnessrl-redis-password"]["password"].decode().strip()
    acl = by_name["harnessrl-redis-acl"]["users.acl"].decode()
    assert password not in acl and hashlib.sha256(password.encode()).hexdigest() in acl
    accepted = by_name["harnessrl-engine-keys"]["keys"].decode().split()
    assert by_name["harnessrl-engine-api-key"]["api.key"].decode().strip() in accepted
    assert by_name["harnessrl-engine-judge-key"]["judge.key"].decode().strip() in accepted


def test_script_again_prints_the_same_and_cert_manager_mode_no_identities(made) -> None:  # type: ignore[no-untyped-def]
    folder, secrets = made
    assert run_script(folder, "--namespace", "harnessrl") == secrets
    without = run_script(folder, "--no-tls", "-n", "other")
    assert {s["metadata"]["name"] for s in without} == \
        {n for n in secret_files(secrets) if not n.startswith("harnessrl-tls-")}
    assert {s["metadata"]["namespace"] for s in without} == {"other"}


# -- who holds which credential ----------------------------------------------------------------

def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {d["metadata"]["name"]: d for d in docs if pod_spec(d) is not None}
    out[ROLLOUT] = job_template(docs)
    return out


def secret_refs(spec: dict[str, Any]) -> set[str]:
    """Every Secret a pod spec names: volumes (projected too), env and envFrom."""
    names = set()
    for v in spec.get("volumes", []):
        if "secret" in v:
            names.add(v["secret"]["secretName"])
        for src in (v.get("projected") or {}).get("sources", []):
            if "secret" in src:
                names.add(src["secret"]["name"])
    for ct in containers(spec):
        for e in ct.get("env", []):
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
        for src in ct.get("envFrom", []):
            if "secretRef" in src:
                names.add(src["secretRef"]["name"])
    return names


def mounted_file(spec: dict[str, Any], ct: dict[str, Any], path: str) -> tuple[str, str]:
    """The Secret and key that a path in a container is: (secret, key)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in ct.get("volumeMounts", []):
        if path.startswith(m["mountPath"] + "/"):
            volume = volumes[m["name"]]
            assert "secret" in volume and m.get("readOnly") is True, (path, m)
            return volume["secret"]["secretName"], path[len(m["mountPath"]) + 1:]
    raise AssertionError(f"{path}: in no mounted Secret of {ct['name']}")


def check_credentials(docs: list[dict[str, Any]], keys: dict[str, set[str]]) -> None:
    """Each workload holds exactly the Secrets HOLDERS gives it, read-only, 0440 with its
    group; its own identity at TLS_DIR; every file a variable names is a key of the Secret
    mounted there (`keys`: Secret -> its keys); the engine runs behind its guard; rollout pods
    hold nothing and get no token."""
    for name, doc in workloads(docs).items():
        spec = doc["spec"]["template"]["spec"]
        held = secret_refs(spec)
        assert held == {s for s, who in HOLDERS.items() if name in who}, (name, held)
        if name == ROLLOUT:
            assert spec["automountServiceAccountToken"] is False
            continue
        for v in spec.get("volumes", []):
            if "secret" in v:
                assert v["secret"]["defaultMode"] == 0o440, (name, v)
                assert spec["securityContext"]["fsGroup"] == \
                    spec["securityContext"]["runAsGroup"], name
        for ct in containers(spec):
            env = env_of(ct)
            own = OWN_IDENTITY.get(name)
            if own is not None and ct is spec["containers"][0]:
                assert env["HARNESSRL_TLS_DIR"] == TLS_DIR, name
                assert mounted_file(spec, ct, TLS_DIR + "/tls.key") == (
                    f"harnessrl-tls-{own}", "tls.key"), name
            else:
                assert "HARNESSRL_TLS_DIR" not in env, (name, ct["name"])
            files = [env[k] + ("/tls.crt" if k.endswith("_DIR") else "")  # an identity
                     for k in FILE_ENV if k in env]
            if "--aclfile" in ct.get("args", []):
                files.append(ct["args"][ct["args"].index("--aclfile") + 1])
            for path in files:
                secret, key = mounted_file(spec, ct, path)
                assert key in keys[secret], (name, path, secret, keys[secret])
    engine = pod_spec(find(docs, "Deployment", "harnessrl-engine"))["containers"][0]  # type: ignore[index]
    args = engine["args"]
    assert args[args.index("--middleware") + 1] == engine_guard.MIDDLEWARE
    assert env_of(engine)["HARNESSRL_ENGINE_KEYS_FILE"]
    redis_ct = pod_spec(find(docs, "StatefulSet", "harnessrl-redis"))["containers"][0]  # type: ignore[index]
    assert "--aclfile" in redis_ct["args"], "Redis without its ACL file lets anyone in"
    store = pod_spec(find(docs, "Deployment", "harnessrl-store"))["containers"][0]  # type: ignore[index]
    url = env_of(store)["HARNESSRL_STORE_REDIS_URL"]
    assert url.startswith(f"redis://{STORE_REDIS_USER}@"), url  # no password in it


@pytest.fixture(scope="module")
def cpu() -> list[dict[str, Any]]:
    """k8s/overlays/cpu rendered (callers copy what they change)."""
    return render("cpu")


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_each_pod_holds_its_own_credentials_only(overlay, made) -> None:  # type: ignore[no-untyped-def]
    _, docs = overlay
    check_credentials(docs, {n: set(f) for n, f in secret_files(made[1]).items()})


LEAKS = {
    "the gateway mounts the store's identity": lambda docs: pod_spec(find(
        docs, "Deployment", "harnessrl-gateway"))["volumes"].append(  # type: ignore[index]
            {"name": "x", "secret": {"secretName": "harnessrl-tls-store", "defaultMode": 0o440}}),
    "rollout pods get the grader's identity": lambda docs: job_template(docs),  # see below
    "the trainer reads Redis's password": lambda docs: pod_spec(find(
        docs, "Job", "harnessrl-trainer"))["containers"][0]["env"].append(  # type: ignore[index]
            {"name": "P", "valueFrom": {"secretKeyRef": {"name": "harnessrl-redis-password",
                                                         "key": "password"}}}),
    "an engine without its guard": lambda docs: pod_spec(find(
        docs, "Deployment", "harnessrl-engine"))["containers"][0]["args"].remove(  # type: ignore[index]
            "--middleware"),
}


@pytest.mark.parametrize("leak", list(LEAKS))
def test_the_check_sees_each_leak(leak: str, made, cpu) -> None:  # type: ignore[no-untyped-def]
    docs = cpu
    keys = {n: set(f) for n, f in secret_files(made[1]).items()}
    check_credentials(docs, keys)
    docs = copy.deepcopy(docs)
    if leak.startswith("rollout pods"):
        cm = find(docs, "ConfigMap", "harnessrl-job-template")
        job = yaml.safe_load(cm["data"]["job.yaml"])
        job["spec"]["template"]["spec"]["volumes"] = [
            {"name": "g", "secret": {"secretName": "harnessrl-tls-grader"}}]
        cm["data"]["job.yaml"] = yaml.safe_dump(job)
    else:
        LEAKS[leak](docs)
    with pytest.raises((AssertionError, ValueError)):
        check_credentials(docs, keys)


def test_engine_and_redis_are_fenced_by_network_policies(overlay) -> None:  # type: ignore[no-untyped-def]
    """Besides the keys: only the gateway and the trainer reach the engine's port, only the
    store Redis's (for a network plugin that enforces NetworkPolicies)."""
    _, docs = overlay
    labels = {n: pod_labels(d) for n, d in workloads(docs).items() if n != ROLLOUT}
    labels[ROLLOUT] = job_template(docs)["spec"]["template"]["metadata"]["labels"]
    for name, src in labels.items():
        to_engine = traffic_allowed(docs, src, labels["harnessrl-engine"], 8000, "http")
        assert to_engine == (name in ("harnessrl-gateway", "harnessrl-trainer")), name
        to_redis = traffic_allowed(docs, src, labels["harnessrl-redis"], 6379, "redis")
        assert to_redis == (name == "harnessrl-store"), name


# -- cert-manager ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def with_cert_manager(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """k8s/overlays/cpu with k8s/components/cert-manager, as a user's overlay would add it."""
    here = tmp_path_factory.mktemp("overlay")
    overlay = "cpu"
    k8s = Path(os.path.relpath(REPO / "k8s", here))
    (here / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(k8s / "overlays" / overlay)],
        "components": [str(k8s / "components" / "cert-manager")]}))
    out = subprocess.run(["kubectl", "kustomize", str(here)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with additionalProperties false on every object that lists its properties."""
    if schema.get("type") == "object" and "properties" in schema:
        schema = {**schema, "additionalProperties": False,
                  "properties": {k: _strict(v) for k, v in schema["properties"].items()}}
    if "items" in schema:
        schema = {**schema, "items": _strict(schema["items"])}
    return schema


_STR, _STRS = {"type": "string"}, {"type": "array", "items": {"type": "string"}}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "required": ["name", "namespace"], "properties": {
    "name": _STR, "namespace": _STR, "labels": _LABELS, "annotations": _LABELS}}
_REF = {"type": "object", "required": ["name"], "properties": {"name": _STR, "kind": _STR,
                                                               "group": _STR}}
# The part of cert-manager.io/v1 (CRDs of cert-manager 1.19) these objects use: field names,
# types and enums as the CRDs give them; anything else is refused.
CERT_MANAGER_SCHEMAS = {kind: _strict(s) for kind, s in {
    "Issuer": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
               "properties": {
                   "apiVersion": {"const": "cert-manager.io/v1"}, "kind": _STR, "metadata": _META,
                   "spec": {"type": "object", "minProperties": 1, "maxProperties": 1,
                            "properties": {
                                "selfSigned": {"type": "object", "properties": {
                                    "crlDistributionPoints": _STRS}},
                                "ca": {"type": "object", "required": ["secretName"],
                                       "properties": {"secretName": _STR}}}}}},
    "Certificate": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
                    "properties": {
                        "apiVersion": {"const": "cert-manager.io/v1"}, "kind": _STR,
                        "metadata": _META,
                        "spec": {"type": "object", "required": ["secretName", "issuerRef"],
                                 "properties": {
                                     "secretName": _STR, "commonName": _STR, "dnsNames": _STRS,
                                     "isCA": {"type": "boolean"}, "duration": _STR,
                                     "renewBefore": _STR, "issuerRef": _REF,
                                     "subject": {"type": "object", "properties": {
                                         "organizations": _STRS}},
                                     "usages": {"type": "array", "items": {"enum": [
                                         "digital signature", "key encipherment",
                                         "server auth", "client auth", "cert sign"]}},
                                     "privateKey": {"type": "object", "properties": {
                                         "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                                         "size": {"type": "integer"},
                                         "encoding": {"enum": ["PKCS1", "PKCS8"]},
                                         "rotationPolicy": {"enum": ["Never", "Always"]}}},
                                     "secretTemplate": {"type": "object", "properties": {
                                         "labels": _LABELS, "annotations": _LABELS}}}}}},
}.items()}


def check_cert_manager(docs: list[dict[str, Any]]) -> None:
    ours = [d for d in docs if d["apiVersion"].startswith("cert-manager.io/")]
    for doc in ours:  # (the rest is the overlay's: tests/test_deploy.py validates it)
        jsonschema.validate(doc, CERT_MANAGER_SCHEMAS[doc["kind"]])
    issuers = {d["metadata"]["name"]: d["spec"] for d in ours if d["kind"] == "Issuer"}
    certs = {d["spec"]["secretName"]: d["spec"] for d in ours if d["kind"] == "Certificate"}
    for spec in certs.values():
        assert spec["issuerRef"]["name"] in issuers and spec["issuerRef"]["kind"] == "Issuer"
    [(ca_issuer, ca)] = [(n, s["ca"]) for n, s in issuers.items() if "ca" in s]
    root = certs[ca["secretName"]]
    assert root["isCA"] is True and "selfSigned" in issuers[root["issuerRef"]["name"]]
    assert root["privateKey"]["rotationPolicy"] == "Never"  # renewals still verify old leaves
    mounted = {s for s in HOLDERS if s.startswith("harnessrl-tls-")}
    assert mounted <= set(certs), mounted - set(certs)
    for secret, spec in certs.items():
        if secret == ca["secretName"]:
            continue
        identity = secret.removeprefix("harnessrl-tls-")
        assert identity in pki.DEPLOYMENT_IDENTITIES, secret
        assert spec["issuerRef"]["name"] == ca_issuer and not spec.get("isCA")
        assert spec["commonName"] == identity
        assert spec["dnsNames"] == [pki.server_name(identity)]
        assert spec["subject"]["organizations"] == ["harnessrl"]
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["privateKey"] == {"algorithm": "ECDSA", "size": 256, "encoding": "PKCS8",
                                      "rotationPolicy": "Always"}


def test_cert_manager_component_makes_every_identity(with_cert_manager) -> None:  # type: ignore[no-untyped-def]
    docs = with_cert_manager
    assert {d["metadata"].get("namespace") for d in docs} == {"harnessrl"}
    check_cert_manager(docs)
    bad = copy.deepcopy(docs)  # the check can fail: an identity without a client usage
    next(d for d in bad if d["kind"] == "Certificate" and
         d["spec"]["secretName"] == "harnessrl-tls-gateway")["spec"]["usages"] = ["server auth"]
    with pytest.raises(AssertionError):
        check_cert_manager(bad)
    typo = copy.deepcopy(docs)
    next(d for d in typo if d["kind"] == "Certificate")["spec"]["dnsName"] = ["x"]
    with pytest.raises(jsonschema.ValidationError):
        check_cert_manager(typo)


def test_cert_manager_asks_for_what_pki_issues(with_cert_manager, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The component's Certificate for an identity asks for the certificate harnessrl/pki.py
    issues it: same subject, DNS name, extended key usages, key type (identity.py and authz.py
    read the CN; clients verify the DNS name)."""
    docs = with_cert_manager
    cert_specs = {d["spec"]["commonName"]: d["spec"] for d in docs
                  if d["kind"] == "Certificate" and not d["spec"].get("isCA")}
    folder = pki.Pki(tmp_path / "pki").issue("gateway")
    cert = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
    spec = cert_specs["gateway"]
    assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)] == \
        [spec["commonName"]]
    assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)] \
        == spec["subject"]["organizations"]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == spec["dnsNames"]
    eku = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    usage = {"server auth": ExtendedKeyUsageOID.SERVER_AUTH,
             "client auth": ExtendedKeyUsageOID.CLIENT_AUTH}
    assert eku == {usage[u] for u in spec["usages"] if u in usage}
    key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.key_size == \
        spec["privateKey"]["size"] and spec["privateKey"]["algorithm"] == "ECDSA"
    assert (folder / "tls.key").read_text().startswith("-----BEGIN PRIVATE KEY-----")  # PKCS8


# -- real processes from what the manifests say ------------------------------------------------

def materialize(spec: dict[str, Any], ct: dict[str, Any], files: dict[str, dict[str, bytes]],
                root: Path) -> dict[str, str]:
    """Writes the container's Secret mounts under `root` as the kubelet would (0440 files);
    returns mountPath -> the folder standing for it."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    out = {}
    for m in ct.get("volumeMounts", []):
        secret = volumes.get(m["name"], {}).get("secret")  # (or a claim template)
        if secret is None:
            continue
        folder = root / m["mountPath"].strip("/")
        folder.mkdir(parents=True)
        for key, data in files[secret["secretName"]].items():
            (folder / key).write_bytes(data)
            (folder / key).chmod(0o440)
        out[m["mountPath"]] = str(folder)
    return out


def local(value: str, mounts: dict[str, str]) -> str:
    for path, folder in mounts.items():
        value = value.replace(path, folder)
    return value


@pytest.fixture
def cluster_redis(tmp_path: Path, made, cpu) -> Iterator[tuple[int, str, procs.ServiceProcess]]:  # type: ignore[no-untyped-def]
    """redis-server run with the StatefulSet's args and its ACL Secret (port and paths local);
    yields its port, the store's password and the process."""
    files = secret_files(made[1])
    sts = pod_spec(find(cpu, "StatefulSet", "harnessrl-redis"))
    assert sts is not None
    [ct] = sts["containers"]
    mounts = materialize(sts, ct, files, tmp_path / "redis-pod")
    port = procs.free_port()
    (tmp_path / "data").mkdir()
    args = [local(a, mounts) for a in ct["args"]]
    args[args.index("--port") + 1] = str(port)
    args[args.index("--dir") + 1] = str(tmp_path / "data")
    proc = procs.ServiceProcess("redis", ["redis-server", *args, "--bind", "127.0.0.1"],
                                tmp_path).start()
    try:
        wait_answering(port, proc)
        yield port, files["harnessrl-redis-password"]["password"].decode().strip(), proc
    finally:
        proc.stop()


def test_redis_refuses_a_client_without_the_password(cluster_redis) -> None:  # type: ignore[no-untyped-def]
    port, password, _ = cluster_redis
    anyone = redis.Redis(port=port, retry=Retry(NoBackoff(), 0))
    for command in (("PING",), ("GET", "k"), ("SET", "k", "v"), ("KEYS", "*"),
                    ("CONFIG", "GET", "*")):
        with pytest.raises((redis.exceptions.ResponseError,
                            redis.exceptions.AuthenticationError),
                           match="NOAUTH|[Aa]uthenticat"):
            anyone.execute_command(*command)
    with pytest.raises(redis.exceptions.AuthenticationError):  # the default user is off
        redis.Redis(port=port, username="default", password=password,
                    retry=Retry(NoBackoff(), 0)).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=port, username=STORE_REDIS_USER, password="wrong" * 8,
                    retry=Retry(NoBackoff(), 0)).ping()
    store = redis.Redis(port=port, username=STORE_REDIS_USER, password=password)
    assert store.set("k", "v") and store.get("k") == b"v"
    with pytest.raises(redis.exceptions.ResponseError, match="no permissions"):
        store.execute_command("CONFIG", "GET", "requirepass")  # no @admin for the store


def wait_answering(port: int, proc: procs.ServiceProcess) -> None:
    """Until the readiness probe's `redis-cli ping` gets an answer (loading done)."""
    deadline = time.monotonic() + 20
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                         text=True).stdout.strip() not in ("PONG", "NOAUTH Authentication "
                                                           "required."):
        assert time.monotonic() < deadline and proc.alive, proc.log_tail()
        time.sleep(0.1)


def test_redis_keeps_the_stores_transactions_across_a_restart(cluster_redis) -> None:  # type: ignore[no-untyped-def]
    """Redis replays its AOF as the default user, and before 8.4 (redis/redis#14541) checks
    each replayed EXEC against that user's rights: an ACL whose default user may run nothing
    would drop every transaction of the store at a restart, silently."""
    port, password, proc = cluster_redis
    store = redis.Redis(port=port, username=STORE_REDIS_USER, password=password)
    with store.pipeline(transaction=True) as tx:
        tx.set("in-a-transaction", "1").set("also", "2").execute()
    store.set("alone", "3")
    proc.stop()
    again = proc.respawn()
    try:
        wait_answering(port, again)
        store = redis.Redis(port=port, username=STORE_REDIS_USER, password=password)
        kept = [store.get(k) for k in ("in-a-transaction", "also", "alone")]
    finally:
        again.stop()
    assert kept == [b"1", b"2", b"3"], kept


def probe(cmd: list[str], port: int, env: dict[str, str], cwd: Path) -> tuple[int, float]:
    """Runs a probe command of the manifests (its port made local) as the kubelet runs an
    exec probe in the container; returns its exit status and seconds."""
    argv = [a.replace("127.0.0.1:50051", f"127.0.0.1:{port}") for a in cmd]
    assert argv[0] == "python"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HARNESSRL_")}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *argv[1:]], env={**clean, **env}, cwd=cwd,
                         capture_output=True, timeout=60)
    return out.returncode, time.perf_counter() - t0


def test_store_pod_reaches_redis_and_its_probes_use_its_identity(
        cluster_redis, made, cpu, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The store run with the Deployment's environment and Secret mounts reaches Redis with
    the password file alone; its exec probes pass with its identity, fail with the
    gateway's or none; with Redis down, readiness fails and liveness holds."""
    redis_port, _, redis_proc = cluster_redis
    files = secret_files(made[1])
    spec = pod_spec(find(cpu, "Deployment", "harnessrl-store"))
    assert spec is not None
    [ct] = spec["containers"]
    mounts = materialize(spec, ct, files, tmp_path / "store-pod")
    env = {k: local(v, mounts) for k, v in env_of(ct).items()}
    port = procs.free_port()
    env["HARNESSRL_STORE_BIND"] = f"127.0.0.1:{port}"
    env["HARNESSRL_STORE_REDIS_URL"] = env["HARNESSRL_STORE_REDIS_URL"].replace(
        "harnessrl-redis:6379", f"127.0.0.1:{redis_port}")
    env["HARNESSRL_STORE_HEALTH_INTERVAL_S"] = "0.2"
    ready_file = tmp_path / "store.ready"
    store = procs.ServiceProcess("store", [sys.executable, "-m", "services.store",
                                           "--ready-file", str(ready_file)], tmp_path,
                                 env=env, ready_file=ready_file).start()
    try:
        store.wait_ready(30)
        ready, live = ct["readinessProbe"], ct["livenessProbe"]
        own = {"HARNESSRL_TLS_DIR": env["HARNESSRL_TLS_DIR"]}
        code, ready_s = probe(ready["exec"]["command"], port, own, tmp_path)
        assert code == 0, store.log_path.read_text()[-2000:]
        code, live_s = probe(live["exec"]["command"], port, own, tmp_path)
        assert code == 0
        print(f"exec probe: readiness {ready_s:.2f} s, liveness {live_s:.2f} s "
              f"(timeoutSeconds {ready['timeoutSeconds']})")
        assert max(ready_s, live_s) < ready["timeoutSeconds"]
        gateway = materialize({"volumes": [{"name": "t", "secret": {
            "secretName": "harnessrl-tls-gateway"}}]}, {"volumeMounts": [
                {"name": "t", "mountPath": "/gw"}]}, files, tmp_path / "gw-pod")["/gw"]
        assert probe(ready["exec"]["command"], port, {"HARNESSRL_TLS_DIR": gateway},
                     tmp_path)[0] == 1  # another service's identity checks another service
        assert probe(ready["exec"]["command"], port, {}, tmp_path)[0] == 1  # no identity
        redis_proc.stop()  # readiness: NOT_SERVING; liveness: the process answers
        deadline = time.monotonic() + 20
        while probe(ready["exec"]["command"], port, own, tmp_path)[0] == 0:
            assert time.monotonic() < deadline, "readiness still passes without Redis"
        assert probe(live["exec"]["command"], port, own, tmp_path)[0] == 0
    finally:
        store.stop()
