"""The controller's Role (k8s/base/controller.yaml) is what the Kubernetes job backend needs,
no more and no less, shown against the fake API server enforcing RBAC
(`harnessrl.testing.fake_kube`).

One compact scenario of the backend, as a ServiceAccount: launch a Job and its Secret, follow
the pod through list and watch, read its log, clean up (delete the Job); launch a second Job,
close the backend, and a new backend (a restarted controller) adopts it and cancels it
(delete). It runs once as the controller's ServiceAccount with the Role of k8s/base, and once
for every (resource, verb) of that Role with that one grant removed, each in its own
namespace of one fake API server, all at the same time. With the whole Role it succeeds and
uses every grant; without any one grant it fails, and the API's 403 naming that resource and
verb is what the backend reports (an exception, a job's error or log, or its log).

And the admission plugin OwnerReferencesPermissionEnforcement (OpenShift): a Secret whose
ownerReference sets blockOwnerDeletion needs `update` on `jobs/finalizers`, which the Role
does not grant, so the backend's Secret sets none.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from harnessrl.testing.fake_kube.rbac import load_manifests
from harnessrl.testing.fake_kube_apiserver import FakeKubeAPIServer
from services.controller.backends import JobSpec
from services.controller.backends import k8s_manifests as manifests
from services.controller.backends.k8s_api import why
from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "k8s" / "base"
SA = "harnessrl-controller"
NS = "harnessrl"  # k8s/base's namespace (its kustomization)
IMAGE = "harnessrl/harness:dev"
TEMPLATE = {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
    "containers": [{"name": "harness", "image": IMAGE}]}}}}
PY = sys.executable
Grant = tuple[str, str, str]  # (apiGroup, resource, verb)


def controller_rbac() -> list[dict[str, Any]]:
    """k8s/base's ServiceAccount, Role and RoleBinding of the controller (as the fake loads
    them)."""
    return [o for o in load_manifests(BASE) if o["metadata"]["name"] == SA]


def role_rules() -> list[dict[str, Any]]:
    [role] = [o for o in controller_rbac() if o["kind"] == "Role"]
    return list(role["rules"])


GRANTS: list[Grant] = [(g, r, v) for rule in role_rules() for g in rule["apiGroups"]
                       for r in rule["resources"] for v in rule["verbs"]]


def without(rules: list[dict[str, Any]], grant: Grant) -> list[dict[str, Any]]:
    """The rules less one (group, resource, verb), everything else of them kept."""
    group, resource, verb = grant
    out = []
    for rule in rules:
        if group not in rule["apiGroups"] or resource not in rule["resources"] \
                or verb not in rule["verbs"]:
            out.append(rule)
            continue
        assert rule["apiGroups"] == [group], "split a rule of one API group only"
        if len(rule["resources"]) > 1:
            out.append({**rule, "resources": [r for r in rule["resources"] if r != resource]})
        if len(rule["verbs"]) > 1:
            out.append({**rule, "resources": [resource],
                        "verbs": [v for v in rule["verbs"] if v != verb]})
    return out


def in_namespace(ns: str, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The controller's ServiceAccount, Role (with `rules`) and RoleBinding, in `ns`."""
    objs = copy.deepcopy(controller_rbac())
    for obj in objs:
        obj["metadata"]["namespace"] = ns
        if obj["kind"] == "Role":
            obj["rules"] = rules
        for subject in obj.get("subjects") or []:
            subject["namespace"] = ns
    return objs


def case_namespace(grant: Grant) -> str:
    group, resource, verb = grant
    return f"without-{resource.replace('/', '-')}-{verb}"


FINALIZERS_NS = "with-jobs-finalizers"  # the Role plus update on jobs/finalizers


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeKubeAPIServer]:
    """One fake API server: k8s/base as it is (namespace harnessrl), and the controller's
    ServiceAccount and Role, less one grant, in a namespace per grant."""
    root = tmp_path_factory.mktemp("kube-rbac")
    variants = [o for grant in GRANTS
                for o in in_namespace(case_namespace(grant), without(role_rules(), grant))]
    variants += in_namespace(FINALIZERS_NS, role_rules() + [
        {"apiGroups": ["batch"], "resources": ["jobs/finalizers"], "verbs": ["update"]}])
    (root / "variants.yaml").write_text(yaml.safe_dump_all(variants))
    with FakeKubeAPIServer(root / "server", images=[IMAGE],
                           rbac=[BASE, root / "variants.yaml"]) as server:
        yield server


def backend(kube: FakeKubeAPIServer, ns: str) -> KubernetesBackend:
    return KubernetesBackend(KubernetesSettings(
        job_template=TEMPLATE, gateway_url="http://127.0.0.1:9/v1",
        kubeconfig=str(kube.serviceaccounts[f"{ns}/{SA}"]), relist_s=600.0, kill_grace_s=0.5))


def spec(tmp: Path, job_id: str, code: str) -> JobSpec:
    return JobSpec(job_id=job_id, argv=[PY, "-c", code], env={}, workdir=tmp / job_id,
                   timeout_s=60)


@dataclass
class Outcome:
    ok: dict[str, bool] = field(default_factory=dict)  # step -> it did what it should
    said: list[str] = field(default_factory=list)  # errors, job errors and logs

    def step(self, name: str, exc: BaseException) -> None:
        self.ok[name] = False
        self.said.append(why(exc) if isinstance(exc, ApiException) else str(exc))


