"""The fake Kubernetes API server (a test double), driven through the official `kubernetes`
client exactly as the controller's Kubernetes job backend drives a real cluster."""

from __future__ import annotations

import base64
import copy
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from harnessrl.testing.fake_kube import rbac
from harnessrl.testing.fake_kube.objects import ApiError
from harnessrl.testing.fake_kube.rbac import Attributes, Authorizer, request_attributes
from harnessrl.testing.fake_kube_apiserver import FakeKubeAPIServer

IMAGE = "harnessrl/harness:dev"
NS = "default"
T = TypeVar("T")


def wait_for(what: str, fn: Callable[[], T], timeout: float = 15.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last value {value!r}")
        time.sleep(0.05)


# A ServiceAccount "reader" in default: some rules of each shape RBAC has.
READER_RBAC = """
apiVersion: v1
kind: ServiceAccount
metadata: {name: reader, namespace: default}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: reader, namespace: default}
rules:
  - {apiGroups: [""], resources: [secrets], resourceNames: [allowed], verbs: [get]}
  - {apiGroups: [batch], resources: ["*/status"], verbs: [get]}
  - {apiGroups: [""], resources: [pods], verbs: [list]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: reader, namespace: default}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: reader}
subjects: [{kind: ServiceAccount, name: reader, namespace: default}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: pod-logs}
rules: [{apiGroups: [""], resources: [pods/log], verbs: [get]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: pod-logs, namespace: other}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: pod-logs}
subjects: [{kind: ServiceAccount, name: reader, namespace: default}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: list-jobs}
rules: [{apiGroups: ["*"], resources: [jobs], verbs: [list]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: list-jobs}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: list-jobs}
subjects: [{kind: Group, name: "system:serviceaccounts:default"}]
"""


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeKubeAPIServer]:
    """The admin's kubeconfig (cluster-admin); `reader_*` fixtures: READER_RBAC's account."""
    root = tmp_path_factory.mktemp("kube")
    (root / "reader.yaml").write_text(READER_RBAC)
    server = FakeKubeAPIServer(root / "server", images=[IMAGE], node_cpu=4,
                               env={"FAKE_KUBE_SERVER_ONLY": "leaked"},
                               rbac=[root / "reader.yaml"])
    with server:
        yield server


@pytest.fixture(scope="module")
def api(kube: FakeKubeAPIServer) -> client.ApiClient:
    return kube.api_client()


@pytest.fixture
def batch(api: client.ApiClient) -> client.BatchV1Api:
    return client.BatchV1Api(api)


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


