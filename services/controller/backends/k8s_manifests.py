"""What the Kubernetes job backend sends to the API server: a `batch/v1` Job rendered from the
user's Job template for one `JobSpec`, and the per-attempt Secret that carries its credential.

The template is an ordinary Job manifest (YAML) with the user's harness image:

    apiVersion: batch/v1
    kind: Job
    spec:
      template:
        spec:
          containers:
            - name: harness            # the harness container (the first one if none is named so)
              image: registry.example.com/my-agent:1.4
              resources: {requests: {cpu: "1", memory: 2Gi}}
            - name: grader             # optional: the image graders run in (default: harness's)
              image: registry.example.com/my-grader:1.0

String values anywhere in it may hold placeholders, replaced per attempt: `{{task.FIELD}}` (a
top-level task field; non-strings as JSON), `{{run_id}}`, `{{rollout_id}}`, `{{attempt}}`,
`{{task_id}}`. What the backend sets, whatever the template says:

- `metadata.name`: `hrl-<readable part of the job id>-<hash>`, a DNS-1123 label of at most 55
  characters (the pods' `-xxxxx` suffix keeps their names within 63), the same for the same
  job id on every controller (that is how a restarted controller finds it again); labels
  `app.kubernetes.io/managed-by: harnessrl`, `harnessrl.dev/<key>` for each of the spec's
  labels, the job id in the annotation `harnessrl.dev/job-id`.
- `spec`: `backoffLimit: 0` (the controller owns retries), `activeDeadlineSeconds` = the
  attempt's timeout (and the grader's) plus `deadline_margin_s` (the controller ends the Job
  at its timeout itself, after saving the logs; the deadline ends it when no controller
  watches),
  `ttlSecondsAfterFinished`, `suspend: true` (the backend creates the Secret, then un-suspends
  the Job: no pod ever starts without its credential), `restartPolicy: Never`, no service
  account token in the pod, labels `app.kubernetes.io/component: rollout` and
  `harnessrl.dev/role: rollout` on the pod (the NetworkPolicy in k8s/ lets such pods reach
  the gateway only).
- The harness container: `command` = the run's `harness_command`; `env` = the job's
  environment, except `OPENAI_API_KEY`, which comes from the Secret (`secretKeyRef`), never as
  a value in the Job; `OPENAI_BASE_URL` = the gateway as pods reach it; `workingDir`
  `/workspace` (an `emptyDir`); the task as a file at `/var/run/harnessrl/task.json` (from the
  Secret).
- With a grader (`JobSpec.grader`): the harness runs as an init container and the grader as
  the pod's container after it, in the same `/workspace`, without the credential; its log is
  the grader's output. A grader's store identity and scope token
  (services/controller/grader_access.py), when it has them, come from the Secret too.
- No identity reaches the harness: a harness environment with one (`HARNESSRL_TLS_DIR`,
  `HARNESSRL_TLS_PEM`, `HARNESSRL_SCOPE_TOKEN`) is refused (ValueError), as is a folder path
  for the grader's.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from harnessrl.identity import SCOPE_TOKEN_ENV, TLS_DIR_ENV, TLS_PEM_ENV
from services.controller.backends.base import JobSpec

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "harnessrl"
LABEL_PREFIX = "harnessrl.dev/"
JOB_ID_ANNOTATION = "harnessrl.dev/job-id"
ROLLOUT_POD_LABELS = {"app.kubernetes.io/component": "rollout", "harnessrl.dev/role": "rollout"}
HARNESS, GRADER = "harness", "grader"
WORKSPACE = "/workspace"
TASK_DIR = "/var/run/harnessrl"
SECRET_API_KEY = "openai-api-key"
SECRET_TASK = "task.json"
CREDENTIAL_ENV = "OPENAI_API_KEY"
# Credentials by container: each from the attempt's Secret (secretKeyRef to the key named
# here), never a value in the Job, which more can read than its Secret.
SECRET_ENV = {HARNESS: {CREDENTIAL_ENV: SECRET_API_KEY},
              GRADER: {TLS_PEM_ENV: "grader-tls-pem", SCOPE_TOKEN_ENV: "grader-scope-token"}}
# What a container's environment may not hold at all (a harness gets no identity; a folder of
# the controller's means nothing in a pod).
REFUSED_ENV = {HARNESS: (TLS_DIR_ENV, TLS_PEM_ENV, SCOPE_TOKEN_ENV), GRADER: (TLS_DIR_ENV,)}
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[^\s{}]+)?)\s*\}\}")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


class TemplateError(ValueError):
    """The Job template cannot be used; the message says why."""


def _hash(text: str, n: int = 10) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def job_name(job_id: str) -> str:
    """A DNS-1123 label (<= 55 chars) for a job id: deterministic, unique per job id."""
    slug = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-")[:40].strip("-")
    return f"hrl-{slug}-{_hash(job_id)}" if slug else f"hrl-{_hash(job_id)}"


def secret_name(name: str) -> str:
    return f"{name}-cred"


def label_value(value: str) -> str:
    """`value` where it is a valid label value, else a readable prefix and a hash of it."""
    if _LABEL_VALUE.match(value):
        return value
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", value).strip("-_.")[:50].strip("-_.")
    return f"{slug}-{_hash(value)}" if slug else _hash(value)


def load_template(path: str | Path) -> dict[str, Any]:
    """Reads and checks a Job template file; `TemplateError` says what is wrong with it."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TemplateError(f"Job template {path}: {exc}") from None
    return check_template(data, str(path))