async def scenario(kube: FakeKubeAPIServer, ns: str, tmp: Path) -> Outcome:
    out = Outcome()
    first = backend(kube, ns)
    try:
        await first.launch(spec(tmp, "done", "print('hello')"))
        r = await first.wait("done")
        log = r.stdout_path.read_text()
        out.said += [r.error, log]
        out.ok["run"] = r.succeeded and log == "hello\n"
        await first.cleanup("done")  # as the controller does after every job
    except Exception as exc:  # noqa: BLE001 - what the backend said is the outcome
        out.step("run", exc)
    try:
        await first.launch(spec(tmp, "left", "import time; time.sleep(60)"))
    except Exception as exc:  # noqa: BLE001
        out.step("launch", exc)
    await first.close()  # leaves "left" running for the next controller
    second = backend(kube, ns)
    try:
        out.ok["adopt"] = await second.adopt(spec(tmp, "left", "import time; time.sleep(60)"))
        await second.cancel("left", "scenario over")
        r = await second.wait("left")
        out.ok["cancel"] = r.cancelled
        out.said.append(r.error)
    except Exception as exc:  # noqa: BLE001
        out.step("adopt", exc)
    await second.close()
    return out


class Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def outcomes(kube: FakeKubeAPIServer, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Outcome]:
    """The scenario in every namespace, all at once; the backend's log lines go to each
    outcome (each 403 names its namespace, so one outcome's grant is told from another's)."""
    namespaces = [NS] + [case_namespace(g) for g in GRANTS]
    tmp = tmp_path_factory.mktemp("rbac-jobs")
    said = Said()
    logger = logging.getLogger("services.controller.backends.kubernetes")
    logger.addHandler(said)

    async def run_all() -> list[Outcome]:
        return list(await asyncio.gather(*(scenario(kube, ns, tmp / ns) for ns in namespaces)))
    try:
        results = asyncio.run(run_all())
    finally:
        logger.removeHandler(said)
    for outcome in results:
        outcome.said += said.lines
    return dict(zip(namespaces, results))


def test_the_role_suffices_and_every_grant_is_used(kube: FakeKubeAPIServer,
                                                  outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[NS]
    assert outcome.ok == {"run": True, "adopt": True, "cancel": True}, outcome.said
    sent = [q for q in kube.requests() if q["namespace"] == NS]
    assert {q["user"] for q in sent} == {f"system:serviceaccount:{NS}:{SA}"}
    assert not [q["forbidden"] for q in sent if q["forbidden"]]
    used = {(q["group"], q["resource"], q["verb"]) for q in sent}
    assert used == set(GRANTS), f"grants no request used: {set(GRANTS) - used}"


@pytest.mark.parametrize("grant", GRANTS, ids=lambda g: f"{g[1]}-{g[2]}")
def test_without_any_grant_the_backend_fails_with_the_403_naming_it(
        grant: Grant, outcomes: dict[str, Outcome]) -> None:
    group, resource, verb = grant
    ns = case_namespace(grant)
    outcome = outcomes[ns]
    assert not all(outcome.ok.values()), outcome.ok
    refused = (f'is forbidden: User "system:serviceaccount:{ns}:{SA}" cannot {verb} resource '
               f'"{resource}" in API group "{group}" in the namespace "{ns}"')
    assert any(refused in text for text in outcome.said), (refused, outcome.said)


# -- OwnerReferencesPermissionEnforcement ---------------------------------------------------

def with_block_owner_deletion(render: Any) -> Any:
    """render_secret as it was: its ownerReference with blockOwnerDeletion: true."""
    def render_secret(*args: Any) -> dict[str, Any]:
        secret = render(*args)
        secret["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] = True
        return secret
    return render_secret


@pytest.mark.parametrize("ns, block, refused", [
    (NS, True, True),              # the old Secret: 403 where the plugin runs
    (NS, False, False),            # the Secret the backend renders now
    (FINALIZERS_NS, True, False),  # the other way out: granting update on jobs/finalizers
], ids=["old-secret", "secret", "old-secret-with-finalizers-grant"])
async def test_owner_references_admission_and_block_owner_deletion(
        kube: FakeKubeAPIServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ns: str,
        block: bool, refused: bool) -> None:
    if block:
        monkeypatch.setattr(manifests, "render_secret",
                            with_block_owner_deletion(manifests.render_secret))
    b = backend(kube, ns)
    try:
        s = spec(tmp_path, f"owned-{int(block)}", "print('ran')")
        if refused:
            with pytest.raises(ApiException) as e:
                await b.launch(s)
            assert e.value.status == 403
            name = manifests.secret_name(manifests.job_name(s.job_id))
            assert why(e.value) == (
                f'403 Forbidden: secrets "{name}" is forbidden: cannot set blockOwnerDeletion '
                "if an ownerReference refers to a resource you can't set finalizers on: , "
                "<nil>")
            return
        await b.launch(s)
        r = await b.wait(s.job_id)
        assert r.succeeded and r.stdout_path.read_text() == "ran\n", r
        await b.cleanup(s.job_id)
    finally:
        await b.close()
