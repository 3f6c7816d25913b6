"""Identities beyond the matrix (tests/test_auth_matrix.py), against real store processes: a
grader's scope token (harnessrl/authz.py), certificate rotation without a restart
(harnessrl/identity.py `server_credentials`), and insecure mode only on loopback and only when
asked for."""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509

import conftest
from conftest import StoreService
from harnessrl import authz, identity, pki, procs
from harnessrl.clients import StoreClient
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb

RUN = "scope-run"
OWN_GROUP, OTHER_GROUP = f"{RUN}/t0", f"{RUN}/t1"
OWN, SIBLING, OTHER = f"{OWN_GROUP}/0", f"{OWN_GROUP}/1", f"{OTHER_GROUP}/0"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[StoreService]:
    """A store holding two groups of one run (written as admin, the test process)."""
    svc = StoreService(tmp_path_factory.mktemp("scope-store"), redis_url,
                       f"s{uuid.uuid4().hex[:8]}:").start()
    admin = StoreClient.connect(svc.address, timeout=10)
    try:
        admin.put_run(c.Run(run_id=RUN, spec=c.RunSpec(name="scope")))
        admin.create_rollouts([
            c.Rollout(rollout_id=rid, run_id=RUN, task_id=rid.split("/")[1],
                      group_id=rid.rsplit("/", 1)[0], index_in_group=int(rid[-1]),
                      group_size=2, stream="-") for rid in (OWN, SIBLING, OTHER)])
        yield svc
    finally:
        admin.close()
        svc.stop()


def grader(token: str) -> identity.Identity:
    """The grader identity with `token`, as a grader job gets it from the controller."""
    assert conftest.TEST_PKI is not None
    return identity.Identity.from_folder(conftest.TEST_PKI / "grader", token)


def scope_token(signer: str = "controller", ttl_s: float = 60,
                signer_identity: identity.Identity | None = None) -> str:
    return authz.mint_scope(signer_identity or conftest.as_identity(signer), RUN, OWN_GROUP,
                            [OWN], ttl_s)


def refusal(fn: object, *args: object) -> str:
    """Calls fn(*args), which must fail PERMISSION_DENIED; its details."""
    with pytest.raises(grpc.RpcError) as err:
        fn(*args)  # type: ignore[operator]
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    return str(err.value.details())


def test_a_grader_reads_only_its_scope(store: StoreService) -> None:
    client = StoreClient.connect(store.address, timeout=10, ident=grader(scope_token()))
    try:
        # its rollout, its group, its run's judge cache
        assert client.get_rollout(OWN).rollout_id == OWN
        assert {r.rollout_id for r in client.list_rollouts(RUN, OWN_GROUP).rollouts} == \
            {OWN, SIBLING}
        assert len(client.list_rollouts("", OWN_GROUP).rollouts) == 2
        client.put_state(authz.judge_namespace(RUN), "k", b"verdict")
        assert client.get_state(authz.judge_namespace(RUN), "k") == b"verdict"
        # nothing else
        for fn, args, rpc_name in [
                (client.get_rollout, (SIBLING,), "GetRollout"),  # its group, not its rollout
                (client.get_rollout, (OTHER,), "GetRollout"),
                (client.list_rollouts, (RUN, OTHER_GROUP), "ListRollouts"),
                (client.list_rollouts, (RUN,), "ListRollouts"),  # the whole run
                (client.list_rollouts, ("another-run", OWN_GROUP), "ListRollouts"),
                (client.get_state, (authz.judge_namespace("another-run"), "k"), "GetState"),
                (client.put_state, ("gateway", "k", b"x"), "PutState"),
        ]:
            details = refusal(fn, *args)
            assert f"'grader' may not call /harnessrl.v1.Store/{rpc_name} outside its scope" \
                in details, details
        # a scope token widens nothing the table does not give a grader
        outside: list[tuple[object, tuple[object, ...], str]] = [
                (client.list_state, (authz.judge_namespace(RUN),), "ListState"),
                (client.delete_state, (authz.judge_namespace(RUN), "k"), "DeleteState"),
                (client.finish_attempt, (spb.FinishAttemptRequest(rollout_id=OWN, attempt=1),),
                 "FinishAttempt"),
                (client.get_run, (RUN,), "GetRun")]
        for call, call_args, name in outside:
            details = refusal(call, *call_args)
            assert f"'grader' may not call /harnessrl.v1.Store/{name}" in details
    finally:
        client.close()
    admin = StoreClient.connect(store.address, timeout=10)
    try:
        assert admin.get_state("gateway", "k") is None
        assert admin.get_state(authz.judge_namespace(RUN), "k") == b"verdict"
    finally:
        admin.close()


def _tampered(token: str) -> str:
    payload, sig, cert = token.split(".")
    p = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    p["rollouts"] = [OWN, OTHER]
    forged = base64.urlsafe_b64encode(json.dumps(p, separators=(",", ":")).encode())
    return ".".join((forged.rstrip(b"=").decode(), sig, cert))


