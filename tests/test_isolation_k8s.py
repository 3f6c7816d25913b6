"""Rollout isolation on Kubernetes (issue 41): the shipped NetworkPolicies, enforced by the fake
kubelet's pod network (`harnessrl/testing/fake_kube/pod_network.py`), keep a rollout pod to the
gateway.

The red-team harness (`harnessrl/testing/redteam_harness.py`, what an RL policy with a shell
would try) runs as the rollout: a Job of the shipped template and image that the controller's
Kubernetes backend creates, its pod a real container on the test's Docker daemon. It probes
the deployment's real Service names and ports (the store, the controller, the gateway's admin
port, the trainer, the engine, Redis). With the policies of k8s/base enforced, every probe is
refused or contained and its own key still reaches the gateway, by its Service name. With the
same endpoints and no policy (a cluster whose network plugin enforces none), the network
probes succeed: the test can fail. Either way the reward is the grader's.

The policy logic itself (which doors a pod of the shipped manifests gets) is checked without
Docker first."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import CONTROLLER_SA, REPO, TEST_SECRET, GatewayService, StubEngineService
from harnessrl import procs
from harnessrl.clients import ControllerClient, StoreClient
from harnessrl.testing.fake_kube.container_runtime import LABEL
from harnessrl.testing.fake_kube.pod_network import (Endpoint, egress_doors, load_policies,
                                                     service_ip)
from harnessrl.testing.fake_kube_apiserver import FakeKubeAPIServer
from harnessrl.v1 import common_pb2 as c

TEMPLATE = REPO / "examples" / "calc" / "k8s-job-template.yaml"
REDTEAM = REPO / "harnessrl" / "testing" / "redteam_harness.py"
NAMESPACE = "harnessrl"  # k8s/base's, where the controller's ServiceAccount makes the Jobs
# What a rollout pod carries: the template's pod labels.
ROLLOUT_LABELS = yaml.safe_load(TEMPLATE.read_text())["spec"]["template"]["metadata"]["labels"]
SHIPPED = load_policies(REPO / "k8s" / "base")


def deployment(ports: dict[str, dict[int, str]]) -> list[Endpoint]:
    """The deployment of k8s/base as endpoints: each Service's name, its pods' labels and its
    ports (Service port -> the host address of the process that stands for it)."""
    return [Endpoint(NAMESPACE, {"app.kubernetes.io/name": f"harnessrl-{name}"}, p,
                     (f"harnessrl-{name}", f"harnessrl-{name}.{NAMESPACE}.svc"))
            for name, p in ports.items()]


def test_the_shipped_policies_let_a_rollout_pod_reach_the_gateway_and_dns_only() -> None:
    endpoints = deployment({"gateway": {8080: "h:1", 50052: "h:2"}, "store": {50051: "h:3"},
                            "controller": {50053: "h:4"}, "trainer": {50054: "h:5"},
                            "engine": {8000: "h:6"}, "redis": {6379: "h:7"}})
    endpoints.append(Endpoint("kube-system", {"k8s-app": "kube-dns"}, {53: "h:8"}, ("dns",)))
    endpoints.append(Endpoint(NAMESPACE, {"app": "other"}, {8080: "h:9"}))  # the port, not it
    rollout = egress_doors(SHIPPED, NAMESPACE, ROLLOUT_LABELS, endpoints)
    assert [(d.address, d.port, d.target) for d in rollout] == [
        (service_ip(0), 8080, "h:1"), (service_ip(6), 53, "h:8")]
    # a pod of another namespace, or one the rollout policy does not select (the store's),
    # is not isolated by these policies: it reaches every port
    everything = {(d.address, d.port) for d in egress_doors(SHIPPED, "other", ROLLOUT_LABELS,
                                                            endpoints)}
    assert len(everything) == 9
    store_pod = {"app.kubernetes.io/name": "harnessrl-store"}
    assert {(d.address, d.port) for d in egress_doors(SHIPPED, NAMESPACE, store_pod,
                                                      endpoints)} == everything
    # the rollout policy needs both of its labels
    assert len(egress_doors(SHIPPED, NAMESPACE, {"harnessrl.dev/role": "rollout"},
                            endpoints)) == 9
    # the kube-dns rule wants the namespace too: a kube-dns pod elsewhere is no DNS
    moved = [Endpoint("elsewhere", e.labels, e.ports) if e.namespace == "kube-system" else e
             for e in endpoints]
    assert [d.port for d in egress_doors(SHIPPED, NAMESPACE, ROLLOUT_LABELS, moved)] == [8080]


# -- the red-team harness as a rollout pod -------------------------------------------------

# What a cluster without enforced policies lets through (Redis: the test session's has no
# password, so its PING shows the connection)
NETWORK_PROBES = ("connect_store", "connect_controller", "connect_gateway_admin",
                  "connect_engine", "redis")


def _docker(daemon: Any, *args: str) -> str:
    out = subprocess.run(["docker", *args], env=daemon.env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


class Deployment:
    """A store, a gateway (stub engine) and Redis on this machine, and a
    controller whose job backend is the fake cluster in container mode, its pods on their own
    network reaching these processes under k8s/base's Service names and ports."""

    def __init__(self, tmp: Path, redis_url: str, key_prefix: str, daemon: Any,
                 enforce: bool) -> None:
        self.tmp = tmp
        self.store, sinfo = procs.start_service(
            "store", "services.store", ["--bind", "127.0.0.1:0", "--redis-url", redis_url,
                                        "--key-prefix", key_prefix], tmp, timeout=30)
        self.store_address = f"127.0.0.1:{sinfo['grpc_port']}"
        self.stub = StubEngineService(tmp / "stub")
        self.gateway = GatewayService(tmp / "gateway", self.store_address, [
            {"name": "e0", "base_url": self.stub.base_url, "model": "tiny"}])
        controller_port = procs.free_port()  # (the pods' endpoints name it before it starts)
        redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        ports = {"gateway": {8080: f"127.0.0.1:{self.gateway.http_port}",
                             50052: self.gateway.admin_address},
                 "store": {50051: self.store_address},
                 "controller": {50053: f"127.0.0.1:{controller_port}"},
                 "engine": {8000: f"127.0.0.1:{self.stub.port}"},
                 "redis": {6379: f"127.0.0.1:{redis_port}"}}
        self.kube = FakeKubeAPIServer(
            tmp / "kube", kubelet="container", env={"DOCKER_HOST": daemon.host},
            rbac=[REPO / "k8s" / "base"], identity=CONTROLLER_SA,
            network_policies=[REPO / "k8s" / "base"] if enforce else [],
            endpoints=deployment(ports), pod_pids_limit=64).start()
        self.controller, cinfo = procs.start_service(
            "controller", "services.controller",
            ["--bind", f"127.0.0.1:{controller_port}", "--store-address", self.store_address,
             "--gateway-url", self.gateway.base_url,
             "--k8s.gateway-url", "http://harnessrl-gateway:8080/v1",
             "--workdir-root", str(tmp / "rollouts"), "--no-sandbox",
             "--default-backend", "kubernetes", "--k8s.job-template", str(TEMPLATE),
             "--k8s.kubeconfig", str(self.kube.kubeconfig)], tmp,
            env={"HARNESSRL_SECRET": TEST_SECRET}, timeout=60)
        self.controller_port = cinfo["grpc_port"]

    def close(self) -> None:
        for stop in (self.controller.stop, self.kube.stop, self.gateway.stop,
                     self.stub.proc.stop, self.store.stop):
            stop()