def check_template(data: Any, where: str = "Job template") -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("kind", "Job") != "Job" or \
            data.get("apiVersion", "batch/v1") != "batch/v1":
        raise TemplateError(f"{where}: must be a batch/v1 Job manifest")
    pod = (((data.get("spec") or {}).get("template") or {}).get("spec") or {})
    containers = pod.get("containers")
    if not isinstance(containers, list) or not containers or \
            not all(isinstance(ct, dict) and ct.get("image") for ct in containers):
        raise TemplateError(f"{where}: spec.template.spec.containers must list the harness "
                            "container, with its image")
    names = [ct.get("name") for ct in containers]
    extra = [n for n in names if n not in (HARNESS, GRADER)]
    if len(containers) > 2 or (len(containers) == 2 and set(names) != {HARNESS, GRADER}):
        raise TemplateError(f"{where}: give one container (the harness), or two named "
                            f"'harness' and 'grader'; found {names} ({extra} unexpected)")
    if pod.get("initContainers"):
        raise TemplateError(f"{where}: initContainers are the backend's (it runs the harness "
                            "as one when a grader follows)")
    return data


def _fill(value: Any, fields: dict[str, str]) -> Any:
    """The template value with its placeholders replaced (strings at any depth)."""
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            key = m.group(1)
            if key not in fields:
                raise TemplateError(f"Job template: no value for placeholder {{{{{key}}}}} "
                                    f"(known: {', '.join(sorted(fields))})")
            return fields[key]
        return _PLACEHOLDER.sub(sub, value)
    if isinstance(value, list):
        return [_fill(v, fields) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, fields) for k, v in value.items()}
    return value


def placeholder_values(spec: JobSpec) -> dict[str, str]:
    env = spec.env
    fields = {"run_id": env.get("HARNESSRL_RUN_ID", ""),
              "rollout_id": env.get("HARNESSRL_ROLLOUT_ID", ""),
              "attempt": env.get("HARNESSRL_ATTEMPT", ""),
              "task_id": env.get("HARNESSRL_TASK_ID", "")}
    try:
        task = json.loads(env.get("HARNESSRL_TASK_JSON", "{}"))
    except ValueError:
        task = {}
    for key, value in (task.items() if isinstance(task, dict) else ()):
        fields[f"task.{key}"] = value if isinstance(value, str) else json.dumps(value)
    return fields


def _env_list(role: str, env: dict[str, str], secret: str) -> list[dict[str, Any]]:
    refused = sorted(set(REFUSED_ENV[role]) & set(env))
    if refused:
        raise ValueError(f"the {role} container of a Job may not get {', '.join(refused)}")
    from_secret = SECRET_ENV[role]
    out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()
                                 if k not in from_secret and k != CREDENTIAL_ENV]
    for name, key in from_secret.items():
        if name in env:
            out.append({"name": name, "valueFrom": {
                "secretKeyRef": {"name": secret, "key": key}}})
    return out


def _container(base: dict[str, Any], name: str, argv: list[str], env: dict[str, str],
               secret: str) -> dict[str, Any]:
    ct = copy.deepcopy(base)
    ct["name"] = name
    ct["command"] = list(argv)
    ct.pop("args", None)  # the run's command is the whole argv
    env = {**env, "HARNESSRL_WORKDIR": WORKSPACE, "HARNESSRL_TASK_FILE": f"{TASK_DIR}/task.json"}
    ct["env"] = [e for e in ct.get("env", []) if e.get("name") not in env] + \
        _env_list(name, env, secret)
    ct["workingDir"] = WORKSPACE
    ct["volumeMounts"] = [m for m in ct.get("volumeMounts", [])
                          if m.get("mountPath") not in (WORKSPACE, TASK_DIR)] + [
        {"name": "harnessrl-workspace", "mountPath": WORKSPACE},
        {"name": "harnessrl-task", "mountPath": TASK_DIR, "readOnly": True}]
    return ct