def test_a_scope_token_counts_only_when_the_controller_signed_it_and_it_is_current(
        store: StoreService, tmp_path: Path) -> None:
    foreign_ctl = identity.Identity.from_folder(pki.Pki(tmp_path / "other-ca").issue(
        "controller"))
    tokens = {
        "signed by the gateway's key": (scope_token("gateway"), "signed by 'gateway'"),
        "expired": (scope_token(ttl_s=-1), "expired"),
        "payload changed after signing": (_tampered(scope_token()), "does not verify"),
        "another CA's controller": (scope_token(signer_identity=foreign_ctl),
                                    "not from this deployment's CA"),
        "no token": ("", "no scope token"),
        "not a token": ("x.y.z", "does not parse"),
    }
    for what, (token, why) in tokens.items():
        client = StoreClient.connect(store.address, timeout=10, ident=grader(token))
        try:
            for fn, args in [(client.get_rollout, (OWN,)),
                             (client.list_rollouts, (RUN, OWN_GROUP)),
                             (client.get_state, (authz.judge_namespace(RUN), "k"))]:
                details = refusal(fn, *args)
                assert "'grader' may not call" in details and why in details, (what, details)
        finally:
            client.close()
    # the tampered token names OTHER; with its real signature it still reads only OWN
    client = StoreClient.connect(store.address, timeout=10, ident=grader(scope_token()))
    try:
        assert client.get_rollout(OWN).rollout_id == OWN
    finally:
        client.close()