def load_yaml(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def container(command: list[str] | None, name: str = "main", image: str = IMAGE,
              **kw: Any) -> client.V1Container:
    return client.V1Container(name=name, image=image, command=command, **kw)


def make_job(name: str, containers: list[client.V1Container], *, labels: dict | None = None,
             init: list[client.V1Container] | None = None, volumes: list | None = None,
             grace: int = 1, **spec: Any) -> client.V1Job:
    spec.setdefault("backoff_limit", 0)
    return client.V1Job(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1JobSpec(template=client.V1PodTemplateSpec(
            metadata=client.V1ObjectMeta(labels={"app": "fake-kube-test"}),
            spec=client.V1PodSpec(restart_policy="Never", containers=containers,
                                  init_containers=init, volumes=volumes,
                                  termination_grace_period_seconds=grace)), **spec))


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def job_condition(batch: client.BatchV1Api, name: str, *types: str) -> client.V1JobCondition:
    def find() -> client.V1JobCondition | None:
        job = batch.read_namespaced_job(name, NS)
        return next((c for c in job.status.conditions or [] if c.type in types
                     and c.status == "True"), None)
    return wait_for(f"job {name} condition {types}", find)


def job_pods(core: client.CoreV1Api, name: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(NS, label_selector=f"job-name={name}").items


def the_pod(core: client.CoreV1Api, name: str) -> client.V1Pod:
    return wait_for(f"pod of job {name}", lambda: job_pods(core, name))[0]


def container_state(core: client.CoreV1Api, pod: str, state: str) -> Any:
    statuses = core.read_namespaced_pod(pod, NS).status.container_statuses or []
    return getattr(statuses[0].state, state) if statuses else None


def waiting_reason(core: client.CoreV1Api, pod: str) -> str | None:
    waiting = container_state(core, pod, "waiting")
    return waiting.reason if waiting else None


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def read_pid(path: Path) -> int:
    return int(wait_for(f"pid in {path}", lambda: path.exists() and path.read_text().strip()))


SLEEPER = "import os,sys,time; open(sys.argv[1],'w').write(str(os.getpid())); time.sleep(60)"


# ---------------------------------------------------------------------------- API surface


def test_requests_need_the_kubeconfig_token(kube: FakeKubeAPIServer) -> None:
    resp = httpx.get(f"{kube.url}/api/v1/namespaces/default/secrets", timeout=5)
    assert resp.status_code == 401
    assert resp.json()["reason"] == "Unauthorized"
    config = client.Configuration(host=kube.url, api_key={"authorization": "Bearer wrong"})
    with pytest.raises(ApiException) as e:
        client.CoreV1Api(client.ApiClient(config)).list_namespaced_secret(NS)
    assert e.value.status == 401


READER = "system:serviceaccount:default:reader"


def forbidden_status(call: Callable[[], Any]) -> dict[str, Any]:
    with pytest.raises(ApiException) as e:
        call()
    assert e.value.status == 403
    return dict(json.loads(e.value.body))


def not_found(call: Callable[[], Any]) -> bool:
    """The call was allowed (and found nothing)."""
    with pytest.raises(ApiException) as e:
        call()
    return bool(e.value.status == 404)


def test_rbac_decides_every_request_with_the_real_403(kube: FakeKubeAPIServer) -> None:
    api = kube.api_client(kube.serviceaccounts["default/reader"])
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    # resourceNames: that one name, and get only
    assert not_found(lambda: core.read_namespaced_secret("allowed", NS))
    assert forbidden_status(lambda: core.read_namespaced_secret("other", NS)) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f'secrets "other" is forbidden: User "{READER}" cannot get resource '
                   f'"secrets" in API group "" in the namespace "default"',
        "reason": "Forbidden", "details": {"name": "other", "kind": "secrets"}, "code": 403}
    assert forbidden_status(lambda: core.list_namespaced_secret(NS))["message"] == (
        f'secrets is forbidden: User "{READER}" cannot list resource "secrets" in API group '
        '"" in the namespace "default"')
    # */status: the subresource, not the object
    assert not_found(lambda: batch.read_namespaced_job_status("nope", NS))
    assert 'cannot get resource "jobs" in API group "batch"' in forbidden_status(
        lambda: batch.read_namespaced_job("nope", NS))["message"]
    # a Role grants in its namespace; a ClusterRole bound by a RoleBinding, in the binding's
    assert core.list_namespaced_pod(NS).items is not None
    assert "forbidden" in forbidden_status(lambda: core.list_namespaced_pod("other"))["message"]
    assert not_found(lambda: core.read_namespaced_pod_log("nope", "other"))
    assert forbidden_status(lambda: core.read_namespaced_pod_log("nope", NS))["message"] == (
        f'pods "nope" is forbidden: User "{READER}" cannot get resource "pods/log" in API '
        'group "" in the namespace "default"')
    # a ClusterRoleBinding to one of its groups: everywhere, and at the cluster scope
    assert batch.list_namespaced_job("other").items == []
    batch.list_job_for_all_namespaces()
    assert forbidden_status(lambda: core.list_pod_for_all_namespaces())["message"].endswith(
        'cannot list resource "pods" in API group "" at the cluster scope')
    # discovery for every identity; the test hooks are the admin's
    assert client.VersionApi(api).get_code().major
    token = {"Authorization": "Bearer " + (kube.serviceaccounts["default/reader"].parent
                                           / "token").read_text()}
    for path in ("/api", "/apis", "/healthz"):
        assert httpx.get(kube.url + path, headers=token, timeout=5).status_code == 200
    resp = httpx.get(kube.url + "/fake/stats", headers=token, timeout=5)
    assert resp.status_code == 403 and resp.json()["message"] == (
        f'forbidden: User "{READER}" cannot get path "/fake/stats"')
    sent = [r for r in kube.requests() if r["user"] == READER]
    assert {r["code"] for r in sent} == {200, 403, 404}
    assert all(r["forbidden"] for r in sent if r["code"] == 403)


@pytest.mark.parametrize("method, path, query, expect", [
    ("GET", "/api/v1/namespaces/ns/pods", {}, ("list", "pods", "", "ns", "")),
    ("GET", "/api/v1/namespaces/ns/pods", {"watch": "1"}, ("watch", "pods", "", "ns", "")),
    ("GET", "/api/v1/namespaces/ns/pods", {"fieldSelector": "metadata.name=p"},
     ("list", "pods", "", "ns", "p")),
    ("GET", "/api/v1/namespaces/ns/pods/p/log", {}, ("get", "pods/log", "", "ns", "p")),
    ("GET", "/apis/batch/v1/namespaces/ns/jobs/j/status", {},
     ("get", "jobs/status", "batch", "ns", "j")),
    ("POST", "/apis/batch/v1/namespaces/ns/jobs", {}, ("create", "jobs", "batch", "ns", "")),
    ("PATCH", "/apis/batch/v1/namespaces/ns/jobs/j", {}, ("patch", "jobs", "batch", "ns", "j")),
    ("PUT", "/api/v1/namespaces/ns/secrets/s", {}, ("update", "secrets", "", "ns", "s")),
    ("DELETE", "/api/v1/namespaces/ns/secrets/s", {}, ("delete", "secrets", "", "ns", "s")),
    ("DELETE", "/api/v1/namespaces/ns/secrets", {},
     ("deletecollection", "secrets", "", "ns", "")),
    ("GET", "/api/v1/pods", {}, ("list", "pods", "", "", "")),
    ("GET", "/api/v1/namespaces/ns", {}, ("get", "namespaces", "", "ns", "ns")),
    ("GET", "/apis/batch/v1", {}, ("get", "", "", "", "")),
    ("POST", "/version", {}, ("post", "", "", "", "")),
])
def test_request_attributes_are_the_real_servers(method: str, path: str,
                                                 query: dict[str, str], expect: tuple) -> None:  # type: ignore[type-arg]
    a = request_attributes(method, path, query)
    assert (a.verb, a.combined, a.group, a.namespace, a.name) == expect
    assert a.path == path


def test_owner_references_admission_on_update() -> None:
    """Changing ownerReferences needs delete on the object; blocking an owner needs update
    on its finalizers; an owner of an unknown kind cannot be blocked at all."""
    authz = Authorizer(load_yaml(READER_RBAC))
    reader = rbac.service_account("default", "reader")
    attrs = Attributes("patch", "", "secrets", "", "", "default", "s")
    old = {"metadata": {"name": "s"}}
    new = {"metadata": {"name": "s", "ownerReferences": [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "u"}]}}
    with pytest.raises(ApiError) as e:
        rbac.admit_owner_references(authz, reader, attrs, new, old)
    assert e.value.message == ('secrets "s" is forbidden: cannot set an ownerRef on a resource '
                               "you can't delete: , <nil>")
    rbac.admit_owner_references(authz, rbac.ADMIN, attrs, new, old)
    rbac.admit_owner_references(authz, reader, attrs, new, new)  # unchanged: nothing to check
    blocking = copy.deepcopy(new)
    blocking["metadata"]["ownerReferences"][0].update(kind="Widget", blockOwnerDeletion=True)
    with pytest.raises(ApiError, match="cannot find RESTMapping for APIVersion batch/v1 Kind "
                                       "Widget"):
        rbac.admit_owner_references(authz, rbac.ADMIN, attrs, blocking, None)


