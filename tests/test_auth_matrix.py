"""The authorization matrix (issue 40): every RPC of every service, called with each identity
and with none, against the real servers: the store and the gateway (stub engine) and the
controller as processes, the trainer's real servicer in a server thread of this process.

The RPCs come from the generated descriptors (harnessrl/v1/*_pb2.py), so a new RPC, or a new
service, is in the matrix without a change here (a service not served below fails the first
test). Each identity the session's CA issued (tests/conftest.py), plus `stranger`, a
certificate of the same CA with a name the table does not know, calls each RPC once:

- allowed where harnessrl/authz.py says (`authz.allowed`; a grader without a scope token is
  allowed nothing): the handler answers (any status but a refusal or a transport failure;
  requests are empty or "probes", so NOT_FOUND or INVALID_ARGUMENT are answers too);
- everywhere else PERMISSION_DENIED naming the identity and the RPC, the handler never run (the
  probes' effects stay absent), each refusal counted in the store's
  `harnessrl_rpc_refused_total`.

Callers with no certificate of this CA never reach an RPC: see the test's docstring.

The expectation is `authz.allowed` itself: this file shows the servers enforce the table,
whatever it says. That the table is the one docs/security.md shows is tests/test_auth_docs.py's
check, so an edit of RULES alone fails there, not here.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.request import urlopen

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import conftest
from conftest import GatewayService, StubEngineService
from harnessrl import authz, identity, pki, procs, rpc
from harnessrl import v1 as generated
from harnessrl.clients import ControllerClient, GatewayAdminClient, StoreClient
from harnessrl.testing.grpc_fuzz import Rpc, call
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import controller_pb2 as cpb
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.v1 import store_pb2 as spb
from harnessrl.v1 import trainer_pb2 as tpb

# Every identity of the CA, and one it issued under a name no rule knows.
STRANGER = "stranger"
IDENTITIES = (*pki.ALL_IDENTITIES, STRANGER)
# The service each generated gRPC service is served by (its certificate's name).
PEER = {"harnessrl.v1.Store": "store", "harnessrl.v1.Controller": "controller",
        "harnessrl.v1.GatewayAdmin": "gateway", "harnessrl.v1.Trainer": "trainer"}
# RPCs that wait by design (for groups, a run's end, a step, a drain): an allowed call may run
# into its deadline (the handler ran: it was waiting).
MAY_WAIT = {"ReadGroups", "WatchRun", "CheckpointNow", "Pause", "RemoveAdapter", "Sync"}
# Statuses that say the handler did not answer: a refusal, or no server behind the channel.
NOT_ANSWERED = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED,
                grpc.StatusCode.UNKNOWN}
TIMEOUT_S = 3.0
T = TypeVar("T")

PROBE = "matrix-probe"


def probe_requests(stub_url: str) -> dict[str, bytes]:
    """Requests whose handler, had it run, leaves a trace `Stack.effects` sees; every other RPC
    is called with its empty request."""
    spec = c.RunSpec(name="probe", tasks=[c.Task(task_id="t", data_json="{}")],
                     harness_command=["/bin/true"], grader_command=["/bin/true"],
                     reward_source=c.REWARD_SOURCE_GRADER_EXIT_CODE, stream="-", timeout_s=5)
    msgs = {
        "/harnessrl.v1.Store/PutRun": spb.PutRunRequest(run=c.Run(
            run_id=PROBE, spec=c.RunSpec(name="probe"))),
        "/harnessrl.v1.Store/CreateRollouts": spb.CreateRolloutsRequest(rollouts=[c.Rollout(
            rollout_id=f"{PROBE}/g/0", run_id=PROBE, task_id="t", group_id=f"{PROBE}/g",
            group_size=1, max_attempts=1, stream="-")]),
        "/harnessrl.v1.Store/PutState": spb.PutStateRequest(namespace="matrix", key=PROBE,
                                                            value=b"x"),
        "/harnessrl.v1.Controller/CreateRun": cpb.CreateRunRequest(spec=spec,
                                                                   run_id=f"{PROBE}-c"),
        "/harnessrl.v1.GatewayAdmin/RegisterEngine": gpb.RegisterEngineRequest(
            engine=gpb.Engine(name=PROBE, base_url=stub_url, model="tiny")),
        "/harnessrl.v1.GatewayAdmin/Pause": gpb.PauseRequest(engines=["e0"]),  # no drain
        # not e0: an allowed Resume would undo the Pause probe's trace
        "/harnessrl.v1.GatewayAdmin/Resume": gpb.ResumeRequest(engines=[PROBE]),
        "/harnessrl.v1.Trainer/Stop": tpb.StopRequest(skip_checkpoint=True),
        "/harnessrl.v1.Trainer/CheckpointNow": tpb.CheckpointNowRequest(),
    }
    return {path: m.SerializeToString() for path, m in msgs.items()}


def proto_services() -> dict[str, list[Rpc]]:
    """Every service of the generated protos -> its RPCs (with their empty request)."""
    out: dict[str, list[Rpc]] = {}
    for mod in pkgutil.iter_modules(generated.__path__):
        if mod.name.endswith("_pb2"):
            module = importlib.import_module(f"harnessrl.v1.{mod.name}")
            for svc in module.DESCRIPTOR.services_by_name.values():
                out[svc.full_name] = [Rpc(svc.full_name, m, m.input_type._concrete_class())
                                      for m in svc.methods]
    return out


def expected_allowed(ident: str, method: str) -> bool:
    """The table's answer for a caller without a scope token (a grader needs one for all it
    may call, so it is allowed nothing here; tests/test_auth_identity.py gives it tokens)."""
    if ident == authz.GRADER and method in authz.SCOPED:
        return False
    return authz.allowed(ident, method)


def refused_counts(metrics_port: int) -> Counter[tuple[str, str, str, str]]:
    """`harnessrl_rpc_refused_total` of a service's /metrics, by (service, method, identity,
    code)."""
    text = urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    out: Counter[tuple[str, str, str, str]] = Counter()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "harnessrl_rpc_refused_total":
                lb = s.labels
                out[(lb["service"], lb["method"], lb["identity"], lb["code"])] = int(s.value)
    return out


class StandInLoop:
    """The training loop's side of `TrainerControl`, as `train_sync` answers it between steps:
    a step every 50 ms, checkpoint requests answered (and counted)."""

    def __init__(self) -> None:
        from services.trainer.control import TrainerControl

        self.control = TrainerControl()
        self.checkpoints = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step = 0
        while not self._stop.wait(0.05):
            step += 1
            self.control.update(step=step)
            for fut in self.control.take_checkpoint_requests():
                self.checkpoints += 1
                fut.set_result((f"/ckpt/step-{step}", step))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Stack:
    addresses: dict[str, str]  # service full name -> host:port
    store_metrics_port: int
    stub_url: str
    loop: StandInLoop
    admin: dict[str, object] = field(default_factory=dict)

    def effects(self) -> dict[str, bool]:
        """Which probe requests' traces exist (read as admin)."""
        store = self.admin["store"]
        ctl = self.admin["controller"]
        gw = self.admin["gateway"]
        assert isinstance(store, StoreClient) and isinstance(ctl, ControllerClient)
        assert isinstance(gw, GatewayAdminClient)

        def found(get: Callable[[str], object], key: str) -> bool:
            try:
                get(key)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.NOT_FOUND, err
                return False
            return True

        engines = gw.list_engines().engines
        return {
            "store: run": found(store.get_run, PROBE),
            "store: rollout": found(store.get_rollout, f"{PROBE}/g/0"),
            "store: state": store.get_state("matrix", PROBE) is not None,
            "controller: run": found(ctl.get_run, f"{PROBE}-c"),
            "gateway: engine": any(e.name == PROBE for e in engines),
            "gateway: paused": any(e.paused for e in engines if e.name == "e0"),
            "trainer: stop": self.loop.control.stop_requested,
            "trainer: checkpoint": self.loop.checkpoints > 0,
        }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    from services.trainer.server import ServerThread

    tmp = tmp_path_factory.mktemp("authz-matrix")
    (tmp / "secret").write_text("matrix-secret-0123456789abcdef0123")
    started: list[Callable[[], None]] = []

    def store() -> tuple[procs.ServiceProcess, dict[str, int]]:
        return procs.start_service(
            "store", "services.store",
            ["--bind", "127.0.0.1:0", "--redis-url", redis_url, "--key-prefix",
             f"m{uuid.uuid4().hex[:8]}:", "--metrics-bind", "127.0.0.1:0"], tmp / "store",
            timeout=60)

    def controller(store_addr: str) -> tuple[procs.ServiceProcess, dict[str, int]]:
        return procs.start_service(
            "controller", "services.controller",
            ["--bind", "127.0.0.1:0", "--store-address", store_addr,
             "--gateway-url", "http://127.0.0.1:9/v1", "--secret-file", str(tmp / "secret"),
             "--workdir-root", str(tmp / "rollouts"), "--max-jobs", "2",
             "--store-request-retry-s", "2", "--no-sandbox"], tmp / "controller", timeout=60)

    def keep(fut: Future[T], stop: Callable[[T], Callable[[], None]]) -> T:
        value = fut.result()
        started.append(stop(value))
        return value

    try:
        # two at a time (2 cores): the stub engine and the store, then the gateway and the
        # controller (they need the store's address)
        with ThreadPoolExecutor(2) as pool:
            f_stub = pool.submit(StubEngineService, tmp / "stub")
            f_store = pool.submit(store)
            try:
                stub = keep(f_stub, lambda x: x.proc.stop)
            finally:
                sproc, info = keep(f_store, lambda x: x[0].stop)
            store_addr = f"127.0.0.1:{info['grpc_port']}"
            f_gw = pool.submit(GatewayService, tmp / "gw", store_addr, [
                {"name": "e0", "base_url": stub.base_url, "model": "tiny"}])
            f_ctl = pool.submit(controller, store_addr)
            try:
                gateway = keep(f_gw, lambda x: x.stop)
            finally:
                _, cinfo = keep(f_ctl, lambda x: x[0].stop)
        loop = StandInLoop()
        started.append(loop.stop)
        trainer = ServerThread("127.0.0.1:0", loop.control,
                               ident=conftest.as_identity("trainer")).start()
        started.append(trainer.stop)
        s = Stack({"harnessrl.v1.Store": store_addr,
                   "harnessrl.v1.Controller": f"127.0.0.1:{cinfo['grpc_port']}",
                   "harnessrl.v1.GatewayAdmin": gateway.admin_address,
                   "harnessrl.v1.Trainer": f"127.0.0.1:{trainer.port}"},
                  info["metrics_port"], stub.base_url, loop)
        # the test process is admin (conftest), as every client below by default
        s.admin = {"store": StoreClient.connect(store_addr, timeout=10),
                   "controller": ControllerClient.connect(
                       s.addresses["harnessrl.v1.Controller"], timeout=10),
                   "gateway": GatewayAdminClient.connect(gateway.admin_address, timeout=10)}
        for client in s.admin.values():
            started.append(client.close)  # type: ignore[attr-defined]
        yield s
    finally:
        for stop in reversed(started):
            stop()


