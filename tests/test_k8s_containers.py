"""Job pods as real containers: the fake API server's container mode (`--kubelet container`,
`harnessrl/testing/fake_kube/container_runtime.py`) runs the shipped Job template
(`examples/calc/k8s-job-template.yaml`, image harnessrl/example-harness) with the pods'
containers as Docker containers of that image. What only a container shows (uid, capabilities,
no-new-privileges, a read-only root) is read from inside one; a root pod under runAsNonRoot is
refused; a training step runs its rollouts as such Jobs, the harness reaching the gateway
from its container (isolated: its own network namespace under k8s/base's NetworkPolicies) and the grader container scoring it; and from a rollout pod the engine's
weight-update routes answer 401 and the gRPC services close the connection without a
certificate of the deployment's CA (issue 40), the pod holding no identity and no token.

Needs a Docker daemon (`docker_daemon`: skipped without one, failed with CI=true) and the
images (`built_images`)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

import conftest
from conftest import CONTROLLER_SA, REPO
from harnessrl.clients import StoreClient
from harnessrl.local.stack import Stack
from harnessrl.testing.fake_kube.container_runtime import LABEL
from harnessrl.testing.fake_kube.pod_network import Endpoint
from harnessrl.testing.fake_kube_apiserver import FakeKubeAPIServer
from harnessrl.v1 import common_pb2 as c
from services.controller.backends import k8s_manifests as manifests
from services.controller.backends.base import GraderStep, JobSpec
from test_trainer_loop import (  # noqa: F401  (the module's own stack)
    stack, start_k8s_controller, start_trainer)

pytestmark = pytest.mark.containers

TEMPLATE = REPO / "examples" / "calc" / "k8s-job-template.yaml"
IMAGE = conftest.EXAMPLE_IMAGE
# The harness and grader commands of the shipped run (paths inside the example image).
RUN_CONFIG = yaml.safe_load((REPO / "k8s" / "base" / "run-config.yaml").read_text())["data"]
HARNESS = json.loads(RUN_CONFIG["HARNESSRL_TRAINER_HARNESS_COMMAND"])
GRADER = json.loads(RUN_CONFIG["HARNESSRL_TRAINER_GRADER_COMMAND"])

# Runs in the harness container in place of the harness: what the container shows.
PROBE = """
import json, os
status = dict(line.split(':', 1) for line in open('/proc/1/status').read().splitlines())
def writes(path):
    try:
        with open(path, 'w') as f:
            f.write('x')
        return True
    except OSError as e:
        return e.strerror
print(json.dumps({
    'uid': status['Uid'].split(), 'gid': status['Gid'].split(),
    'capeff': status['CapEff'].strip(), 'nonewprivs': status['NoNewPrivs'].strip(),
    'seccomp': status['Seccomp'].strip(), 'cwd': os.getcwd(),
    'root': writes('/probe'), 'workspace': writes('/workspace/probe'),
    'task': json.load(open(os.environ['HARNESSRL_TASK_FILE'])),
    'key': os.environ.get('OPENAI_API_KEY'), 'path': os.environ['PATH'],
}))
"""


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory, docker_daemon: Any,
         example_image: str) -> Iterator[FakeKubeAPIServer]:
    """The fake API server with its kubelet in container mode, on the test daemon; the
    controller's ServiceAccount (RBAC of k8s/base). At the end no container of it is left."""
    server = FakeKubeAPIServer(tmp_path_factory.mktemp("fake-kube-ct"), kubelet="container",
                               env={"DOCKER_HOST": docker_daemon.host},
                               rbac=[REPO / "k8s" / "base"], identity=CONTROLLER_SA).start()
    try:
        yield server
    finally:
        server.stop()
        left = docker(docker_daemon, "ps", "-aq", "--filter", f"label={LABEL}={server.root}")
        assert not left, f"containers of the fake kubelet left behind: {left}"