def render_job(template: dict[str, Any], spec: JobSpec, *, namespace: str, gateway_url: str,
               ttl_after_finished_s: int, deadline_margin_s: float,
               termination_grace_s: int) -> dict[str, Any]:
    """The Job manifest for `spec` (created suspended; see the module docstring)."""
    job = _fill(copy.deepcopy(template), placeholder_values(spec))
    name = job_name(spec.job_id)
    secret = secret_name(name)
    labels = {MANAGED_BY_LABEL: MANAGED_BY,
              **{LABEL_PREFIX + k: label_value(v) for k, v in spec.labels.items()}}
    meta = job.setdefault("metadata", {})
    for key in ("generateName", "resourceVersion", "uid", "ownerReferences"):
        meta.pop(key, None)
    meta.update(name=name, namespace=namespace)
    meta["labels"] = {**(meta.get("labels") or {}), **labels}
    meta["annotations"] = {**(meta.get("annotations") or {}), JOB_ID_ANNOTATION: spec.job_id}
    job["apiVersion"], job["kind"] = "batch/v1", "Job"
    js = job.setdefault("spec", {})
    js.pop("selector", None)
    js.update(backoffLimit=0, suspend=True, ttlSecondsAfterFinished=int(ttl_after_finished_s),
              activeDeadlineSeconds=int(math.ceil(
                  spec.timeout_s + (spec.grader.timeout_s if spec.grader else 0.0)
                  + deadline_margin_s)))
    js.pop("completions", None)
    js.pop("parallelism", None)
    tmpl = js.setdefault("template", {})
    tmeta = tmpl.setdefault("metadata", {})
    tmeta["labels"] = {**(tmeta.get("labels") or {}), **labels, **ROLLOUT_POD_LABELS}
    pod = tmpl.setdefault("spec", {})
    pod["restartPolicy"] = "Never"
    pod["automountServiceAccountToken"] = False
    pod.setdefault("terminationGracePeriodSeconds", int(termination_grace_s))
    by_name = {ct.get("name"): ct for ct in pod["containers"]}
    harness_base = by_name.get(HARNESS, pod["containers"][0])
    env = {**spec.env, "OPENAI_BASE_URL": gateway_url} if "OPENAI_BASE_URL" in spec.env \
        else dict(spec.env)
    harness = _container(harness_base, HARNESS, spec.argv, env, secret)
    if spec.grader is not None:
        grader = _container(by_name.get(GRADER, harness_base), GRADER, spec.grader.argv,
                            spec.grader.env, secret)
        pod["initContainers"] = [harness]
        pod["containers"] = [grader]
    else:
        pod["containers"] = [harness]
    pod["volumes"] = [v for v in pod.get("volumes", [])
                      if v.get("name") not in ("harnessrl-workspace", "harnessrl-task")] + [
        {"name": "harnessrl-workspace", "emptyDir": {}},
        {"name": "harnessrl-task", "secret": {
            "secretName": secret, "items": [{"key": SECRET_TASK, "path": "task.json"}]}}]
    return job


def render_secret(spec: JobSpec, job: dict[str, Any], job_uid: str) -> dict[str, Any]:
    """The attempt's Secret: its credential and task, owned by (garbage-collected with) its
    Job. No blockOwnerDeletion: it would only make a foreground deletion of the Job wait for
    the Secret, and setting it needs `update` on `jobs/finalizers` where the admission plugin
    OwnerReferencesPermissionEnforcement runs (OpenShift), a grant the Role does without."""
    meta = job["metadata"]
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {
            "name": secret_name(meta["name"]), "namespace": meta["namespace"],
            "labels": dict(meta["labels"]),
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                 "uid": job_uid, "controller": True}],
        },
        "stringData": {SECRET_API_KEY: spec.env.get(CREDENTIAL_ENV, ""),
                       SECRET_TASK: spec.env.get("HARNESSRL_TASK_JSON", "{}"),
                       **{key: spec.grader.env[name] for name, key in SECRET_ENV[GRADER].items()
                          if spec.grader is not None and name in spec.grader.env}},
    }