# -- rotation -------------------------------------------------------------------------------
def _server_serial(port: int, ident: identity.Identity, ca: Path) -> int:
    """The serial number of the certificate a new TLS connection to the store gets (mutual
    TLS: the client shows `ident`'s certificate, as the store requires)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    assert ident.folder is not None
    ctx.load_cert_chain(ident.folder / "tls.crt", ident.folder / "tls.key")
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, \
            ctx.wrap_socket(sock, server_hostname=pki.server_name("store")) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _serial(folder: Path) -> int:
    return x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes()).serial_number


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path: Path,
                                                            redis_url: str) -> None:
    """The store's certificate re-issued while it runs: the next connection gets the new one,
    calls on it and on the connection opened before work, and the process is the same."""
    own = pki.Pki(tmp_path / "pki")  # its own CA: the session's store certificate stays
    own.ensure(("store", "admin"))
    admin = identity.Identity.from_folder(own.folder("admin"))
    proc, info = procs.start_service(
        "store", "services.store", ["--bind", "127.0.0.1:0", "--redis-url", redis_url,
                                    "--key-prefix", f"rot{uuid.uuid4().hex[:6]}:"],
        tmp_path / "store", timeout=60, tls_root=own.root)
    port, pid = info["grpc_port"], info["pid"]
    address = f"127.0.0.1:{port}"
    old = StoreClient.connect(address, timeout=10, ident=admin)
    try:
        old.list_runs()
        first = _serial(own.folder("store"))
        assert _server_serial(port, admin, own.folder("admin") / "ca.crt") == first
        own.issue("store")
        renewed = _serial(own.folder("store"))
        assert renewed != first
        assert _server_serial(port, admin, own.folder("admin") / "ca.crt") == renewed
        new = StoreClient.connect(address, timeout=10, ident=admin)
        try:
            new.list_runs()
        finally:
            new.close()
        old.list_runs()
        assert proc.alive and json.loads((tmp_path / "store" / "store.ready").read_text()
                                         )["pid"] == pid
        assert "identity: reloaded" in proc.log_path.read_text()
    finally:
        old.close()
        proc.stop()


def test_a_rolled_over_ca_counts_for_scope_tokens_without_a_restart(
        tmp_path: Path, redis_url: str) -> None:
    """A CA rolled over while the store runs: its ca.crt becomes a bundle of the old and the new
    CA. A grader of the new CA (its token signed by the new CA's controller) reads its rollout
    from then on, the same process; before, the token was refused."""
    old, new = pki.Pki(tmp_path / "old"), pki.Pki(tmp_path / "new")
    old.ensure(("store", "admin"))
    new.ensure(("controller", "grader"))
    proc, info = procs.start_service(
        "store", "services.store", ["--bind", "127.0.0.1:0", "--redis-url", redis_url,
                                    "--key-prefix", f"roll{uuid.uuid4().hex[:6]}:"],
        tmp_path / "store", timeout=60, tls_root=old.root)
    address = f"127.0.0.1:{info['grpc_port']}"
    admin = StoreClient.connect(address, timeout=10, ident=identity.Identity.from_folder(
        old.folder("admin")))
    bundle = (old.folder("store") / "ca.crt").read_bytes() + \
        (new.folder("grader") / "ca.crt").read_bytes()
    for who in (old.folder("store"), new.folder("grader")):  # both trust both, as in a roll
        (who / "ca.crt").write_bytes(bundle)
    token = authz.mint_scope(identity.Identity.from_folder(new.folder("controller")), RUN,
                             OWN_GROUP, [OWN], 60)
    try:
        admin.create_rollouts([c.Rollout(rollout_id=OWN, run_id=RUN, task_id="t0",
                                         group_id=OWN_GROUP, group_size=1, stream="-")])
        graded = StoreClient.connect(address, timeout=10, ident=identity.Identity.from_folder(
            new.folder("grader"), token))
        try:
            assert graded.get_rollout(OWN).rollout_id == OWN
        finally:
            graded.close()
        assert proc.alive and json.loads((tmp_path / "store" / "store.ready").read_text()
                                         )["pid"] == info["pid"]
    finally:
        admin.close()
        proc.stop()


def test_a_half_written_ca_file_leaves_the_ca_in_use(tmp_path: Path) -> None:
    """Authorize reads ca.crt again for a token of an unknown CA; a file caught half-written
    is skipped (the token refused, the CA in use kept), and the finished bundle counts."""
    old, new = pki.Pki(tmp_path / "old"), pki.Pki(tmp_path / "new")
    old.ensure(("store",))
    new.ensure(("controller",))
    ca_file = old.folder("store") / "ca.crt"
    in_use = ca_file.read_bytes()
    gate = authz.Authorize(in_use, ca_file)
    token = [(identity.SCOPE_METADATA, authz.mint_scope(
        identity.Identity.from_folder(new.folder("controller")), RUN, OWN_GROUP, [OWN], 60))]
    ca_file.write_bytes(in_use[:100])
    with pytest.raises(authz.ScopeError, match="not from this deployment's CA"):
        gate._scope(token)
    assert gate.ca_pem == in_use
    ca_file.write_bytes(in_use + (new.folder("controller") / "ca.crt").read_bytes())
    assert gate._scope(token).rollout_ids == (OWN,)


# -- insecure mode --------------------------------------------------------------------------
def _store(tmp_path: Path, redis_url: str, bind: str, **env: str) -> procs.ServiceProcess:
    """A store process with no identity at all (neither the session's TLS root nor a folder)
    and `env`."""
    ready = tmp_path / "store.ready"
    proc = procs.ServiceProcess("store", procs.python_module(
        "services.store", "--bind", bind, "--redis-url", redis_url, "--key-prefix",
        f"ins{uuid.uuid4().hex[:6]}:", "--ready-file", str(ready)), tmp_path, env=env,
        ready_file=ready)
    for k in (*identity.IDENTITY_ENV, procs.TLS_ROOT_ENV):
        proc.env.pop(k, None)
    proc.env.update(env)
    return proc.start()


def _refused(proc: procs.ServiceProcess) -> str:
    """The last line a process that must refuse to start wrote (after checking it exited)."""
    assert proc.proc is not None
    try:
        code = proc.proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"it did not refuse to start:\n{proc.log_tail()}") from None
    assert code != 0
    assert not proc.ready_file or not proc.ready_file.exists()
    return proc.log_tail(1)


def test_insecure_mode_serves_plaintext_on_loopback_and_says_so(tmp_path: Path,
                                                                redis_url: str) -> None:
    proc = _store(tmp_path, redis_url, "127.0.0.1:0", HARNESSRL_INSECURE="1")
    try:
        address = f"127.0.0.1:{proc.wait_ready(60)['grpc_port']}"
        plain = StoreClient.connect(address, timeout=10, ident=None)
        try:
            plain.list_runs()  # plaintext, no identity, no authorization
        finally:
            plain.close()
        log = proc.log_path.read_text()
        assert "INSECURE: gRPC server on 127.0.0.1:0 without TLS or identities" in log, log
        # a client that insists on TLS gets no answer from a plaintext server
        tls = StoreClient.connect(address, timeout=3, ident=conftest.as_identity("admin"))
        try:
            with pytest.raises(grpc.RpcError) as err:
                tls.list_runs()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            tls.close()
    finally:
        proc.stop()


def test_insecure_mode_is_refused_off_loopback(tmp_path: Path, redis_url: str) -> None:
    last = _refused(_store(tmp_path, redis_url, "0.0.0.0:0", HARNESSRL_INSECURE="1"))
    assert "0.0.0.0:0: insecure mode (HARNESSRL_INSECURE=1) is refused off loopback" in last


def test_a_service_without_an_identity_refuses_to_start(tmp_path: Path, redis_url: str
                                                        ) -> None:
    assert not (tmp_path / identity.LOCAL_STACK_OPERATOR).exists()
    last = _refused(_store(tmp_path, redis_url, "127.0.0.1:0"))
    assert "no identity for gRPC: set HARNESSRL_TLS_DIR" in last, last
    assert os.environ.get(identity.TLS_DIR_ENV)  # the test process keeps its own (admin)