def test_secret_create_get_list_delete(core: client.CoreV1Api, kube: FakeKubeAPIServer) -> None:
    name = unique("creds")
    secret = client.V1Secret(metadata=client.V1ObjectMeta(name=name, labels={"t": name}),
                             string_data={"token": "s3cret"})
    created = core.create_namespaced_secret(NS, secret)
    assert created.metadata.uid and int(created.metadata.resource_version) > 0
    assert created.metadata.namespace == NS and created.metadata.creation_timestamp
    assert created.data == {"token": base64.b64encode(b"s3cret").decode()}
    assert created.string_data is None and created.type == "Opaque"
    assert core.read_namespaced_secret(name, NS).metadata.uid == created.metadata.uid

    with pytest.raises(ApiException) as e:
        core.create_namespaced_secret(NS, secret)
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "AlreadyExists"

    other = unique("other")
    core.create_namespaced_secret(NS, client.V1Secret(
        metadata=client.V1ObjectMeta(name=other, labels={"t": name, "extra": "1"})))
    listed = core.list_namespaced_secret(NS, label_selector=f"t={name}")
    assert sorted(s.metadata.name for s in listed.items) == sorted([name, other])
    assert int(listed.metadata.resource_version) >= int(created.metadata.resource_version)
    for selector, expected in ((f"t={name},extra", [other]), (f"t={name},!extra", [name]),
                               (f"t={name},extra!=1", [name]), (f"t in ({name},x),extra=1",
                                                                 [other])):
        got = [s.metadata.name for s in core.list_namespaced_secret(
            NS, label_selector=selector).items]
        assert got == expected, selector

    core.delete_namespaced_secret(name, NS)
    with pytest.raises(ApiException) as e:
        core.read_namespaced_secret(name, NS)
    assert e.value.status == 404 and json.loads(e.value.body)["reason"] == "NotFound"
    assert json.loads(e.value.body)["message"] == f'secrets "{name}" not found'
    core.delete_namespaced_secret(other, NS)

    posted = [r for r in kube.requests() if r["method"] == "POST"
              and r["path"] == "/api/v1/namespaces/default/secrets"]
    assert any(r["body"]["metadata"]["name"] == name and r["body"]["stringData"] ==
               {"token": "s3cret"} for r in posted)
    assert kube.stats()["created"]["Secret"] >= 2


