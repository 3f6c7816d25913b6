"""Third-party clients, as docs/security.md ("Calling harnessrl from another language") shows
them: the Node example (examples/grpc_node, @grpc/grpc-js over mTLS) and grpcurl, run with the
commands written in the docs, against a real store process whose identity comes from
`python -m harnessrl.pki create`.

As `controller` the Node client writes a run, as `operator` it lists it, as `reader` it is
refused PERMISSION_DENIED naming the identity and the RPC. A client with no certificate, one
from another CA, or one that expects another service's name fails the TLS handshake. grpcurl
runs the same way where it is installed (Debian 12 has no package: skipped without it).

Needs node and examples/grpc_node's packages (scripts/setup.sh: npm ci there). Without node
the Node tests skip, except with CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from conftest import REPO
from harnessrl import procs
from harnessrl.v1 import store_pb2 as spb, store_pb2_grpc

DOC = REPO / "docs" / "security.md"
EXAMPLE = REPO / "examples" / "grpc_node"
IDENTITIES = ("store", "controller", "operator", "reader")


@dataclass
class Store:
    address: str
    pki: Path
    foreign: Path  # an operator certificate of another CA (with this deployment's ca.crt)


def make_pki(root: Path, *identities: str) -> Path:
    """`python -m harnessrl.pki create`, as the docs tell a deployment to run it."""
    args = [a for i in identities for a in ("--identity", i)]
    subprocess.run([sys.executable, "-m", "harnessrl.pki", "create", str(root), *args],
                   check=True, capture_output=True, timeout=60)
    return root


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Store]:
    tmp = tmp_path_factory.mktemp("auth_clients")
    pki = make_pki(tmp / "pki", *IDENTITIES)
    # Another deployment's operator that trusts this deployment's CA: only the server's check
    # of the client's certificate can refuse it.
    foreign = make_pki(tmp / "foreign", "operator")
    shutil.copyfile(pki / "operator" / "ca.crt", foreign / "operator" / "ca.crt")
    proc, info = procs.start_service(
        "store", "services.store",
        ["--bind", "127.0.0.1:0", "--redis-url", redis_url,
         "--key-prefix", f"t{uuid.uuid4().hex[:10]}:"],
        tmp / "store", env={"HARNESSRL_TLS_DIR": str(pki / "store")}, timeout=30)
    yield Store(f"127.0.0.1:{info['grpc_port']}", pki, foreign)
    proc.stop()


def doc_commands(program: str) -> list[str]:
    """The commands of the docs' section on other languages whose program is `program` (after
    any VAR=value assignments)."""
    text = DOC.read_text()
    section = text[text.index("## Calling harnessrl from another language"):]
    section = section[:section.index("\n## ", 1)]
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words.pop(0)
            if words and words[0] == program:
                out.append(line)
    assert out, f"docs/security.md shows no {program} command"
    return out


def run_doc_command(line: str, store: Store, pki: Path | None = None
                    ) -> subprocess.CompletedProcess[str]:
    """Runs one of the docs' commands as written, against `store`: the local stack's identity
    folders are the test's PKI (or `pki`), PORT its port."""
    root = pki or store.pki
    line = line.replace(".harnessrl/tls/", f"{root}/").replace("127.0.0.1:PORT", store.address)
    words = shlex.split(line)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESSRL_")}
    while re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return subprocess.run(words, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def node_ready() -> None:
    """Skips without node (fails with CI=true); fails when examples/grpc_node's packages are
    not those of its lock."""
    if shutil.which("node") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true and node is not installed (scripts/setup.sh installs npm)")
        pytest.skip("node is not installed (apt-get install nodejs npm, then scripts/setup.sh)")
    lock = json.loads((EXAMPLE / "package-lock.json").read_text())["packages"]
    for name in ("@grpc/grpc-js", "@grpc/proto-loader"):
        installed = EXAMPLE / "node_modules" / name / "package.json"
        have = json.loads(installed.read_text())["version"] if installed.exists() else None
        want = lock[f"node_modules/{name}"]["version"]
        if have != want:
            pytest.fail(f"examples/grpc_node/node_modules has {name} {have}, the lock {want}: "
                        "run scripts/setup.sh (npm ci in examples/grpc_node)")


def node_call(store: Store, tls_dir: Path, rpc: str, body: object
              ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESSRL_")}
    env["HARNESSRL_TLS_DIR"] = str(tls_dir)
    return subprocess.run(["node", str(EXAMPLE / "call.mjs"), store.address, rpc,
                           json.dumps(body)], env=env, capture_output=True, text=True,
                          timeout=60)


def refusal(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert result.returncode == 2, (result.stdout, result.stderr)
    return dict(json.loads(result.stderr.strip().splitlines()[-1]))


def test_node_client_calls_as_each_identity(store: Store) -> None:
    node_ready()
    run_id = f"node-{uuid.uuid4().hex[:8]}"
    wrote = node_call(store, store.pki / "controller", "Store/PutRun", {"run": {"run_id": run_id}})
    assert wrote.returncode == 0, wrote.stderr
    assert json.loads(wrote.stdout)["run_id"] == run_id

    listing, refused = doc_commands("node")
    listed = run_doc_command(listing, store)
    assert listed.returncode == 0, listed.stderr
    assert run_id in [r["run_id"] for r in json.loads(listed.stdout)["runs"]]

    assert refusal(run_doc_command(refused, store)) == {
        "code": "PERMISSION_DENIED",
        "details": "identity 'reader' may not call /harnessrl.v1.Store/PutRun"}


def test_node_client_of_another_ca_fails_the_handshake(store: Store) -> None:
    node_ready()
    listing = doc_commands("node")[0]
    assert refusal(run_doc_command(listing, store, pki=store.foreign))["code"] == "UNAVAILABLE"


def _python_list_runs(store: Store, creds: grpc.ChannelCredentials, name: str) -> grpc.RpcError:
    with grpc.secure_channel(store.address, creds,
                             options=[("grpc.ssl_target_name_override", name)]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            store_pb2_grpc.StoreStub(ch).ListRuns(spb.ListRunsRequest(), timeout=10)
    return err.value


def test_no_client_certificate_fails_the_handshake(store: Store) -> None:
    ca = (store.pki / "operator" / "ca.crt").read_bytes()
    err = _python_list_runs(store, grpc.ssl_channel_credentials(ca), "store.harnessrl")
    assert err.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_the_server_is_verified_by_its_service_name(store: Store) -> None:
    op = store.pki / "operator"
    creds = grpc.ssl_channel_credentials(*((op / n).read_bytes()
                                           for n in ("ca.crt", "tls.key", "tls.crt")))
    err = _python_list_runs(store, creds, "gateway.harnessrl")  # the store is not the gateway
    assert err.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_grpcurl_as_the_docs_show_it(store: Store) -> None:
    if shutil.which("grpcurl") is None:
        pytest.skip("grpcurl is not installed (no Debian 12 package; scripts/setup.sh installs "
                    "it where apt has one)")
    services, listing, refused = doc_commands("grpcurl")
    out = run_doc_command(services, store)
    assert out.returncode == 0, out.stderr
    assert "harnessrl.v1.Store" in out.stdout.split()

    run_id = f"grpcurl-{uuid.uuid4().hex[:8]}"
    node_ready()
    assert node_call(store, store.pki / "controller", "Store/PutRun",
                     {"run": {"run_id": run_id}}).returncode == 0
    out = run_doc_command(listing, store)
    assert out.returncode == 0, out.stderr
    runs = json.loads(out.stdout)["runs"]  # field names: proto names or lowerCamel
    assert run_id in [r.get("run_id", r.get("runId")) for r in runs]

    out = run_doc_command(refused, store)
    assert out.returncode == 64 + grpc.StatusCode.PERMISSION_DENIED.value[0], out.stderr
    assert "identity 'reader' may not call /harnessrl.v1.Store/PutRun" in out.stderr

    # Without a client certificate: no handshake, no call.
    bare = re.sub(r" -cert \S+ -key \S+", "", listing) + " "
    bare = bare.replace(" -authority", " -connect-timeout 2 -authority", 1)
    out = run_doc_command(bare, store)
    assert out.returncode != 0 and "runs" not in out.stdout, (out.stdout, out.stderr)
