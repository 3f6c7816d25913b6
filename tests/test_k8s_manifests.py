"""What the Kubernetes job backend renders (no API server needed): every Job and Secret is
valid for a current Kubernetes release (`kubernetes-validate`, strict), carries no
credential in its Job spec, and has a deterministic DNS-1123 name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest

from services.controller.backends import GraderStep, JobSpec
from services.controller.backends import k8s_manifests as m

REPO = Path(__file__).resolve().parent.parent
KUBE_VERSION = kubernetes_validate.latest_version()
TOKEN = "hrl1.secret-token-value-never-in-a-job"
TEMPLATES = sorted((REPO / "examples").glob("*/k8s-job-template.yaml")) + \
    sorted((REPO / "docs").glob("*.job-template.yaml"))

USER_TEMPLATE = {
    "apiVersion": "batch/v1", "kind": "Job",
    "metadata": {"labels": {"team": "agents"}},
    "spec": {"template": {"spec": {
        "containers": [
            {"name": "harness", "image": "registry.example.com/agent:{{task.version}}",
             "env": [{"name": "REPO", "value": "{{task.repo}}"}],
             "resources": {"requests": {"cpu": "500m", "memory": "1Gi"},
                           "limits": {"memory": "2Gi"}}},
            {"name": "grader", "image": "registry.example.com/grader:1"}]}}},
}


def job_spec(job_id: str = "run-1.abc123.h1", grader: bool = True,
             labels: dict[str, str] | None = None) -> JobSpec:
    task = {"id": "t/1", "repo": "https://example.com/x.git", "version": "1.4", "n": 3}
    env = {"OPENAI_BASE_URL": "http://127.0.0.1:8080/v1", "OPENAI_API_KEY": TOKEN,
           "HARNESSRL_RUN_ID": "run-1", "HARNESSRL_ROLLOUT_ID": "run-1/t/1/0",
           "HARNESSRL_ATTEMPT": "1", "HARNESSRL_TASK_ID": "t/1",
           "HARNESSRL_TASK_JSON": json.dumps(task), "HARNESSRL_TASK_N": "3",
           "HARNESSRL_WORKDIR": "/controller/side/path"}
    return JobSpec(
        job_id=job_id, argv=["python", "/app/harness.py"], env=env,
        workdir=Path("/tmp/unused"), timeout_s=120.5,
        labels=labels or {"run": "run-1", "rollout": "abc123", "attempt": "1",
                          "role": "harness"},
        grader=GraderStep(argv=["python", "/app/grade.py"],
                          env={k: v for k, v in env.items()
                               if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL")})
        if grader else None)


def render(spec: JobSpec, template: dict | None = None) -> dict:  # type: ignore[type-arg]
    return m.render_job(template or USER_TEMPLATE, spec, namespace="agents",
                        gateway_url="http://gateway.harnessrl.svc:8080/v1",
                        ttl_after_finished_s=600, deadline_margin_s=30, termination_grace_s=2)


@pytest.mark.parametrize("grader", [True, False])
@pytest.mark.parametrize("job_id", [
    "run-1.abc123.h1", "UPPER_case.weird..id-", "x" * 200, "...", "step-000042.9f8e7d6c5b4a.g3"])
def test_rendered_job_and_secret_validate(job_id: str, grader: bool) -> None:
    spec = job_spec(job_id, grader, labels={"run": "a" * 100, "rollout": "-bad-", "n": "1"})
    job = render(spec)
    kubernetes_validate.validate(job, KUBE_VERSION, strict=True)
    secret = m.render_secret(spec, job, "0b0e4c6e-0000-4000-8000-000000000001")
    kubernetes_validate.validate(secret, KUBE_VERSION, strict=True)
    name = job["metadata"]["name"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 55
    assert m.job_name(job_id) == name  # deterministic: a restarted controller finds it
    for value in job["metadata"]["labels"].values():
        assert len(value) <= 63
    assert job["metadata"]["annotations"][m.JOB_ID_ANNOTATION] == job_id


def test_job_shape_and_no_credential_in_it() -> None:
    spec = job_spec()
    job = render(spec)
    assert TOKEN not in json.dumps(job)
    js = job["spec"]
    assert js["backoffLimit"] == 0 and js["suspend"] is True
    # harness 120.5 s + grader 60 s + margin 30 s
    assert js["activeDeadlineSeconds"] == 211 and js["ttlSecondsAfterFinished"] == 600
    pod = js["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert js["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "rollout"
    [harness], [grader] = pod["initContainers"], pod["containers"]
    assert harness["image"] == "registry.example.com/agent:1.4"  # placeholders filled
    assert grader["image"] == "registry.example.com/grader:1"
    assert harness["command"] == ["python", "/app/harness.py"]
    assert grader["command"] == ["python", "/app/grade.py"]
    env = {e["name"]: e for e in harness["env"]}
    assert env["OPENAI_API_KEY"] == {"name": "OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": m.secret_name(job["metadata"]["name"]), "key": m.SECRET_API_KEY}}}
    assert env["OPENAI_BASE_URL"]["value"] == "http://gateway.harnessrl.svc:8080/v1"
    assert env["REPO"]["value"] == "https://example.com/x.git"
    assert env["HARNESSRL_WORKDIR"]["value"] == m.WORKSPACE
    assert env["HARNESSRL_TASK_FILE"]["value"] == f"{m.TASK_DIR}/task.json"
    genv = {e["name"] for e in grader["env"]}
    assert "OPENAI_API_KEY" not in genv and "OPENAI_BASE_URL" not in genv
    assert harness["resources"]["requests"]["cpu"] == "500m"
    secret = m.render_secret(spec, job, "uid-1")
    assert secret["stringData"][m.SECRET_API_KEY] == TOKEN
    assert json.loads(secret["stringData"][m.SECRET_TASK])["repo"] == "https://example.com/x.git"
    [owner] = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Job", job["metadata"]["name"],
                                                            "uid-1")


def test_without_grader_the_harness_is_the_container() -> None:
    job = render(job_spec(grader=False))
    pod = job["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert [ct["name"] for ct in pod["containers"]] == ["harness"]


@pytest.mark.parametrize("template, why", [
    ({"kind": "Deployment"}, "batch/v1 Job"),
    ({"kind": "Job", "spec": {"template": {"spec": {"containers": []}}}}, "harness container"),
    ({"kind": "Job", "spec": {"template": {"spec": {"containers": [{"name": "x"}]}}}},
     "harness container"),
    ({"kind": "Job", "spec": {"template": {"spec": {"containers": [
        {"name": "a", "image": "i"}, {"name": "b", "image": "i"}]}}}}, "two named"),
])
def test_bad_templates_are_refused(template: dict, why: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(m.TemplateError, match=why):
        m.check_template(template)


def test_unknown_placeholder_is_refused() -> None:
    t = json.loads(json.dumps(USER_TEMPLATE))
    t["spec"]["template"]["spec"]["containers"][0]["image"] = "x:{{task.nope}}"
    with pytest.raises(m.TemplateError, match="task.nope"):
        render(job_spec(), t)


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_templates_render_valid_jobs(path: Path) -> None:
    template = m.load_template(path)
    job = render(job_spec(), template)
    kubernetes_validate.validate(job, KUBE_VERSION, strict=True)


def test_a_template_ships_and_the_cluster_deployment_carries_the_same() -> None:
    import yaml

    assert TEMPLATES, "examples/*/k8s-job-template.yaml"
    docs = yaml.safe_load_all((REPO / "k8s" / "base" / "controller.yaml").read_text())
    [cm] = [d for d in docs if d and d["kind"] == "ConfigMap" and
            d["metadata"]["name"] == "harnessrl-job-template"]
    in_cluster = m.check_template(yaml.safe_load(cm["data"]["job.yaml"]))
    assert in_cluster == m.load_template(REPO / "examples" / "calc" / "k8s-job-template.yaml")


def test_grader_identity_travels_in_the_secret_and_never_to_the_harness() -> None:
    """A grader handed the `grader` identity and a scope token (services/controller/
    grader_access.py) gets both from the attempt's Secret; the Job holds neither, and the
    harness container neither."""
    pem, scope = '{"ca": "C", "cert": "CERT-PEM-VALUE", "key": "KEY-PEM-VALUE"}', "scope.tok.en"
    spec = job_spec()
    assert spec.grader is not None
    spec.grader.env.update({"HARNESSRL_TLS_PEM": pem, "HARNESSRL_SCOPE_TOKEN": scope})
    job = render(spec)
    kubernetes_validate.validate(job, KUBE_VERSION, strict=True)
    text = json.dumps(job)
    assert "KEY-PEM-VALUE" not in text and scope not in text
    [harness], [grader] = job["spec"]["template"]["spec"]["initContainers"], \
        job["spec"]["template"]["spec"]["containers"]
    assert not {e["name"] for e in harness["env"]} & {"HARNESSRL_TLS_PEM",
                                                       "HARNESSRL_SCOPE_TOKEN"}
    genv = {e["name"]: e for e in grader["env"]}
    secret_name = m.secret_name(job["metadata"]["name"])
    for name, key in m.SECRET_ENV[m.GRADER].items():
        assert genv[name] == {"name": name, "valueFrom": {"secretKeyRef": {
            "name": secret_name, "key": key}}}
    secret = m.render_secret(spec, job, "uid-1")
    kubernetes_validate.validate(secret, KUBE_VERSION, strict=True)
    assert secret["stringData"]["grader-tls-pem"] == pem
    assert secret["stringData"]["grader-scope-token"] == scope
    # without them, the Secret holds the harness's credential and the task only
    plain = job_spec()
    assert set(m.render_secret(plain, render(plain), "u")["stringData"]) == {
        m.SECRET_API_KEY, m.SECRET_TASK}


@pytest.mark.parametrize("where, name", [
    ("harness", "HARNESSRL_TLS_DIR"), ("harness", "HARNESSRL_TLS_PEM"),
    ("harness", "HARNESSRL_SCOPE_TOKEN"), ("grader", "HARNESSRL_TLS_DIR")])
def test_an_identity_for_the_harness_is_refused(where: str, name: str) -> None:
    spec = job_spec()
    assert spec.grader is not None
    (spec.env if where == "harness" else spec.grader.env)[name] = "x"
    with pytest.raises(ValueError, match=f"{where} container of a Job may not get {name}"):
        render(spec)