def run_redteam(dep: Deployment) -> tuple[c.Rollout, dict[str, Any]]:
    targets = {"secret_file": str(dep.tmp / "secret"), "workdir_root": str(dep.tmp / "rollouts"),
               "tasks_file": str(dep.tmp / "tasks.jsonl"), "tls": str(dep.tmp / "tls"),
               "tcp": {"store": "harnessrl-store:50051",
                       "controller": "harnessrl-controller:50053",
                       "gateway_admin": "harnessrl-gateway:50052",
                       "engine": "harnessrl-engine:8000"},
               "redis": "harnessrl-redis:6379", "gateway_port": 8080,
               "bomb": 200, "hog_mb": 600}
    source = REDTEAM.read_text()  # run as `python -c` (the image has no harnessrl)
    ctl = ControllerClient.connect(f"127.0.0.1:{dep.controller_port}")
    try:
        run = ctl.create_run(c.RunSpec(
            name="redteam-k8s", harness_command=["python", "-c", source, json.dumps(targets)],
            grader_command=["false"], reward_source=c.REWARD_SOURCE_GRADER_EXIT_CODE,
            timeout_s=300, concurrency=1, tasks=[c.Task(data_json="{}")]))
        list(ctl.watch_run(run.run_id, timeout=600))
    finally:
        ctl.close()
    store = StoreClient.connect(dep.store_address)
    try:
        [ro] = store.list_rollouts(run.run_id).rollouts
    finally:
        store.close()
    out = (Path(ro.attempts[-1].workdir) / "stdout.log").read_text().strip().splitlines()
    return ro, json.loads(out[-1])


@pytest.mark.containers
@pytest.mark.parametrize("enforced", [True, False], ids=["policies", "no-policies"])
def test_the_redteam_harness_as_a_rollout_pod(
        enforced: bool, tmp_path: Path, redis_url: str, key_prefix: str, docker_daemon: Any,
        example_image: str) -> None:
    dep = Deployment(tmp_path, redis_url, key_prefix, docker_daemon, enforced)
    try:
        ro, seen = run_redteam(dep)
    finally:
        dep.close()
    outcomes = {name: r["outcome"] for name, r in seen.items()}
    print(json.dumps({"enforced": enforced, "probes": seen}, indent=1))
    assert outcomes.pop("own_key") == "ok", seen["own_key"]  # the gateway, by its Service name
    # the reward is the grader's (`false`: 0.0), whatever the harness tried
    assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED and ro.has_reward and ro.reward == 0.0, ro
    network = {p: outcomes.pop(p) for p in NETWORK_PROBES}
    if enforced:
        assert set(network.values()) == {"refused"}, seen
    else:  # the control: the same pod, no policy enforced
        assert set(network.values()) == {"succeeded"}, seen
    assert all(o in ("refused", "contained") for o in outcomes.values()), seen
    assert outcomes["fork_bomb"] == outcomes["memory_hog"] == "contained", seen
    assert not _docker(docker_daemon, "ps", "-aq", "--filter", f"label={LABEL}={dep.kube.root}")