def post_raw(kube: FakeKubeAPIServer, path: str, body: dict) -> tuple[int, dict]:
    """For bodies the client refuses to send itself (it rejects unknown fields)."""
    resp = httpx.post(kube.url + path, content=json.dumps(body).encode(), timeout=10,
                      headers={"Authorization": f"Bearer {kube.token}",
                               "Content-Type": "application/json"})
    return resp.status_code, resp.json()


@pytest.mark.parametrize("mutate, message", [
    (lambda j: j["metadata"].update(name="Bad_Name"), "metadata.name: Invalid value"),
    (lambda j: j["spec"]["template"]["spec"].update(restartPolicy="Always"),
     'spec.template.spec.restartPolicy: Unsupported value: "Always"'),
    (lambda j: j["spec"].update(surprise=1), "spec: unknown field 'surprise'"),
    (lambda j: j["spec"].update(selector={"matchLabels": {"a": "b"}}), "spec.selector"),
    (lambda j: j["metadata"].update(name="x" * 64), "must be no more than 63 characters"),
    (lambda j: j["metadata"].update(labels={"bad key!": "v"}), "metadata.labels"),
    (lambda j: j["spec"]["template"]["spec"].update(containers=[]),
     "spec.template.spec.containers: Required value"),
])
def test_invalid_job_is_rejected_and_not_stored(
        api: client.ApiClient, batch: client.BatchV1Api, kube: FakeKubeAPIServer,
        mutate: Callable[[dict], None], message: str) -> None:
    name = unique("invalid")
    body = api.sanitize_for_serialization(make_job(name, [container(["true"])]))
    mutate(body)
    before = kube.stats()["created"].get("Job", 0)
    if "unknown field" in message:
        code, status = post_raw(kube, "/apis/batch/v1/namespaces/default/jobs", body)
    else:
        with pytest.raises(ApiException) as e:
            batch.create_namespaced_job(NS, body)
        code, status = e.value.status, json.loads(e.value.body)
    assert code == 422 and status["reason"] == "Invalid" and status["code"] == 422
    assert status["message"].startswith(f'Job.batch "{body["metadata"]["name"]}" is invalid: ')
    assert message in status["message"]
    assert kube.stats()["created"].get("Job", 0) == before
    assert not batch.list_namespaced_job(NS, label_selector=f"job-name={name}").items


