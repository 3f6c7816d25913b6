"""Who is asking and what they may do: bearer tokens to identities, the request attributes a
method and path stand for (the real server's RequestInfo), the RBAC authorizer over Roles,
ClusterRoles and their bindings, and the OwnerReferencesPermissionEnforcement admission
plugin. The RBAC objects come from manifest files or kustomization directories (`k8s/`), with
the default ClusterRoles a cluster always has."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from .objects import KINDS, ApiError, Obj

RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
NAMESPACED = ("ServiceAccount", "Role", "RoleBinding")
OWNER_REFS_PLUGIN = "OwnerReferencesPermissionEnforcement"
Admit = Callable[[Obj, Obj | None], None]   # (new object, old object or None on create)


@dataclass(frozen=True)
class Identity:
    name: str
    groups: tuple[str, ...]


ADMIN = Identity("kubernetes-admin", ("system:masters", "system:authenticated"))


def service_account(namespace: str, name: str) -> Identity:
    return Identity(f"system:serviceaccount:{namespace}:{name}",
                    ("system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                     "system:authenticated"))


def _cluster_role(name: str, rules: list[Obj], group: str | list[str]) -> list[Obj]:
    groups = [group] if isinstance(group, str) else group
    return [{"kind": "ClusterRole", "metadata": {"name": name}, "rules": rules},
            {"kind": "ClusterRoleBinding", "metadata": {"name": name},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": name},
             "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                           "name": g} for g in groups]}]


# The default ClusterRoles (and bindings) of a cluster that matter here.
DEFAULTS = (
    _cluster_role("cluster-admin", [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
                                    {"nonResourceURLs": ["*"], "verbs": ["*"]}],
                  "system:masters")
    + _cluster_role("system:discovery", [{"nonResourceURLs": [
        "/api", "/api/*", "/apis", "/apis/*", "/openapi", "/openapi/*", "/version",
        "/version/"], "verbs": ["get"]}], "system:authenticated")
    + _cluster_role("system:public-info-viewer", [{"nonResourceURLs": [
        "/healthz", "/livez", "/readyz", "/version", "/version/"], "verbs": ["get"]}],
        ["system:authenticated", "system:unauthenticated"]))


def load_manifests(path: Path, namespace: str | None = None,
                   kinds: tuple[str, ...] = RBAC_KINDS,
                   namespaced: tuple[str, ...] = NAMESPACED) -> list[Obj]:
    """The objects of `kinds` (default: RBAC objects and ServiceAccounts) of a manifest file,
    or of a kustomization directory: its `resources` (files and directories) with its
    `namespace` set on the `namespaced` ones and on ServiceAccount subjects without one (only
    these two kustomize features). Objects without a namespace get `namespace` (default
    "default")."""
    path = Path(path)
    if path.is_dir():
        k = yaml.safe_load((path / "kustomization.yaml").read_text()) or {}
        ns = k.get("namespace") or namespace
        return [o for res in k.get("resources") or []
                for o in load_manifests(path / res, ns, kinds, namespaced)]
    objs = [d for d in yaml.safe_load_all(path.read_text())
            if isinstance(d, dict) and d.get("kind") in kinds]
    for obj in objs:
        meta = obj.setdefault("metadata", {})
        if obj["kind"] in namespaced and (namespace or not meta.get("namespace")):
            meta["namespace"] = namespace or "default"
        for subject in obj.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount" and not subject.get("namespace"):
                subject["namespace"] = namespace or meta.get("namespace") or "default"
    return objs


def mint_tokens(objects: list[Obj]) -> tuple[dict[str, Identity], dict[str, str]]:
    """A token for the admin and one for each ServiceAccount (as a projected token would
    be): token -> identity, and "namespace/name" (or "admin") -> token."""
    by_token = {secrets.token_hex(16): ADMIN}
    names = {"admin": next(iter(by_token))}
    for obj in objects:
        if obj["kind"] == "ServiceAccount":
            meta = obj["metadata"]
            token = secrets.token_hex(16)
            by_token[token] = service_account(meta["namespace"], meta["name"])
            names[f"{meta['namespace']}/{meta['name']}"] = token
    return by_token, names


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Attributes:
    """What a request asks for, as the authorizer sees it; `resource` "" : a non-resource
    request (`/version`, `/api`, ...)."""
    verb: str
    path: str
    resource: str = ""
    subresource: str = ""
    group: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def combined(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


_VERBS = {"GET": "get", "HEAD": "get", "POST": "create", "PUT": "update", "PATCH": "patch",
          "DELETE": "delete"}


def request_attributes(method: str, path: str, query: dict[str, str]) -> Attributes:
    """The real server's RequestInfo: /api/v1/... and /apis/<group>/<version>/... are
    resource requests (namespace, resource, name, subresource; a GET without a name is a list
    or, with ?watch, a watch; a DELETE without one a deletecollection); anything else is a
    non-resource request whose verb is the lower-case method."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return Attributes(method.lower(), path)
    verb, namespace = _VERBS.get(method, method.lower()), ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2:
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    sub = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch", "").lower() in ("true", "1") else "list"
        selector = query.get("fieldSelector", "")
        if selector.startswith("metadata.name=") and "," not in selector:
            name = selector.split("=", 1)[1].lstrip("=")
    if not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(verb, path, resource, sub, group, namespace, name)


# ----------------------------------------------------------------------------- RBAC


