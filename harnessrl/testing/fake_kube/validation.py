"""What the API server checks before it stores a Job or a Secret, and the defaults it fills
in. Schema checks come from `kubernetes_validate` (the OpenAPI schemas of the release, strict:
unknown fields are errors); the rules the schema cannot say (names, labels, restartPolicy, a
generated selector, volume references, ...) are written out here after the real server's
validation code."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import kubernetes_validate
from kubernetes_validate.utils import major_minor

from .objects import KINDS, Obj, bad_request, invalid, parse_quantity

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")

SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                 "characters, '-' or '.', and must start and end with an alphanumeric character "
                 "(e.g. 'example.com', regex used for validation is "
                 "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or "
             "'-', and must start and end with an alphanumeric character (e.g. 'my-name',  or "
             "'123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
JOB_LABELS = ("batch.kubernetes.io/controller-uid", "batch.kubernetes.io/job-name",
              "controller-uid", "job-name")
# Job features this double does not simulate: refused rather than silently ignored.
UNSUPPORTED_JOB_FIELDS = ("podFailurePolicy", "successPolicy", "backoffLimitPerIndex",
                          "maxFailedIndexes", "managedBy")


def newest_kube_version() -> str:
    return major_minor(kubernetes_validate.latest_version())


Causes = list[tuple[str, str]]


def _q(value: Any) -> str:
    return '"' + str(value) + '"'


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def check_schema(obj: Obj, kube_version: str) -> Causes:
    try:
        kubernetes_validate.validate(obj, kube_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        field = _path(e.absolute_path)
        m = re.match(r"Additional properties are not allowed \((.*) (?:was|were) unexpected\)",
                     e.message)
        if m:
            return [(field, f"unknown field {m[1]}")]
        return [(field, e.message)]
    return []


def check_name(meta: Obj, label_rule: bool) -> Causes:
    name = meta.get("name")
    if not name:
        return [("metadata.name", "Required value: name or generateName is required")]
    if len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
        return [("metadata.name", f"Invalid value: {_q(name)}: {SUBDOMAIN_MSG}")]
    if label_rule and len(name) > 63:
        return [("metadata.name", f"Invalid value: {_q(name)}: must be no more than 63 "
                 "characters")]
    return []


def check_labels(labels: dict[str, Any] | None, field: str) -> Causes:
    causes: Causes = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix))) \
                or len(name) > 63 or not QUALIFIED_NAME.match(name):
            causes.append((field, f"Invalid value: {_q(key)}: name part must consist of "
                           "alphanumeric characters, '-', '_' or '.', and must start and end "
                           "with an alphanumeric character, at most 63 characters, with an "
                           "optional DNS subdomain prefix and '/'"))
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
            causes.append((field, f"Invalid value: {_q(value)}: a valid label must be an empty "
                           "string or consist of alphanumeric characters, '-', '_' or '.', and "
                           "must start and end with an alphanumeric character, at most 63 "
                           "characters"))
    return causes


def check_secret(secret: Obj) -> Causes:
    causes = check_name(secret["metadata"], label_rule=False)
    causes += check_labels(secret["metadata"].get("labels"), "metadata.labels")
    for section in ("data", "stringData"):
        for key in secret.get(section) or {}:
            if not SECRET_KEY.match(key):
                causes.append((f"{section}[{key}]", f"Invalid value: {_q(key)}: a valid config "
                               "key must consist of alphanumeric characters, '-', '_' or '.'"))
    for key, value in (secret.get("data") or {}).items():
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"illegal base64 data in Secret data[{key}]") from None
    return causes


def _containers(pod_spec: Obj) -> list[tuple[str, Obj]]:
    return ([(f"initContainers[{i}]", c) for i, c in enumerate(pod_spec.get("initContainers")
                                                              or [])]
            + [(f"containers[{i}]", c) for i, c in enumerate(pod_spec.get("containers") or [])])


def check_pod_spec(spec: Obj, field: str) -> Causes:
    causes: Causes = []
    policy = spec.get("restartPolicy")
    if policy is None:
        causes.append((f"{field}.restartPolicy",
                       'Required value: valid values: "OnFailure", "Never"'))
    elif policy not in ("OnFailure", "Never"):
        causes.append((f"{field}.restartPolicy", f'Unsupported value: {_q(policy)}: supported '
                       'values: "OnFailure", "Never"'))
    if not spec.get("containers"):
        causes.append((f"{field}.containers", "Required value"))
    volumes = set()
    for i, vol in enumerate(spec.get("volumes") or []):
        name = vol.get("name", "")
        if not DNS1123_LABEL.match(name) or len(name) > 63:
            causes.append((f"{field}.volumes[{i}].name", f"Invalid value: {_q(name)}: "
                           f"{LABEL_MSG}"))
        if name in volumes:
            causes.append((f"{field}.volumes[{i}].name", f"Duplicate value: {_q(name)}"))
        volumes.add(name)
    names: set[str] = set()
    for where, c in _containers(spec):
        cfield = f"{field}.{where}"
        name = c.get("name", "")
        if not DNS1123_LABEL.match(name) or len(name) > 63:
            causes.append((f"{cfield}.name", f"Invalid value: {_q(name)}: {LABEL_MSG}"))
        if name in names:
            causes.append((f"{cfield}.name", f"Duplicate value: {_q(name)}"))
        names.add(name)
        if not c.get("image"):
            causes.append((f"{cfield}.image", "Required value"))
        for j, mount in enumerate(c.get("volumeMounts") or []):
            if mount.get("name") not in volumes:
                causes.append((f"{cfield}.volumeMounts[{j}].name",
                               f"Not found: {_q(mount.get('name'))}"))
            if not str(mount.get("mountPath", "")).startswith("/"):
                causes.append((f"{cfield}.volumeMounts[{j}].mountPath",
                               "Invalid value: must be an absolute path"))
        for j, env in enumerate(c.get("env") or []):
            if not env.get("name") or "=" in env["name"]:
                causes.append((f"{cfield}.env[{j}].name", f"Invalid value: {_q(env.get('name'))}"
                               ": a valid environment variable name must consist only of "
                               "printable ASCII characters other than '='"))
        for kind in ("requests", "limits"):
            for res, q in ((c.get("resources") or {}).get(kind) or {}).items():
                try:
                    parse_quantity(q)
                except ValueError as e:
                    causes.append((f"{cfield}.resources.{kind}[{res}]", str(e)))
    return causes


def check_job(job: Obj) -> Causes:
    meta, spec = job["metadata"], job.get("spec") or {}
    causes = check_name(meta, label_rule=True)
    causes += check_labels(meta.get("labels"), "metadata.labels")
    template = spec.get("template") or {}
    causes += check_labels((template.get("metadata") or {}).get("labels"),
                           "spec.template.metadata.labels")
    if spec.get("selector") is not None and not spec.get("manualSelector"):
        causes.append(("spec.selector", "Invalid value: `selector` not auto-generated"))
    if spec.get("manualSelector"):
        causes.append(("spec.manualSelector", "Forbidden: not supported by the fake API server"))
    for key in ("backoffLimit", "completions", "parallelism", "ttlSecondsAfterFinished"):
        if (spec.get(key) or 0) < 0:
            causes.append((f"spec.{key}", f"Invalid value: {spec[key]}: must be greater than or "
                           "equal to 0"))
    if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
        causes.append(("spec.activeDeadlineSeconds", f"Invalid value: "
                       f"{spec['activeDeadlineSeconds']}: must be greater than 0"))
    for key in UNSUPPORTED_JOB_FIELDS:
        if spec.get(key) is not None:
            causes.append((f"spec.{key}", "Forbidden: not supported by the fake API server"))
    if spec.get("completionMode", "NonIndexed") != "NonIndexed":
        causes.append(("spec.completionMode", "Forbidden: only NonIndexed is supported by the "
                       "fake API server"))
    causes += check_pod_spec(template.get("spec") or {}, "spec.template.spec")
    return causes


def validate_new(kind_name: str, obj: Obj, kube_version: str) -> None:
    """Raises 422 Invalid (nothing stored) when `obj` would be refused by a real server."""
    kind = KINDS[kind_name]
    name = (obj.get("metadata") or {}).get("name") or ""
    causes = check_schema(obj, kube_version)
    if not causes:
        causes = check_job(obj) if kind_name == "Job" else check_secret(obj)
    if causes:
        raise invalid(kind, name, causes)


def check_body_kind(kind_name: str, obj: Any) -> Obj:
    kind = KINDS[kind_name]
    if not isinstance(obj, dict):
        raise bad_request("the body of the request was not a JSON object")
    obj.setdefault("apiVersion", kind.api_version)
    obj.setdefault("kind", kind.name)
    if obj["apiVersion"] != kind.api_version or obj["kind"] != kind.name:
        raise bad_request(f"the API version in the data ({obj['apiVersion']}) does not match "
                          f"the expected API version ({kind.api_version}) or kind "
                          f"({obj['kind']} is not {kind.name})")
    if not isinstance(obj.get("metadata", {}), dict):
        raise bad_request("metadata must be an object")
    obj.setdefault("metadata", {})
    return obj


def check_job_update(old: Obj, new: Obj) -> None:
    """A patch may change only what a real server lets change on a Job."""
    immutable = ("template", "selector", "completionMode", "podFailurePolicy", "manualSelector")
    causes = [(f"spec.{k}", "Invalid value: field is immutable") for k in immutable
              if old["spec"].get(k) != new["spec"].get(k)]
    if old["spec"].get("completions") != new["spec"].get("completions"):
        causes.append(("spec.completions", "Invalid value: field is immutable"))
    if causes:
        raise invalid(KINDS["Job"], old["metadata"]["name"], causes)


def raise_if(causes: Causes, kind_name: str, name: str) -> None:
    if causes:
        raise invalid(KINDS[kind_name], name, causes)