@pytest.fixture(scope="module")
def stranger() -> identity.Identity:
    """A certificate from the deployment's CA under a name the table does not know."""
    assert conftest.TEST_PKI is not None
    return identity.Identity.from_folder(pki.Pki(conftest.TEST_PKI).issue(STRANGER))


def test_every_service_of_the_protos_is_in_the_matrix(stack: Stack) -> None:
    services = proto_services()
    assert len(services) >= 4 and sum(map(len, services.values())) >= 40
    assert set(services) == set(stack.addresses), "a service of the protos nobody serves here"


def test_callers_without_a_certificate_of_this_ca_are_refused_at_the_handshake(
        stack: Stack, tmp_path: Path) -> None:
    """No client certificate, or one from another CA (named `admin`, even): every RPC fails
    UNAVAILABLE at the TLS handshake, no handler runs, and nothing is counted as a refused RPC.

    Python gRPC's server can require client certificates or not ask for them at all; it cannot
    request one and let the call through without it (gRPC core has
    REQUEST_CLIENT_CERTIFICATE_BUT_DONT_VERIFY, but grpcio exposes only
    `require_client_auth`). So a caller without our certificate is refused before any RPC
    exists: the interceptor's UNAUTHENTICATED (harnessrl/authz.py) is defence in depth that no
    mTLS server here can reach."""
    assert conftest.TEST_PKI is not None
    ca = (conftest.TEST_PKI / "admin" / "ca.crt").read_bytes()
    foreign = identity.Identity.from_folder(pki.Pki(tmp_path / "other-ca").issue("admin"))
    callers = {
        "no certificate": grpc.ssl_channel_credentials(root_certificates=ca),
        # trusts our CA for the server, so the server's check is what refuses it
        "another CA's admin": grpc.ssl_channel_credentials(ca, foreign.key, foreign.cert),
    }
    probes = probe_requests(stack.stub_url)
    before, counted = stack.effects(), refused_counts(stack.store_metrics_port)
    wrong: list[str] = []
    calls = 0
    for caller, creds in callers.items():
        for service, rpcs in proto_services().items():
            with grpc.secure_channel(stack.addresses[service], creds,
                                     options=identity.target_options(PEER[service])) as ch:
                for r in rpcs:
                    code, details = call(ch, r, probes.get(r.path, b""), TIMEOUT_S)
                    calls += 1
                    if code != grpc.StatusCode.UNAVAILABLE:
                        wrong.append(f"{caller}: {r.path}: {code.name} {details[:200]}")
    assert calls >= 80
    assert not wrong, "\n".join(wrong)
    assert stack.effects() == before, "a handler ran for a caller without our certificate"
    assert refused_counts(stack.store_metrics_port) == counted
    # the same channel, with a certificate of this CA, reaches the store (the refusal above
    # was the certificate's, not the address's)
    admin = conftest.as_identity("admin")
    with grpc.secure_channel(stack.addresses["harnessrl.v1.Store"],
                             grpc.ssl_channel_credentials(ca, admin.key, admin.cert),
                             options=identity.target_options("store")) as ch:
        r = next(r for r in proto_services()["harnessrl.v1.Store"] if r.method.name == "ListRuns")
        assert call(ch, r, b"", TIMEOUT_S)[0] == grpc.StatusCode.OK