def test_pods_cannot_be_created_through_the_api(core: client.CoreV1Api) -> None:
    pod = client.V1Pod(metadata=client.V1ObjectMeta(name="bare"),
                       spec=client.V1PodSpec(containers=[container(["true"])]))
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod(NS, pod)
    assert e.value.status == 405


def test_watch_follows_a_label_selector_from_a_resource_version(
        core: client.CoreV1Api) -> None:
    tag = unique("w")
    start = core.list_namespaced_secret(NS).metadata.resource_version
    core.create_namespaced_secret(NS, client.V1Secret(
        metadata=client.V1ObjectMeta(name=f"{tag}-a", labels={"w": tag})))
    core.create_namespaced_secret(NS, client.V1Secret(
        metadata=client.V1ObjectMeta(name=f"{tag}-b", labels={"w": "other"})))
    core.patch_namespaced_secret(f"{tag}-a", NS, {"metadata": {"labels": {"w": "moved"}}})
    stream = list(watch.Watch().stream(
        core.list_namespaced_secret, NS, label_selector=f"w={tag}", resource_version=start,
        timeout_seconds=1, allow_watch_bookmarks=True))
    events = [(e["type"], e["object"].metadata.name) for e in stream if e["type"] != "BOOKMARK"]
    # leaving the selector reads as DELETED to a filtered watcher, as on a real server
    assert events == [("ADDED", f"{tag}-a"), ("DELETED", f"{tag}-a")]
    # the watch ends (timeoutSeconds) with a bookmark at the current resourceVersion
    assert stream[-1]["type"] == "BOOKMARK"
    assert int(stream[-1]["raw_object"]["metadata"]["resourceVersion"]) \
        >= int(stream[-2]["raw_object"]["metadata"]["resourceVersion"])


def test_watch_from_a_compacted_resource_version_gets_410(
        core: client.CoreV1Api, kube: FakeKubeAPIServer) -> None:
    old = core.list_namespaced_secret(NS).metadata.resource_version
    core.create_namespaced_secret(NS, client.V1Secret(metadata=client.V1ObjectMeta(
        name=unique("compact"))))
    kube.compact()
    with pytest.raises(ApiException) as e:
        list(watch.Watch().stream(core.list_namespaced_secret, NS, resource_version=old,
                                  timeout_seconds=1))
    assert e.value.status == 410 and "Expired" in e.value.reason
    # without a timeout the client retries once from the same version, then gives up too
    with pytest.raises(ApiException) as e:
        for _ in watch.Watch().stream(core.list_namespaced_secret, NS, resource_version=old):
            pass
    assert e.value.status == 410
    current = core.list_namespaced_secret(NS).metadata.resource_version
    assert list(watch.Watch().stream(core.list_namespaced_secret, NS,
                                     resource_version=current, timeout_seconds=1)) == []


# ---------------------------------------------------------------------------- Jobs and pods