def docker(daemon: Any, *args: str) -> str:
    out = subprocess.run(["docker", *args], env=daemon.env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def admin_apis(kube: FakeKubeAPIServer) -> tuple[Any, Any, Any]:
    from kubernetes import client

    api = kube.api_client(kube.admin_kubeconfig)
    return api, client.BatchV1Api(api), client.CoreV1Api(api)


def submit(kube: FakeKubeAPIServer, spec: JobSpec, template: dict[str, Any]) -> str:
    """Creates the Job and its Secret as the backend does (rendered from `template`), as the
    admin; returns the Job's name."""
    api, batch, core = admin_apis(kube)
    try:
        job = manifests.render_job(template, spec, namespace=kube.namespace,
                                   gateway_url="http://127.0.0.1:1/v1", ttl_after_finished_s=600,
                                   deadline_margin_s=30, termination_grace_s=2)
        created = batch.create_namespaced_job(kube.namespace, job)
        core.create_namespaced_secret(kube.namespace, manifests.render_secret(
            spec, job, created.metadata.uid))
        batch.patch_namespaced_job(job["metadata"]["name"], kube.namespace,
                                   {"spec": {"suspend": False}})
        return str(job["metadata"]["name"])
    finally:
        api.close()


def job_pod(kube: FakeKubeAPIServer, job: str, until: Any, timeout: float = 120) -> Any:
    """The Job's pod once `until(pod)` holds."""
    api, _, core = admin_apis(kube)
    try:
        deadline = time.monotonic() + timeout
        while True:
            pods = core.list_namespaced_pod(kube.namespace,
                                            label_selector=f"job-name={job}").items
            if pods and until(pods[0]):
                return pods[0]
            assert time.monotonic() < deadline, pods
            time.sleep(0.2)
    finally:
        api.close()


def pod_log(kube: FakeKubeAPIServer, pod: str, container: str) -> str:
    api, _, core = admin_apis(kube)
    try:
        return str(core.read_namespaced_pod_log(pod, kube.namespace, container=container))
    finally:
        api.close()


def delete_job(kube: FakeKubeAPIServer, job: str) -> None:
    from kubernetes import client

    api, batch, _ = admin_apis(kube)
    try:
        batch.delete_namespaced_job(job, kube.namespace, body=client.V1DeleteOptions(
            propagation_policy="Foreground"))
    finally:
        api.close()


def spec_for(job_id: str, argv: list[str], tmp_path: Path) -> JobSpec:
    task = {"id": "calc-probe", "question": "What is 2 + 2?", "answer": 4}
    return JobSpec(job_id=job_id, argv=argv, workdir=tmp_path / job_id, timeout_s=60,
                   env={"OPENAI_API_KEY": "probe-credential", "HARNESSRL_MODEL": "tiny",
                        "HARNESSRL_TASK_JSON": json.dumps(task)},
                   labels={"run": "probe"})


def finished(pod: Any) -> bool:
    return pod.status.phase in ("Succeeded", "Failed")


def test_the_shipped_template_runs_a_locked_down_container(kube: FakeKubeAPIServer,
                                                           tmp_path: Path) -> None:
    """The template's securityContext, as the harness container sees it: uid/gid 10001, no
    effective capabilities, no_new_privs, seccomp filtering, a read-only root file system, a
    writable /workspace, the task file from the Secret volume, the credential from the
    Secret, the image's PATH; the grader container after it reads the same workspace."""
    template = manifests.load_template(TEMPLATE)
    spec = spec_for("probe", ["python", "-c", PROBE], tmp_path)
    spec = JobSpec(**{**spec.__dict__, "grader": GraderStep(
        ["sh", "-c", "cat /workspace/probe; echo; id -u"], env={"HARNESSRL_MODEL": "tiny"})})
    name = submit(kube, spec, template)
    pod = job_pod(kube, name, finished)
    assert pod.status.phase == "Succeeded", pod.status
    harness = pod.status.init_container_statuses[0]
    assert harness.container_id.startswith("docker://") and harness.image_id.startswith("sha256:")
    seen = json.loads(pod_log(kube, pod.metadata.name, "harness").strip().splitlines()[-1])
    assert seen["uid"] == ["10001"] * 4 and seen["gid"] == ["10001"] * 4, seen
    assert int(seen["capeff"], 16) == 0 and seen["nonewprivs"] == "1", seen
    assert seen["seccomp"] == "2", seen   # seccompProfile RuntimeDefault: Docker's filter
    assert seen["root"] == "Read-only file system", seen
    assert seen["workspace"] is True and seen["cwd"] == "/workspace", seen
    assert seen["task"]["id"] == "calc-probe" and seen["key"] == "probe-credential", seen
    assert seen["path"].startswith("/opt/harness/bin:"), seen   # the image's ENV
    assert pod_log(kube, pod.metadata.name, "grader").split() == ["x", "10001"]
    delete_job(kube, name)


def test_root_under_run_as_non_root_is_refused(kube: FakeKubeAPIServer, tmp_path: Path) -> None:
    """runAsUser 0 with runAsNonRoot true: the kubelet does not start the container
    (CreateContainerConfigError, the kubelet's message), and never creates it."""
    template = manifests.load_template(TEMPLATE)
    template["spec"]["template"]["spec"]["securityContext"]["runAsUser"] = 0
    name = submit(kube, spec_for("root", ["id"], tmp_path), template)

    def refused(pod: Any) -> bool:
        statuses = pod.status.container_statuses or []
        return bool(statuses) and statuses[0].state.waiting is not None and \
            statuses[0].state.waiting.reason == "CreateContainerConfigError"
    pod = job_pod(kube, name, refused, timeout=60)
    assert "runAsUser breaks non-root policy" in pod.status.container_statuses[0].state \
        .waiting.message
    assert pod.status.phase == "Pending"
    delete_job(kube, name)


def test_an_image_the_daemon_lacks_cannot_be_pulled(kube: FakeKubeAPIServer,
                                                    tmp_path: Path) -> None:
    """The node's images are the daemon's: nothing is pulled, a missing one is ErrImagePull."""
    template = manifests.load_template(TEMPLATE)
    template["spec"]["template"]["spec"]["containers"][0]["image"] = "harnessrl/absent:0"

    def waiting(pod: Any) -> str:
        statuses = pod.status.container_statuses or []
        state = statuses[0].state.waiting if statuses else None
        return str(state.reason) if state is not None else ""
    name = submit(kube, spec_for("absent", ["true"], tmp_path), template)
    pod = job_pod(kube, name, lambda p: waiting(p) in ("ErrImagePull", "ImagePullBackOff"))
    assert "harnessrl/absent:0" in pod.status.container_statuses[0].state.waiting.message
    delete_job(kube, name)


def test_exec_failure_and_deletion(kube: FakeKubeAPIServer, tmp_path: Path,
                                   docker_daemon: Any) -> None:
    """A command the image lacks is a StartError (exit code 128, the runtime's message); a
    running container is stopped when its Job is deleted (SIGTERM, then SIGKILL after the
    grace period: `sleep` as pid 1 ignores SIGTERM) and removed with its pod."""
    template = manifests.load_template(TEMPLATE)
    missing = submit(kube, spec_for("missing", ["no-such-command"], tmp_path), template)
    pod = job_pod(kube, missing, finished)
    term = pod.status.container_statuses[0].state.terminated
    assert (pod.status.phase, term.exit_code, term.reason) == ("Failed", 128, "StartError")
    assert "no-such-command" in term.message and "not found" in term.message, term.message
    delete_job(kube, missing)

    sleeper = submit(kube, spec_for("sleeper", ["sleep", "600"], tmp_path), template)
    pod = job_pod(kube, sleeper, lambda p: p.status.phase == "Running")
    ours = ["ps", "-q", "--filter", f"label={LABEL}.pod={kube.namespace}/{pod.metadata.name}"]
    assert docker(docker_daemon, *ours)
    delete_job(kube, sleeper)
    api, _, core = admin_apis(kube)
    try:
        deadline = time.monotonic() + 60
        while core.list_namespaced_pod(kube.namespace,
                                       label_selector=f"job-name={sleeper}").items:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        api.close()
    assert not docker(docker_daemon, *ours[:1], "-a", *ours[1:])


@pytest.mark.vllm
def test_training_step_with_rollout_pods_as_containers(
        stack: Stack, tmp_path: Path, tiny_model_dir: Path,  # noqa: F811
        docker_daemon: Any, example_image: str) -> None:
    """A trainer step whose rollouts are Jobs of the shipped template with the example image,
    isolated (issue 41): each pod in a network namespace of its own under k8s/base's
    NetworkPolicies, the harness reaching the gateway by its Service name
    (harnessrl-gateway:8080, the only door its policy opens); the grader container scores it,
    the rollouts are recorded with their rewards."""
    gateway_port = int(stack.gateway_url.rsplit(":", 1)[1].split("/")[0])
    kube = FakeKubeAPIServer(
        tmp_path / "kube", kubelet="container", env={"DOCKER_HOST": docker_daemon.host},
        rbac=[REPO / "k8s" / "base"], identity=CONTROLLER_SA,
        network_policies=[REPO / "k8s" / "base"], endpoints=[Endpoint(
            "harnessrl", {"app.kubernetes.io/name": "harnessrl-gateway"},
            {8080: f"127.0.0.1:{gateway_port}"}, ("harnessrl-gateway",))]).start()
    controller, stack_like = start_k8s_controller(
        stack, tmp_path, TEMPLATE, kube.kubeconfig, "controller-k8s-ct",
        "--k8s.gateway-url", "http://harnessrl-gateway:8080/v1")
    try:
        trainer = start_trainer(stack_like, tmp_path, tiny_model_dir,  # type: ignore[arg-type]
                                "--steps", "1", "--tasks-per-step", "2", "--group-size", "3",
                                "--concurrency", "6", "--run-name", "k8sct",
                                "--stream", "k8sct", "--no-advantage.filter-zero-variance",
                                "--harness-command", json.dumps(HARNESS),
                                "--grader-command", json.dumps(GRADER))
        assert trainer.proc is not None and trainer.proc.wait(600) == 0, trainer.log_tail(80)
        requests = kube.requests()
        # every rollout pod was a container of the example image, each removed after its pod
        left = docker(docker_daemon, "ps", "-aq", "--filter", f"label={LABEL}={kube.root}")
    finally:
        controller.stop()
        kube.stop()
    assert not left
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["trained"], rows
    store = StoreClient.connect(stack.store_address)
    try:
        rollouts = store.list_rollouts(rows[0]["run_id"], include_calls=True).rollouts
    finally:
        store.close()
    assert len(rollouts) == rows[0]["rollouts"] == 6
    for ro in rollouts:
        assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED, ro
        assert ro.calls, ro   # the harness reached the gateway from its container
        workdir = Path(ro.attempts[-1].workdir)
        graded = json.loads((workdir / "grader.stdout.log").read_text().splitlines()[-1])
        assert ro.has_reward and ro.reward == graded["reward"] in (0.0, 1.0), (graded, ro)
    created = [q for q in requests if q["method"] == "POST" and
               q["path"].endswith("/jobs") and (q.get("body") or {}).get("metadata", {})
               .get("labels", {}).get("harnessrl.dev/run") == rows[0]["run_id"]]
    assert len(created) == 6
    assert {q["body"]["spec"]["template"]["spec"]["containers"][0]["image"]
            for q in created} == {IMAGE}


# Runs in a rollout pod's harness container (the example image: Python's standard library and
# the openai SDK, no gRPC) in place of the harness: what it can reach, and what it holds.
REACH = r"""
import json, os, socket, ssl, urllib.error, urllib.request
t = json.load(open(os.environ["HARNESSRL_TASK_FILE"]))
def http(method, path, key=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    req = urllib.request.Request(t["engine"] + path, method=method, headers=headers,
                                 data=json.dumps(t["bodies"].get(path, {})).encode()
                                 if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return repr(e)
H2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
def grpc_port(port, cert=None, tls=True):
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    if cert:
        ctx.load_cert_chain(*cert)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            s = ctx.wrap_socket(raw) if tls else raw
            s.sendall(H2)
            data = s.recv(64)
            return ("answered " + data.hex()) if data else "closed"
    except (ssl.SSLError, OSError) as e:
        return "refused: " + str(e)
for who in ("rogue", "issued"):
    for name in ("crt", "key"):
        with open(f"/workspace/{who}.{name}", "w") as f:
            f.write(t[f"{who}_{name}"])
rogue = ("/workspace/rogue.crt", "/workspace/rogue.key")
issued = ("/workspace/issued.crt", "/workspace/issued.key")
print(json.dumps({
    "engine": {p: [http("POST", p), http("POST", p, "not-an-engine-key-" * 2)]
               for p in t["routes"]},
    "health": http("GET", "/health"),
    "grpc": {n: {"no certificate": grpc_port(p), "another CA's": grpc_port(p, rogue),
                 "plaintext": grpc_port(p, tls=False), "control": grpc_port(p, issued)}
             for n, p in t["grpc"].items()},
    "env": sorted(k for k in os.environ if k.startswith(("HARNESSRL_TLS", "HARNESSRL_SCOPE",
                                                         "HARNESSRL_ENGINE", "HARNESSRL_INS"))),
    "token": os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount"),
    "identity": os.path.exists("/etc/harnessrl"),
    "task_dir": sorted(os.listdir("/var/run/harnessrl")),
}))
"""
# The engine's routes that change or stop it (vLLM dev mode, docs/vllm-cpu.md), and a
# completion: each must answer the pod 401.
ENGINE_ROUTES = ["/collective_rpc", "/update_weights", "/init_weight_transfer_engine",
                 "/start_weight_update", "/update_weight_version", "/pause", "/sleep",
                 "/wake_up", "/v1/load_lora_adapter", "/v1/chat/completions", "/tokenize"]


def test_a_rollout_pod_is_refused_by_the_engine_and_the_grpc_services(
        kube: FakeKubeAPIServer, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """An attempt the controller's Kubernetes backend runs as a Job of the shipped template,
    its harness a real container beside the services (host network, as if no NetworkPolicy
    held: the fake enforces none): the engine (the stub, behind harnessrl.engine_guard as vLLM
    runs it) answers every weight-update, pause, sleep, adapter and completion route 401 with no
    key or a wrong one, and /health 200; the store and the controller refuse the TLS handshake
    without a client certificate and with one of another CA that claims to be the controller,
    and answer no plaintext HTTP/2. The pod has no identity, no engine key, no service-account
    token; the Job references only its attempt's Secret, which holds only its credential and
    its task."""
    from harnessrl import pki, procs
    from harnessrl.clients import ControllerClient

    keys = tmp_path / "engine-keys"
    keys.write_text("the-engine-key-of-the-gateway-0123\n")
    stub, info = procs.start_service(
        "stub", "harnessrl.testing.stub_engine",
        ["--model", "tiny", "--weight-version", "v0", "--middleware",
         "harnessrl.engine_guard.RequireKey"], tmp_path,
        env={"HARNESSRL_ENGINE_KEYS_FILE": str(keys)}, timeout=30)
    engine = f"http://127.0.0.1:{info['http_port']}"
    store, sinfo = procs.start_service(
        "store", "services.store", ["--bind", "127.0.0.1:0", "--redis-url", redis_url,
                                    "--key-prefix", key_prefix], tmp_path, timeout=30)
    controller, cinfo = procs.start_service(
        "controller", "services.controller",
        ["--bind", "127.0.0.1:0", "--store-address", f"127.0.0.1:{sinfo['grpc_port']}",
         "--gateway-url", "http://127.0.0.1:9/v1", "--workdir-root", str(tmp_path / "rollouts"),
         "--no-sandbox", "--default-backend", "kubernetes", "--k8s.job-template",
         str(TEMPLATE), "--k8s.kubeconfig", str(kube.kubeconfig)], tmp_path,
        env={"HARNESSRL_SECRET": "s" * 40}, timeout=60)
    rogue = pki.Pki(tmp_path / "rogue-ca").issue("controller")  # a CA of its own
    assert conftest.TEST_PKI is not None
    issued = conftest.TEST_PKI / "reader"  # the control: a certificate of the deployment's CA
    bodies = {"/update_weight_version": {"new_version": "planted"},
              "/collective_rpc": {"method": "reload_weights"}}
    task = {"id": "reach", "engine": engine, "routes": ENGINE_ROUTES, "bodies": bodies,
            "grpc": {"store": sinfo["grpc_port"], "controller": cinfo["grpc_port"]},
            "rogue_crt": (rogue / "tls.crt").read_text(),
            "rogue_key": (rogue / "tls.key").read_text(),
            "issued_crt": (issued / "tls.crt").read_text(),
            "issued_key": (issued / "tls.key").read_text()}
    ctl = ControllerClient.connect(f"127.0.0.1:{cinfo['grpc_port']}")
    try:
        run = ctl.create_run(c.RunSpec(
            name="reach", harness_command=["python", "-c", REACH], grader_command=["true"],
            reward_source=c.REWARD_SOURCE_GRADER_EXIT_CODE, timeout_s=120, concurrency=1,
            tasks=[c.Task(data_json=json.dumps(task))]))
        events = list(ctl.watch_run(run.run_id, timeout=300))
        store_client = StoreClient.connect(f"127.0.0.1:{sinfo['grpc_port']}")
        try:
            [ro] = store_client.list_rollouts(run.run_id).rollouts
        finally:
            store_client.close()
        assert ro.status == c.ROLLOUT_STATUS_SUCCEEDED, (ro, events[-1])
        seen = json.loads((Path(ro.attempts[-1].workdir) / "stdout.log").read_text()
                          .strip().splitlines()[-1])
        # the key opens the same routes from here: the 401s are the guard's
        with_key = httpx.post(f"{engine}/update_weight_version", json={"new_version": "v1"},
                              headers={"Authorization": "Bearer "
                                       "the-engine-key-of-the-gateway-0123"}, timeout=10)
        weight = httpx.get(f"{engine}/weight_info", headers={
            "Authorization": "Bearer the-engine-key-of-the-gateway-0123"}, timeout=10)
        received = httpx.get(f"{engine}/stub/log", headers={  # what passed the guard
            "Authorization": "Bearer the-engine-key-of-the-gateway-0123"}, timeout=10).json()
        jobs = [q["body"] for q in kube.requests() if q["method"] == "POST"
                and q["path"].endswith("/jobs") and q["body"]["metadata"]["labels"]
                .get("harnessrl.dev/run") == run.run_id]
        secrets = [q["body"] for q in kube.requests() if q["method"] == "POST"
                   and q["path"].endswith("/secrets") and q["body"]["metadata"]["labels"]
                   .get("harnessrl.dev/run") == run.run_id]
    finally:
        ctl.close()
        controller.stop()
        store.stop()
        stub.stop()
    assert seen["engine"] == {p: [401, 401] for p in ENGINE_ROUTES}, (seen["engine"], received)
    assert seen["health"] == 200
    assert with_key.status_code == 200 and weight.json()["weight_version"] == "v1"
    # none of the pod's requests got past the guard: only the test's own, with the key
    assert [r["path"] for r in received if r["path"] in ENGINE_ROUTES] == [
        "/update_weight_version"], received
    def h2_settings(answer: str) -> bool:  # the server's first HTTP/2 frame: SETTINGS
        return answer.startswith("answered ") and answer.split()[1][6:8] == "04"
    for name, answers in seen["grpc"].items():
        # with a certificate of the CA the same probe gets the server's HTTP/2 preface...
        assert h2_settings(answers["control"]), (name, answers)
        # ...and without one the server closes the TLS connection before any HTTP/2
        for way in ("no certificate", "another CA's", "plaintext"):
            assert answers[way] == "closed" or answers[way].startswith("refused: "), \
                (name, way, answers)
    assert seen["env"] == [] and not seen["token"] and not seen["identity"], seen
    assert seen["task_dir"] == ["task.json"], seen
    [job] = jobs
    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert {v["name"] for v in pod["volumes"]} == {"harnessrl-workspace", "harnessrl-task"}
    refs = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} | {
        e["valueFrom"]["secretKeyRef"]["name"] for ct in pod["initContainers"] +
        pod["containers"] for e in ct.get("env", []) if "valueFrom" in e}
    [secret] = secrets
    assert refs == {secret["metadata"]["name"]}
    assert set(secret["stringData"]) == {manifests.SECRET_API_KEY, manifests.SECRET_TASK}
    assert conftest.TEST_PKI is not None  # the controller's keys, its own and the graders'
    for held in ("controller", "grader"):
        key = (conftest.TEST_PKI / held / "tls.key").read_text().strip().splitlines()[1]
        assert key not in json.dumps(job) and key not in json.dumps(secret), held
