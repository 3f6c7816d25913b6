"""Shared vocabulary of the fake API server: the kinds it serves, API errors as `Status`
objects, timestamps, label / field selectors and resource quantities."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    name: str          # "Job"
    group: str         # "batch", "" for the core group
    version: str       # "v1"
    resource: str      # "jobs"
    verbs: frozenset[str]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How error messages name the resource: `jobs.batch`, `secrets`."""
        return f"{self.resource}.{self.group}" if self.group else self.resource

    @property
    def path_prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


_ALL = frozenset({"create", "get", "list", "watch", "patch", "delete", "deletecollection"})
KINDS: dict[str, Kind] = {
    "Job": Kind("Job", "batch", "v1", "jobs", _ALL),
    "Secret": Kind("Secret", "", "v1", "secrets", _ALL),
    # Pods are created only by the fake Job controller, never through the API.
    "Pod": Kind("Pod", "", "v1", "pods", _ALL - {"create", "patch"}),
}
BY_RESOURCE = {k.resource: k for k in KINDS.values()}


class ApiError(Exception):
    """An error the API answers with a `Status` object."""

    def __init__(self, code: int, reason: str, message: str,
                 details: Obj | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> Obj:
        body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                     "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


def not_found(kind: Kind, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{kind.qualified} "{name}" not found',
                    {"name": name, "group": kind.group, "kind": kind.resource})


def already_exists(kind: Kind, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{kind.qualified} "{name}" already exists',
                    {"name": name, "group": kind.group, "kind": kind.resource})


def conflict(kind: Kind, name: str, why: str) -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {kind.qualified} '
                    f'"{name}": {why}', {"name": name, "group": kind.group,
                                         "kind": kind.resource})


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(kind: Kind, name: str, causes: list[tuple[str, str]]) -> ApiError:
    """422 Invalid; `causes` are (field, message) pairs, as in
    `Job.batch "x" is invalid: spec.foo: Required value`."""
    qual = f"{kind.name}.{kind.group}" if kind.group else kind.name
    parts = [f"{field}: {msg}" if field else msg for field, msg in causes]
    text = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    return ApiError(422, "Invalid", f'{qual} "{name}" is invalid: {text}', {
        "name": name, "group": kind.group, "kind": kind.name,
        "causes": [{"reason": "FieldValueInvalid", "message": m, "field": f}
                   for f, m in causes]})


def expired(requested: int, oldest: int) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {requested} ({oldest})")


# ----------------------------------------------------------------------------- time


def rfc3339(t: float | None = None) -> str:
    """Seconds precision, as Kubernetes serialises metav1.Time."""
    return datetime.fromtimestamp(time.time() if t is None else t, timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str) -> float:
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


# ----------------------------------------------------------------------------- selectors

_REQ = re.compile(r"^\s*(?P<key>[^\s=!(),]+)\s*(?P<op>==|=|!=|\s+in\s+|\s+notin\s+)\s*"
                  r"(?P<value>\([^)]*\)|[^\s,()]*)\s*$")


def _split_top_level(s: str) -> list[str]:
    """Splits on commas outside parentheses (`a in (x,y),b` → two requirements)."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


Requirement = tuple[str, str, frozenset[str]]  # (key, op, values); ops: in notin exists !exists


def parse_label_selector(s: str | None) -> list[Requirement]:
    """`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`, comma-separated."""
    reqs: list[Requirement] = []
    for part in _split_top_level(s or ""):
        if re.fullmatch(r"!\s*[^\s=!(),]+", part):
            reqs.append((part[1:].strip(), "!exists", frozenset()))
        elif re.fullmatch(r"[^\s=!(),]+", part):
            reqs.append((part, "exists", frozenset()))
        else:
            m = _REQ.match(part)
            if not m:
                raise bad_request(f"unable to parse requirement: {part!r}")
            op, value = m["op"].strip(), m["value"]
            if op in ("in", "notin"):
                if not (value.startswith("(") and value.endswith(")")):
                    raise bad_request(f"unable to parse requirement: {part!r}")
                values = frozenset(v.strip() for v in value[1:-1].split(",") if v.strip())
                reqs.append((m["key"], op, values))
            else:
                reqs.append((m["key"], "notin" if op == "!=" else "in", frozenset({value})))
    return reqs


def labels_match(reqs: list[Requirement], labels: dict[str, str] | None) -> bool:
    labels = labels or {}
    for key, op, values in reqs:
        if op == "exists" and key not in labels:
            return False
        if op == "!exists" and key in labels:
            return False
        if op == "in" and labels.get(key) not in values:
            return False
        if op == "notin" and key in labels and labels[key] in values:
            return False
    return True


FIELDS = {"metadata.name": ("metadata", "name"), "metadata.namespace": ("metadata", "namespace"),
          "status.phase": ("status", "phase"), "spec.nodeName": ("spec", "nodeName")}


def parse_field_selector(s: str | None) -> list[tuple[str, bool, str]]:
    """`metadata.name=x`, `status.phase!=Running`: (field, equal, value) triples."""
    out = []
    for part in _split_top_level(s or ""):
        m = re.fullmatch(r"([\w.]+)\s*(==|=|!=)\s*(.*)", part)
        if not m:
            raise bad_request(f"invalid selector: '{part}'; can't understand '{part}'")
        if m[1] not in FIELDS:
            raise bad_request(f'field label not supported: {m[1]}')
        out.append((m[1], m[2] != "!=", m[3]))
    return out


def fields_match(reqs: list[tuple[str, bool, str]], obj: Obj) -> bool:
    for field, equal, value in reqs:
        section, key = FIELDS[field]
        actual = str((obj.get(section) or {}).get(key) or "")
        if (actual == value) != equal:
            return False
    return True


# ----------------------------------------------------------------------------- quantities

_SUFFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "P": 1e15, "E": 1e18, "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40,
           "Pi": 2.0**50, "Ei": 2.0**60}
QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))"
                      r"(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")


def parse_quantity(q: str | int | float) -> float:
    """`500m` → 0.5, `2` → 2.0, `1Gi` → 1073741824.0. ValueError when malformed."""
    if isinstance(q, (int, float)):
        return float(q)
    m = QUANTITY.match(q.strip())
    if not m:
        raise ValueError(f"quantities must match the regular expression "
                         f"'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {q!r}")
    number = float(m[1])
    if m[2]:
        return number * 10.0 ** int(m[2][1:])
    return number * _SUFFIX[m[3] or ""]