def test_each_identity_may_call_exactly_what_the_table_allows(
        stack: Stack, stranger: identity.Identity) -> None:
    """Refusals first (each must leave no trace and be counted), then the allowed calls (each
    must reach its handler; together they leave every probe's trace)."""
    idents = {name: stranger if name == STRANGER else conftest.as_identity(name)
              for name in IDENTITIES}
    services = proto_services()
    probes = probe_requests(stack.stub_url)
    channels = {(name, svc): rpc.channel(stack.addresses[svc], PEER[svc], ident)
                for name, ident in idents.items() for svc in services}
    cells = [(name, r) for name in IDENTITIES for rpcs in services.values() for r in rpcs]
    denied = [cell for cell in cells if not expected_allowed(cell[0], cell[1].path)]
    allowed = [cell for cell in cells if expected_allowed(cell[0], cell[1].path)]
    assert len(cells) >= 360 and allowed and denied

    def run(cell: tuple[str, Rpc]) -> tuple[str, Rpc, grpc.StatusCode, str]:
        name, r = cell
        code, details = call(channels[(name, r.service)], r, probes.get(r.path, b""),
                             TIMEOUT_S)
        return name, r, code, details

    wrong: list[str] = []
    try:
        before, counted = stack.effects(), refused_counts(stack.store_metrics_port)
        with ThreadPoolExecutor(8) as pool:
            for name, r, code, details in pool.map(run, denied):
                if code != grpc.StatusCode.PERMISSION_DENIED or \
                        f"{name!r}" not in details or r.path not in details:
                    wrong.append(f"{name} -> {r.path}: expected PERMISSION_DENIED naming both, "
                                 f"got {code.name} {details[:200]}")
        after = stack.effects()
        wrong += [f"a refused call ran its handler: {k} {before[k]} -> {v}"
                  for k, v in after.items() if v != before[k]]
        assert not wrong, f"{len(wrong)} refusals differ from the table:\n" + "\n".join(wrong)
        # every refusal of the store counted once, with its labels
        delta = refused_counts(stack.store_metrics_port) - counted
        want = Counter((r.service, r.method.name, name, "PERMISSION_DENIED")
                       for name, r in denied if r.service == "harnessrl.v1.Store")
        assert delta == want, f"refusals counted {dict(delta - want)} more, " \
                              f"{dict(want - delta)} fewer than made"

        answers: Counter[str] = Counter()
        with ThreadPoolExecutor(8) as pool:
            for name, r, code, details in pool.map(run, allowed):
                answers[code.name] += 1
                waited = code == grpc.StatusCode.DEADLINE_EXCEEDED and \
                    r.method.name in MAY_WAIT
                if code in NOT_ANSWERED or (code == grpc.StatusCode.DEADLINE_EXCEEDED
                                            and not waited):
                    wrong.append(f"{name} -> {r.path}: expected an answer of its handler, got "
                                 f"{code.name} {details[:200]}")
        print(f"\n{len(denied)} cells refused, {len(allowed)} answered: {dict(answers)}")
        assert not wrong, f"{len(wrong)} answers differ from the table:\n" + "\n".join(wrong)
        # the allowed calls ran their handlers: every probe left its trace
        deadline = time.monotonic() + 10  # the controller's run reaches the store on its own
        while not all((after := stack.effects()).values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(after.values()), after
    finally:
        for ch in channels.values():
            ch.close()


def test_the_matrix_names_every_identity_the_table_names() -> None:
    """The identities called above are all those the table knows (a new identity in RULES
    would otherwise go untested)."""
    named = {who for row in authz.RULES.values() for who in row}
    assert len(named) >= 6 and named <= set(IDENTITIES) - {STRANGER}, named