def _rule_allows(rule: Obj, a: Attributes) -> bool:
    verbs = rule.get("verbs") or []
    if "*" not in verbs and a.verb not in verbs:
        return False
    if not a.resource:
        return any(u == "*" or u == a.path or (u.endswith("*") and a.path.startswith(u[:-1]))
                   for u in rule.get("nonResourceURLs") or [])
    groups = rule.get("apiGroups") or []
    if "*" not in groups and a.group not in groups:
        return False
    if not any(r in ("*", a.combined) or (a.subresource and r == f"*/{a.subresource}")
               for r in rule.get("resources") or []):
        return False
    names = rule.get("resourceNames") or []
    return not names or a.name in names


def _subject_is(subject: Obj, binding_ns: str, who: Identity) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return bool(subject.get("name") == who.name)
    if kind == "Group":
        return subject.get("name") in who.groups
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_ns
        return who.name == f"system:serviceaccount:{ns}:{subject.get('name')}"
    return False


class Authorizer:
    """RBAC as the real authorizer evaluates it: a ClusterRoleBinding grants its ClusterRole
    everywhere; a RoleBinding grants its Role (or a ClusterRole's resource rules) in its own
    namespace only; grants only add up (there is no deny)."""

    def __init__(self, objects: list[Obj]) -> None:
        objects = list(DEFAULTS) + list(objects)
        self.roles: dict[tuple[str, str], list[Obj]] = {}
        self.bindings: list[tuple[str, Obj, list[Obj]]] = []
        for obj in objects:
            meta, kind = obj["metadata"], obj["kind"]
            ns = meta.get("namespace", "") if kind in NAMESPACED else ""
            if kind in ("Role", "ClusterRole"):
                self.roles[(kind, f"{ns}/{meta['name']}")] = obj.get("rules") or []
            elif kind in ("RoleBinding", "ClusterRoleBinding"):
                self.bindings.append((ns, obj["roleRef"], obj.get("subjects") or []))

    def allows(self, who: Identity, a: Attributes) -> bool:
        for ns, ref, subjects in self.bindings:
            if ns and ns != a.namespace:
                continue
            if not any(_subject_is(s, ns, who) for s in subjects):
                continue
            key = f"{ns}/{ref['name']}" if ref["kind"] == "Role" else f"/{ref['name']}"
            if any(_rule_allows(r, a) for r in self.roles.get((ref["kind"], key)) or []):
                return True
        return False


def _forbidden(a: Attributes, why: str) -> ApiError:
    """The real server's 403 Status (apierrors.NewForbidden)."""
    if not a.resource:
        return ApiError(403, "Forbidden", f"forbidden: {why}", {})
    qualified = f"{a.resource}.{a.group}" if a.group else a.resource
    named = f'{qualified} "{a.name}"' if a.name else qualified
    details = {k: v for k, v in (("name", a.name), ("group", a.group), ("kind", a.resource))
               if v}
    return ApiError(403, "Forbidden", f"{named} is forbidden: {why}", details)


def forbidden(who: Identity, a: Attributes) -> ApiError:
    if not a.resource:
        return _forbidden(a, f'User "{who.name}" cannot {a.verb} path "{a.path}"')
    where = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
    return _forbidden(a, f'User "{who.name}" cannot {a.verb} resource "{a.combined}" in API '
                         f'group "{a.group}" {where}')


# ----------------------------------------------------------------------------- admission


def _refs(obj: Obj | None) -> list[Obj]:
    return list(((obj or {}).get("metadata") or {}).get("ownerReferences") or [])


def admit_owner_references(authz: Authorizer, who: Identity, a: Attributes, new: Obj,
                           old: Obj | None) -> None:
    """OwnerReferencesPermissionEnforcement (on in OpenShift): changing an object's
    ownerReferences needs `delete` on it (not on create); a new blockOwnerDeletion: true needs
    `update` on the owner's `finalizers` subresource. Its messages are the plugin's own (the
    RBAC authorizer gives no reason, hence the empty one and the <nil>)."""
    refs, old_refs = _refs(new), _refs(old)
    if refs == old_refs:
        return
    name = new["metadata"].get("name", "")
    if old is not None and not authz.allows(who, dataclasses.replace(a, verb="delete")):
        raise _forbidden(dataclasses.replace(a, name=name),
                         "cannot set an ownerRef on a resource you can't delete: , <nil>")
    was_blocking = {r.get("uid") for r in old_refs if r.get("blockOwnerDeletion")}
    for ref in refs:
        if not ref.get("blockOwnerDeletion") or ref.get("uid") in was_blocking:
            continue
        kind = KINDS.get(str(ref.get("kind")))
        if kind is None or kind.api_version != ref.get("apiVersion"):
            raise _forbidden(dataclasses.replace(a, name=name), "cannot set blockOwnerDeletion "
                             f"in this case because cannot find RESTMapping for APIVersion "
                             f"{ref.get('apiVersion')} Kind {ref.get('kind')}: no matches for "
                             f"kind \"{ref.get('kind')}\" in version \"{ref.get('apiVersion')}\"")
        finalizers = Attributes("update", "", kind.resource, "finalizers", kind.group,
                                a.namespace, str(ref.get("name", "")))
        if not authz.allows(who, finalizers):
            raise _forbidden(dataclasses.replace(a, name=name), "cannot set blockOwnerDeletion "
                             "if an ownerReference refers to a resource you can't set "
                             "finalizers on: , <nil>")


def owner_references_admission(authz: Authorizer, who: Identity,
                               a: Attributes) -> Admit:
    """The plugin bound to one request: a callable (new, old) for `Cluster.create / patch`."""
    return lambda new, old: admit_owner_references(authz, who, a, new, old)
