"""Weight push under faults, the gateway's part: an engine whose own weights are not the
policy version the gateway records gets no call (`services/gateway/weightcheck.py`).

Real store, real gateway, stub engines that serve vLLM's `/weight_info` (no model: what an
engine holds is only its weight version here). The faults themselves, against a real vLLM
(the trainer and the engine killed mid-push, and the recovery pushes), are at the end of
`test_weight_transfer.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import TEST_SECRET, GatewayService, StoreService

from harnessrl import procs
from harnessrl.clients import GatewayAdminClient, StoreClient
from harnessrl.credentials import CredentialSigner
from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.weight_versions import incomplete

SIGNER = CredentialSigner(TEST_SECRET.encode())
PROBE_S = 0.2  # the gateway's probe / weight-check interval in these tests


def start_stub(workdir: Path, weight_version: str, port: int = 0) -> tuple[procs.ServiceProcess,
                                                                            str]:
    proc, info = procs.start_service(
        "stub", "harnessrl.testing.stub_engine",
        ["--model", "tiny", "--port", str(port), "--weight-version", weight_version], workdir,
        timeout=30)
    return proc, f"http://127.0.0.1:{info['http_port']}"


class Cluster:
    """Two stub engines e0, e1 at policy `version`, a gateway checking their weights."""

    def __init__(self, tmp: Path, store: StoreService, version: int) -> None:
        self.tmp = tmp
        self.stubs = {name: start_stub(tmp / name, str(version)) for name in ("e0", "e1")}
        self.gateway = GatewayService(
            tmp / "gw", store.address,
            [{"name": name, "base_url": url, "model": "tiny", "policy_version": version}
             for name, (_, url) in self.stubs.items()],
            "--engine-probe-interval-s", str(PROBE_S))
        self.admin = GatewayAdminClient.connect(self.gateway.admin_address)
        self.store = StoreClient.connect(store.address, timeout=10)
        self._n = 0

    def engine(self, name: str) -> gpb.Engine:
        return next(e for e in self.admin.list_engines().engines if e.name == name)

    def wait_for(self, name: str, check: Callable[[gpb.Engine], bool], what: str,
                 timeout: float = 20.0) -> gpb.Engine:
        deadline = time.monotonic() + timeout
        while True:
            eng = self.engine(name)
            if check(eng):
                return eng
            assert time.monotonic() < deadline, f"{name}: {what} not seen; now {eng}"
            time.sleep(0.05)

    def set_engine_version(self, name: str, version: str) -> None:
        """What the trainer's pusher sends the engine (`/update_weight_version`)."""
        httpx.post(f"{self.stubs[name][1]}/update_weight_version",
                   json={"new_version": version}, timeout=10).raise_for_status()

    def calls(self, n: int) -> list[tuple[str, int]]:
        """`n` chat calls, each of a fresh rollout; (engine, policy version) of each as the
        store recorded it."""
        out = []
        for _ in range(n):
            self._n += 1
            rid = f"run/t{self._n}/0"
            self.store.create_rollouts([c.Rollout(
                rollout_id=rid, run_id="run", task_id="t", group_id=f"run/t{self._n}",
                group_size=1, max_attempts=1, stream="-")])
            self.store.start_attempt(rid, 1)
            client = openai.OpenAI(base_url=self.gateway.base_url, api_key=SIGNER.mint(rid, 1, 60),
                                   max_retries=0, timeout=30)
            client.chat.completions.create(model="tiny",
                                           messages=[{"role": "user", "content": "hi"}])
            (call,) = self.store.get_rollout(rid, include_calls=True).calls
            out.append((call.engine, call.policy_version))
        return out

    def close(self) -> None:
        self.admin.close()
        self.store.close()
        self.gateway.stop()
        for proc, _ in self.stubs.values():
            proc.stop()


@pytest.fixture
def cluster(tmp_path: Path, store_service: StoreService) -> Iterator[Cluster]:
    cl = Cluster(tmp_path, store_service, version=6)
    yield cl
    cl.close()


def test_engine_left_with_an_interrupted_push_gets_no_call(cluster: Cluster) -> None:
    """A trainer killed mid-push leaves its engine paused in the gateway, paused in vLLM,
    and saying `incomplete:<v>`. Whoever resumes it in the gateway (an operator, a resume of
    all engines) finds it MARKED instead: no call reaches the mix of versions. A later push
    that completes (the recovery) brings it back."""
    for name in ("e0", "e1"):
        cluster.wait_for(name, lambda e: e.weight_version == "6", "weight version read")
    cluster.admin.pause(["e0"], drain=False)  # what the pusher's before_push hook does
    cluster.set_engine_version("e0", incomplete(7))  # its first step on the engine
    # ... and here the trainer died: no hook reports anything.
    time.sleep(3 * PROBE_S)  # the watch leaves a paused engine alone (a push may be running)
    assert cluster.engine("e0").state == gpb.ENGINE_STATE_READY

    cluster.admin.resume(["e0"])
    e0 = cluster.engine("e0")
    assert e0.state == gpb.ENGINE_STATE_MARKED and not e0.paused
    assert "interrupted weight push" in e0.reason and e0.weight_version == "incomplete:7"
    assert cluster.calls(6) == [("e1", 6)] * 6

    # Recovery: the restarted trainer pushes its last good version (6) again.
    cluster.admin.pause(["e0"], drain=False)
    cluster.set_engine_version("e0", "6")  # /finish_weight_update {"weight_version": "6"}
    cluster.admin.update_engine("e0", policy_version=6, state=gpb.ENGINE_STATE_READY)
    cluster.admin.resume(["e0"])
    assert cluster.engine("e0").state == gpb.ENGINE_STATE_READY
    assert ("e0", 6) in cluster.calls(4)


def test_restarted_engine_gets_no_call_until_pushed(cluster: Cluster) -> None:
    """An engine killed (-9) and restarted behind the gateway's back serves its checkpoint's
    weights (`default`), not the version the gateway records: it is counted unreachable while
    down, and checked (and MARKED) before it could take a call again."""
    cluster.wait_for("e0", lambda e: e.weight_version == "6", "weight version read")
    proc, url = cluster.stubs["e0"]
    port = int(url.rsplit(":", 1)[1])
    proc.kill()
    cluster.wait_for("e0", lambda e: "unreachable" in e.reason, "e0 counted unreachable")
    assert cluster.calls(3) == [("e1", 6)] * 3
    cluster.stubs["e0"] = start_stub(cluster.tmp / "e0-again", "default", port=port)
    e0 = cluster.wait_for("e0", lambda e: e.state == gpb.ENGINE_STATE_MARKED,
                          "restarted e0 MARKED")
    assert e0.weight_version == "default" and "checkpoint" in e0.reason
    assert cluster.calls(6) == [("e1", 6)] * 6

    cluster.set_engine_version("e0", "6")  # the recovery push
    cluster.admin.update_engine("e0", policy_version=6, state=gpb.ENGINE_STATE_READY)
    cluster.wait_for("e0", lambda e: e.state == gpb.ENGINE_STATE_READY and not e.reason,
                     "e0 back")
    assert ("e0", 6) in cluster.calls(4)