def test_job_runs_to_completion_and_its_log_is_readable(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name = unique("hello")
    created = batch.create_namespaced_job(NS, make_job(
        name, [container(python("print('hello from', 'the pod')"))]))
    assert created.spec.selector.match_labels == {
        "batch.kubernetes.io/controller-uid": created.metadata.uid}
    seen = []
    for event in watch.Watch().stream(batch.list_namespaced_job, NS,
                                      field_selector=f"metadata.name={name}",
                                      resource_version=created.metadata.resource_version,
                                      timeout_seconds=15):
        status = event["object"].status
        seen.append((status.active, status.succeeded))
        if any(c.type == "Complete" for c in status.conditions or []):
            break
    assert (1, None) in seen
    job = batch.read_namespaced_job(name, NS)
    assert job.status.succeeded == 1 and job.status.start_time and job.status.completion_time
    assert [c.type for c in job.status.conditions] == ["SuccessCriteriaMet", "Complete"]
    pod = the_pod(core, name)
    assert pod.metadata.name.startswith(f"{name}-") and len(pod.metadata.name) == len(name) + 6
    assert pod.metadata.labels["batch.kubernetes.io/job-name"] == name
    assert pod.metadata.labels["controller-uid"] == job.metadata.uid
    assert pod.metadata.labels["app"] == "fake-kube-test"
    assert pod.metadata.owner_references[0].uid == job.metadata.uid
    assert pod.status.phase == "Succeeded"
    term = pod.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (0, "Completed")
    assert core.read_namespaced_pod_log(pod.metadata.name, NS, container="main") \
        == "hello from the pod\n"
    assert core.read_namespaced_pod_log(pod.metadata.name, NS, limit_bytes=5) == "hello"


def test_following_a_log_streams_until_the_container_ends(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name = unique("follow")
    script = ("import time\nfor i in range(3):\n"
              "    print('line', i, flush=True)\n    time.sleep(0.3)")
    batch.create_namespaced_job(NS, make_job(name, [container(python(script))]))
    pod = the_pod(core, name).metadata.name
    wait_for("container running", lambda: container_state(core, pod, "running"))
    lines = list(watch.Watch().stream(core.read_namespaced_pod_log, pod, NS))
    assert lines == ["line 0", "line 1", "line 2"]
    assert core.read_namespaced_pod_log(pod, NS, tail_lines=1) == "line 2\n"


def test_finished_job_is_deleted_after_its_ttl(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name = unique("ttl")
    batch.create_namespaced_job(NS, make_job(name, [container(["true"])],
                                             ttl_seconds_after_finished=0))
    wait_for("job deleted", lambda: not batch.list_namespaced_job(
        NS, field_selector=f"metadata.name={name}").items)
    assert not job_pods(core, name)


def test_pod_sees_only_its_declared_environment_in_a_fresh_directory(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name = unique("env")
    secret = unique("env-secret")
    core.create_namespaced_secret(NS, client.V1Secret(
        metadata=client.V1ObjectMeta(name=secret), string_data={"key": "from-secret"}))
    script = ("import json,os; env=open('/proc/self/environ','rb').read().split(b'\\0');"
              "print(json.dumps({'env': dict(e.decode().split('=',1) for e in env if e),"
              "'cwd': os.getcwd(), 'files': os.listdir('.')}))")
    env = [client.V1EnvVar(name="A", value="1"), client.V1EnvVar(name="B", value="$(A)-two"),
           client.V1EnvVar(name="S", value_from=client.V1EnvVarSource(
               secret_key_ref=client.V1SecretKeySelector(name=secret, key="key"))),
           client.V1EnvVar(name="POD", value_from=client.V1EnvVarSource(
               field_ref=client.V1ObjectFieldSelector(field_path="metadata.name")))]
    batch.create_namespaced_job(NS, make_job(name, [container(python(script), env=env)]))
    job_condition(batch, name, "Complete")
    pod = the_pod(core, name)
    out = json.loads(core.read_namespaced_pod_log(pod.metadata.name, NS))
    assert set(out["env"]) == {"PATH", "HOSTNAME", "HOME", "A", "B", "S", "POD"}
    assert out["env"]["B"] == "1-two" and out["env"]["S"] == "from-secret"
    assert out["env"]["POD"] == out["env"]["HOSTNAME"] == pod.metadata.name
    assert out["files"] == [] and out["cwd"].endswith(f"/pods/{NS}/{pod.metadata.name}/root")


def test_init_container_and_main_container_share_an_empty_dir(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name = unique("init")
    mount = [client.V1VolumeMount(name="work", mount_path="/shared")]
    init = container(python("import sys; open(sys.argv[1], 'w').write('made by init')")
                     + ["/shared/msg"], name="prepare", volume_mounts=mount)
    main = container(python("import sys; print(open(sys.argv[1]).read())"),
                     args=["/shared/msg"], volume_mounts=mount)
    batch.create_namespaced_job(NS, make_job(name, [main], init=[init], volumes=[
        client.V1Volume(name="work", empty_dir=client.V1EmptyDirVolumeSource())]))
    job_condition(batch, name, "Complete")
    pod = the_pod(core, name)
    assert pod.status.init_container_statuses[0].state.terminated.exit_code == 0
    assert core.read_namespaced_pod_log(pod.metadata.name, NS) == "made by init\n"


def test_suspended_job_gets_no_pod_until_resumed(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name = unique("suspended")
    batch.create_namespaced_job(NS, make_job(name, [container(python("print('ran')"))],
                                             suspend=True))
    job_condition(batch, name, "Suspended")
    time.sleep(0.4)
    assert job_pods(core, name) == []
    assert batch.read_namespaced_job(name, NS).status.start_time is None
    batch.patch_namespaced_job(name, NS, {"spec": {"suspend": False}})
    job_condition(batch, name, "Complete")
    job = batch.read_namespaced_job(name, NS)
    assert job.status.start_time and job.status.succeeded == 1


def test_missing_secret_blocks_the_pod_until_it_exists(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name, secret = unique("needs"), unique("late")
    env = [client.V1EnvVar(name="TOKEN", value_from=client.V1EnvVarSource(
        secret_key_ref=client.V1SecretKeySelector(name=secret, key="token")))]
    batch.create_namespaced_job(NS, make_job(
        name, [container(python("import os; print(os.environ['TOKEN'])"), env=env)]))
    pod = the_pod(core, name).metadata.name
    wait_for("CreateContainerConfigError",
             lambda: waiting_reason(core, pod) == "CreateContainerConfigError")
    status = core.read_namespaced_pod(pod, NS).status
    assert status.phase == "Pending"
    assert status.container_statuses[0].state.waiting.message == f'secret "{secret}" not found'
    core.create_namespaced_secret(NS, client.V1Secret(
        metadata=client.V1ObjectMeta(name=secret), string_data={"token": "now-here"}))
    job_condition(batch, name, "Complete")
    assert core.read_namespaced_pod_log(pod, NS) == "now-here\n"


def test_image_not_on_the_node_fails_to_pull(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name = unique("pull")
    batch.create_namespaced_job(NS, make_job(name, [container(["true"],
                                                              image="nope/missing:1")]))
    pod = the_pod(core, name).metadata.name
    wait_for("ImagePullBackOff", lambda: waiting_reason(core, pod) == "ImagePullBackOff")
    assert core.read_namespaced_pod(pod, NS).status.phase == "Pending"
    batch.delete_namespaced_job(name, NS, propagation_policy="Background")
    wait_for("pod removed", lambda: not job_pods(core, name))


def test_pod_asking_for_more_cpu_than_the_node_has_is_unschedulable(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name = unique("big")
    res = client.V1ResourceRequirements(requests={"cpu": "4500m"})
    batch.create_namespaced_job(NS, make_job(name, [container(["true"], resources=res)]))
    pod = the_pod(core, name).metadata.name

    def scheduled() -> client.V1PodCondition | None:
        conds = core.read_namespaced_pod(pod, NS).status.conditions or []
        return next((c for c in conds if c.type == "PodScheduled"), None)
    cond = wait_for("PodScheduled condition", scheduled)
    assert (cond.status, cond.reason) == ("False", "Unschedulable")
    assert core.read_namespaced_pod(pod, NS).status.phase == "Pending"
    batch.delete_namespaced_job(name, NS, body=client.V1DeleteOptions(
        propagation_policy="Foreground"))
    wait_for("job removed", lambda: not batch.list_namespaced_job(
        NS, field_selector=f"metadata.name={name}").items)
    assert not job_pods(core, name)


def test_active_deadline_fails_the_job_and_kills_its_process(
        batch: client.BatchV1Api, core: client.CoreV1Api, tmp_path: Path) -> None:
    name, pid_file = unique("deadline"), tmp_path / "pid"
    batch.create_namespaced_job(NS, make_job(
        name, [container(python(SLEEPER), args=[str(pid_file)])], active_deadline_seconds=1))
    pid = read_pid(pid_file)
    cond = job_condition(batch, name, "Failed")
    assert cond.reason == "DeadlineExceeded"
    assert process_gone(pid)
    assert job_pods(core, name) == []
    assert batch.read_namespaced_job(name, NS).status.failed == 1


def test_failing_container_uses_up_the_backoff_limit(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name = unique("fails")
    batch.create_namespaced_job(NS, make_job(
        name, [container(python("raise SystemExit(3)"))], backoff_limit=1))
    cond = job_condition(batch, name, "Failed")
    assert cond.reason == "BackoffLimitExceeded"
    pods = job_pods(core, name)
    assert len(pods) == 2 and batch.read_namespaced_job(name, NS).status.failed == 2
    term = pods[0].status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (3, "Error") and pods[0].status.phase == "Failed"

    no_command = unique("nocmd")
    batch.create_namespaced_job(NS, make_job(no_command, [container(None)]))
    job_condition(batch, no_command, "Failed")
    term = the_pod(core, no_command).status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (128, "StartError")


def test_deleting_a_job_kills_its_process_and_collects_what_it_owns(
        batch: client.BatchV1Api, core: client.CoreV1Api, kube: FakeKubeAPIServer,
        tmp_path: Path) -> None:
    name, pid_file = unique("owner"), tmp_path / "pid"
    job = batch.create_namespaced_job(NS, make_job(
        name, [container(python(SLEEPER), args=[str(pid_file)])]))
    owned = client.V1Secret(metadata=client.V1ObjectMeta(
        name=f"{name}-owned", owner_references=[client.V1OwnerReference(
            api_version="batch/v1", kind="Job", name=name, uid=job.metadata.uid)]))
    core.create_namespaced_secret(NS, owned)
    pid = read_pid(pid_file)
    batch.delete_namespaced_job(name, NS, body=client.V1DeleteOptions(
        propagation_policy="Background"))
    wait_for("process killed", lambda: process_gone(pid))
    wait_for("pod removed", lambda: not job_pods(core, name))
    wait_for("owned secret collected", lambda: not core.list_namespaced_secret(
        NS, field_selector=f"metadata.name={name}-owned").items)
    sent = [r for r in kube.requests() if r["method"] == "DELETE"
            and r["path"].endswith(f"/jobs/{name}")]
    assert sent[-1]["body"]["propagationPolicy"] == "Background"


def test_jobs_orphan_their_pods_by_default(
        batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    name = unique("orphan")
    batch.create_namespaced_job(NS, make_job(name, [container(["true"])]))
    job_condition(batch, name, "Complete")
    batch.delete_namespaced_job(name, NS)     # batch/v1's legacy default: Orphan
    time.sleep(0.3)
    pods = job_pods(core, name)
    assert len(pods) == 1 and not pods[0].metadata.owner_references
    core.delete_namespaced_pod(pods[0].metadata.name, NS)
    wait_for("pod removed", lambda: not job_pods(core, name))
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod_log(pods[0].metadata.name, NS)
    assert e.value.status == 404


def test_stopping_the_server_kills_pod_processes(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with FakeKubeAPIServer(tmp_path / "kube") as kube:
        batch = client.BatchV1Api(kube.api_client())
        batch.create_namespaced_job(NS, make_job(
            "sleeper", [container(python(SLEEPER), args=[str(pid_file)])], grace=30))
        pid = read_pid(pid_file)
    assert wait_for("process killed", lambda: process_gone(pid), timeout=5)
