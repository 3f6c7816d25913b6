"""A fake Kubernetes API server — a test double, run as its own process, for code that drives
Kubernetes through the official `kubernetes` Python client (the controller's Kubernetes job
backend). No real API server can run on these machines; this one speaks the real REST paths
and JSON closely enough for the official client (`BatchV1Api`, `CoreV1Api`, `watch.Watch`,
`read_namespaced_pod_log`) and plays the Job controller, the scheduler and a kubelet that runs
containers as local processes (the default) or as real Docker containers (`--kubelet
container`).

    python -m harnessrl.testing.fake_kube_apiserver --root DIR [--port 0] [--ready-file F]
        [--images IMG,...] [--kubelet process|container] [--node-cpu 4] [--kube-version 1.37]
        [--namespaces a,b] [--rbac k8s/base ...] [--disable-admission-plugins NAME,...]

It writes `DIR/kubeconfig` (server http://127.0.0.1:PORT, the cluster admin's bearer token,
namespace `default`) and, for each ServiceAccount of the `--rbac` manifests, a token minted
for it (as a projected token would be) in `DIR/serviceaccounts/<ns>/<name>/{token,namespace,
kubeconfig}` (that kubeconfig's namespace is the ServiceAccount's); once serving, the ready
file `{"pid", "http_port", "kubeconfig", "serviceaccounts": {"ns/name": kubeconfig}}`. From
Python: `FakeKubeAPIServer(root).start()` ... `.stop()` (or a `with` block).

Authentication and authorization, as a real server: each request is the identity its bearer
token belongs to (the admin `kubernetes-admin` in group system:masters, or
`system:serviceaccount:<ns>:<name>`); a missing or unknown token is 401. RBAC decides every
request, resource or not: the Roles, ClusterRoles, RoleBindings and ClusterRoleBindings of
`--rbac` (manifest files, or kustomization directories: their `namespace` and `resources`)
plus the default ClusterRoles cluster-admin (system:masters), system:discovery and
system:public-info-viewer (`/api`, `/apis`, `/version`, `/healthz`, ...: every
authenticated identity). Rules match apiGroups, resources and subresources (`pods/log`,
`*/status`), verbs (get list watch create update patch delete deletecollection, from the
method, the path and `?watch`), resourceNames (a list or watch names one only through
`fieldSelector=metadata.name=`) and `*`; a request nothing grants is 403 with the real
Status (`jobs.batch "x" is forbidden: User "..." cannot delete resource "jobs" in API group
"batch" in the namespace "ns"`). The admission plugin OwnerReferencesPermissionEnforcement
(on in OpenShift; on here unless disabled) refuses a blockOwnerDeletion: true ownerReference
unless its setter may `update` the owner's `finalizers`, and a change of ownerReferences by
one who may not `delete` the object.

Served (namespaced; JSON only; errors are `Status` objects with the real code and reason):
  batch/v1 jobs     create get list watch patch delete deletecollection
  v1 secrets        create get list watch patch delete deletecollection
  v1 pods           get list watch delete deletecollection, pods/{name}/log
  /version, /healthz, /api, /apis; test hooks (the admin's): GET /fake/stats,
  GET /fake/requests (every API request: method, path, body, user, verb, resource, code, a
  403's message), POST /fake/compact.

Like a real server: one global resourceVersion; watches replay history from a
resourceVersion and answer a compacted one with an ERROR event carrying a 410 Expired
Status; label selectors (=, ==, !=, in, notin, exists, !exists) and field selectors
(metadata.name, metadata.namespace, status.phase, spec.nodeName); Jobs and Secrets validated
against the release's OpenAPI schema (`kubernetes_validate`) plus the server's own rules
(names, labels, restartPolicy, generated selector, ...) — 422 Invalid, nothing stored; Job
defaults (backoffLimit 6, selector, job-name / controller-uid labels); propagation policies,
with batch/v1's legacy default of Orphan for Jobs; garbage collection through ownerReferences;
graceful pod deletion (SIGTERM, SIGKILL after the grace period); ttlSecondsAfterFinished;
activeDeadlineSeconds; backoffLimit; suspend.

Container mode (`--kubelet container`, `FakeKubeAPIServer(..., kubelet="container")`): each
pod container is a Docker container of its image on the daemon DOCKER_HOST names
(`fake_kube/container_runtime.py` lists exactly what it applies). The node's images are the
ones that daemon has (`--images` is not used; nothing is pulled). Applied: the pod's and
containers' securityContext (user and groups, runAsNonRoot, read-only root file system,
capabilities, no-new-privileges, privileged, seccomp RuntimeDefault or unconfined), the
volumes as bind mounts at their mountPaths, the environment from the fake's objects (the
credential from its Secret), workingDir, command/args over the image's entrypoint, cpu and
memory limits, signals on deletion; with `--endpoints` (the host processes that stand for the
pods of a deployment), each pod gets a network namespace of its own that reaches what the
NetworkPolicies of `--network-policies` allow of them and nothing else
(fake_kube/pod_network.py); without, pods share the host's network. NOT enforced: ingress
beyond "nothing gets in", policies changed after the start, AppArmor/SELinux, sysctls, ephemeral-storage
limits, imagePullPolicy, probes, lifecycle hooks, service account tokens. The process-mode
points below about paths, `command` and the environment do not apply to it; the others do.

Where it differs from a real cluster (know these before trusting a green test):
  - No container isolation (process mode). A container's `command` + `args` run as a host process (its own
    session; stdout+stderr merged into the pod log). The image only decides whether the pull
    succeeds (`--images`); a container without `command` fails with StartError. Paths are
    mapped, not mounted: a volumeMount's mountPath appearing (at a path boundary) in
    workingDir, command, args or env values is rewritten to the volume's host directory —
    host paths under a mountPath are rewritten too, as a real mount would shadow them (mount
    at /data, not at a prefix of sys.executable); anything else a process opens is the
    host's. The default working directory and HOME are
    the pod's fresh `<root>/pods/<ns>/<pod>/root`. The environment is only what the spec
    declares plus PATH, HOSTNAME and HOME (no service-link variables, no service account).
  - Volumes: emptyDir and secret only. No ConfigMaps (a reference to one is "not found").
  - Unknown fields are rejected with 422 (a real server drops them with a warning unless
    fieldValidation=Strict, then 400); schema type errors are 422 too (400 on a real one).
  - merge-patch and strategic-merge-patch are both applied as JSON merge patch (lists are
    replaced, not merged by key); no json-patch, no apply, no PUT.
  - One node: scheduling looks at CPU requests only. All of a pod's images, secrets and
    volumes are checked before any of its containers runs. A secret volume that is missing
    leaves containers waiting in ContainerCreating (as a real kubelet does; there is no Events
    API to carry the FailedMount message, so it is the waiting message).
  - Job retries come without back-off delay; podFailurePolicy, successPolicy, Indexed mode,
    manualSelector are refused (422 Forbidden) rather than ignored. restartPolicy OnFailure
    restarts containers in place and counts restarts against backoffLimit.
  - `previous`, `sinceSeconds`, `timestamps` on logs are ignored. Lists with `continue` are
    paged from the current state, not a snapshot. Watches carry no `sendInitialEvents`.
  - Pod processes are killed on SIGTERM of this server; a SIGKILLed server leaves them (in
    container mode, the next start with the same --root removes them).
  - Authentication is bearer tokens only (no client certificates, no anonymous user, no
    TokenReview, no impersonation); tokens never expire. RBAC objects are loaded at start
    and cannot be read or changed through the API (no rbac.authorization.k8s.io API, no
    escalation or bind checks, no aggregated ClusterRoles); ServiceAccounts give pods no
    token. The only admission plugin is OwnerReferencesPermissionEnforcement: no
    NamespaceLifecycle, LimitRanger, ResourceQuota, PodSecurity, webhooks. The controllers
    (Job, garbage collector, TTL) and the kubelet act unchecked, as if all-powerful.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from harnessrl import procs
from harnessrl.testing.fake_kube.cluster import Cluster
from harnessrl.testing.fake_kube.container_runtime import ContainerRuntime
from harnessrl.testing.fake_kube.pod_network import Endpoint, PodNetworks
from harnessrl.testing.fake_kube.http import FakeKubeHTTPServer
from harnessrl.testing.fake_kube.rbac import (OWNER_REFS_PLUGIN, Authorizer, load_manifests,
                                              mint_tokens)
from harnessrl.testing.fake_kube.runtime import ProcessRuntime, Runtime
from harnessrl.testing.fake_kube.validation import newest_kube_version

DEFAULT_IMAGES = ("harnessrl/harness:dev",)
KUBELETS = ("process", "container")


def make_runtime(kubelet: str, root: Path, images: list[str],
                 networks: PodNetworks | None = None, pids_limit: int | None = None
                 ) -> Runtime:
    """The kubelet's runtime: local processes with `images` as the node's image list, or
    Docker containers (the daemon's images), with `networks` and `pids_limit` enforced."""
    if kubelet == "container":
        return ContainerRuntime(root, networks, pids_limit)
    if networks is not None or pids_limit is not None:
        raise ValueError("pod networks and the pods' pids limit are container mode's "
                         "(--kubelet container)")
    if kubelet == "process":
        return ProcessRuntime(images)
    raise ValueError(f"kubelet must be one of {KUBELETS}, not {kubelet!r}")


def write_kubeconfig(path: Path, port: int, token: str, namespace: str = "default") -> None:
    config = {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "fake-user", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake-user",
                                                  "namespace": namespace}}],
        "current-context": "fake",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_service_accounts(root: Path, port: int, tokens: dict[str, str]) -> dict[str, str]:
    """What a pod of each ServiceAccount would have mounted, and a kubeconfig from it."""
    kubeconfigs = {}
    for key, token in tokens.items():
        if key == "admin":
            continue
        ns, name = key.split("/")
        where = root / "serviceaccounts" / ns / name
        where.mkdir(parents=True, exist_ok=True)
        (where / "token").write_text(token)
        (where / "namespace").write_text(ns)
        write_kubeconfig(where / "kubeconfig", port, token, namespace=ns)
        kubeconfigs[key] = str(where / "kubeconfig")
    return kubeconfigs


def serve(root: Path, port: int, ready_file: Path | None, images: list[str], node_cpu: float,
          kube_version: str, namespaces: list[str], bookmark_seconds: float,
          rbac: list[Path] | None = None, disabled_plugins: list[str] | None = None,
          kubelet: str = "process", network_policies: list[Path] | None = None,
          endpoints: Path | None = None, pids_limit: int | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    objects = [o for path in rbac or [] for o in load_manifests(path)]
    by_token, tokens = mint_tokens(objects)
    namespaces = namespaces + [o["metadata"]["namespace"] for o in objects
                               if o["metadata"].get("namespace")]
    if network_policies and endpoints is None:
        raise SystemExit("--network-policies needs --endpoints: what the pods may reach")
    networks = PodNetworks.from_files(network_policies or [], endpoints) \
        if endpoints is not None else None
    cluster = Cluster(root, make_runtime(kubelet, root, images, networks, pids_limit),
                      node_cpu, kube_version, namespaces)
    server = FakeKubeHTTPServer(port, cluster, by_token, Authorizer(objects),
                                OWNER_REFS_PLUGIN not in (disabled_plugins or []), kube_version,
                                bookmark_seconds)
    port = server.server_address[1]
    kubeconfig = root / "kubeconfig"
    write_kubeconfig(kubeconfig, port, tokens["admin"])
    accounts = write_service_accounts(root, port, tokens)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cluster.start()
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    pullable = images if kubelet == "process" else "those of the docker daemon"
    print(f"fake kube-apiserver v{kube_version} on http://127.0.0.1:{port} (root {root}, "
          f"kubelet {kubelet}, images {pullable}, node cpu {node_cpu})", flush=True)
    if ready_file is not None:
        _write_atomic(ready_file, json.dumps({"pid": os.getpid(), "http_port": port,
                                              "kubeconfig": str(kubeconfig),
                                              "serviceaccounts": accounts}))
    stop.wait()
    cluster.shutdown()
    server.shutdown()
    server.server_close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, required=True,
                   help="state directory: kubeconfig, pods/<ns>/<pod>/ (volumes, logs)")
    p.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1; 0 picks one")
    p.add_argument("--ready-file", type=Path, help="JSON {pid, http_port, kubeconfig} once up")
    p.add_argument("--images", default=",".join(DEFAULT_IMAGES),
                   help="comma-separated images the node can pull; others get ErrImagePull "
                        "(process mode; in container mode the daemon's images are the node's)")
    p.add_argument("--kubelet", choices=KUBELETS, default="process",
                   help="process: containers run as local processes (paths mapped, nothing "
                        "isolated); container: as Docker containers of their images on the "
                        "daemon DOCKER_HOST names (see the docstring)")
    p.add_argument("--node-cpu", type=float, default=4.0, help="allocatable CPU of the node")
    p.add_argument("--kube-version", default=newest_kube_version(),
                   help="schema version for validation (default: newest kubernetes_validate "
                        "ships)")
    p.add_argument("--namespaces", default="",
                   help="comma-separated namespaces besides default, kube-system, kube-public")
    p.add_argument("--bookmark-seconds", type=float, default=10.0,
                   help="interval of BOOKMARK events on watches that allow them")
    p.add_argument("--rbac", type=Path, action="append", default=[],
                   help="a manifest file or kustomization directory whose ServiceAccounts, "
                        "Roles, ClusterRoles and bindings are loaded (repeatable)")
    p.add_argument("--network-policies", type=Path, action="append", default=[],
                   help="a manifest file or kustomization directory whose NetworkPolicies the "
                        "container kubelet enforces (repeatable; fake_kube/pod_network.py)")
    p.add_argument("--endpoints", type=Path,
                   help="JSON list of the host processes that stand for the pods policies "
                        "allow: {namespace, labels, ports: {pod's port: host:port}, names}")
    p.add_argument("--pod-pids-limit", type=int,
                   help="the node's podPidsLimit (container mode): most processes a container "
                        "of a pod may have; default: no limit, as the kubelet's")
    p.add_argument("--disable-admission-plugins", default="",
                   help=f"comma-separated; only {OWNER_REFS_PLUGIN} (on by default) exists")
    args = p.parse_args(argv)
    serve(args.root.resolve(), args.port, args.ready_file, _split(args.images), args.node_cpu,
          args.kube_version, _split(args.namespaces), args.bookmark_seconds,
          [r.resolve() for r in args.rbac], _split(args.disable_admission_plugins),
          args.kubelet, [n.resolve() for n in args.network_policies], args.endpoints,
          args.pod_pids_limit)


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


class FakeKubeAPIServer:
    """Starts and stops the fake API server as a child process (`harnessrl.procs`).
    `rbac`: manifests to load (`--rbac`); `identity`: "namespace/name" of the ServiceAccount
    whose kubeconfig `.kubeconfig` is, else it is the admin's (`.admin_kubeconfig`);
    `kubelet`: "process" or "container" (`--kubelet`; container mode talks to the daemon
    DOCKER_HOST names in `env`, else in this process's environment); `network_policies`
    (`--network-policies`) and `endpoints` (`--endpoints`): the pod network it enforces;
    `pod_pids_limit`: the node's podPidsLimit (`--pod-pids-limit`)."""

    def __init__(self, root: Path, images: list[str] | tuple[str, ...] = DEFAULT_IMAGES,
                 node_cpu: float = 4.0, kube_version: str | None = None,
                 namespaces: list[str] | tuple[str, ...] = (),
                 bookmark_seconds: float = 10.0, env: dict[str, str] | None = None,
                 rbac: list[Path] | tuple[Path, ...] = (), identity: str | None = None,
                 disable_admission_plugins: list[str] | tuple[str, ...] = (),
                 kubelet: str = "process",
                 network_policies: list[Path] | tuple[Path, ...] = (),
                 endpoints: list[Endpoint] | tuple[Endpoint, ...] = (),
                 pod_pids_limit: int | None = None) -> None:
        self.root = Path(root)
        self.env = env
        self.identity = identity
        self.args = ["--root", str(self.root), "--images", ",".join(images),
                     "--node-cpu", str(node_cpu), "--namespaces", ",".join(namespaces),
                     "--bookmark-seconds", str(bookmark_seconds),
                     "--disable-admission-plugins", ",".join(disable_admission_plugins),
                     "--kubelet", kubelet]
        for path in rbac:
            self.args += ["--rbac", str(Path(path).resolve())]
        for path in network_policies:
            self.args += ["--network-policies", str(Path(path).resolve())]
        if pod_pids_limit is not None:
            self.args += ["--pod-pids-limit", str(pod_pids_limit)]
        if endpoints:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "endpoints.json").write_text(json.dumps([e.to_json() for e in endpoints]))
            self.args += ["--endpoints", str(self.root / "endpoints.json")]
        if kube_version:
            self.args += ["--kube-version", kube_version]
        self.proc: procs.ServiceProcess | None = None
        self.port = 0
        self.admin_kubeconfig = self.kubeconfig = self.root / "kubeconfig"
        self.serviceaccounts: dict[str, Path] = {}

    def start(self, timeout: float = 30.0) -> "FakeKubeAPIServer":
        self.proc, info = procs.start_service("fake-kube-apiserver",
                                              "harnessrl.testing.fake_kube_apiserver",
                                              self.args, self.root, env=self.env,
                                              timeout=timeout)
        self.port = info["http_port"]
        self.admin_kubeconfig = self.kubeconfig = Path(info["kubeconfig"])
        self.serviceaccounts = {k: Path(v) for k, v in info["serviceaccounts"].items()}
        if self.identity is not None:
            self.kubeconfig = self.serviceaccounts[self.identity]
        return self

    @property
    def user(self) -> str:
        """Who `.kubeconfig` authenticates as."""
        if self.identity is None:
            return "kubernetes-admin"
        ns, name = self.identity.split("/")
        return f"system:serviceaccount:{ns}:{name}"

    @property
    def namespace(self) -> str:
        """`.kubeconfig`'s namespace."""
        return self.identity.split("/")[0] if self.identity else "default"

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is not None:
            self.proc.stop(timeout)

    def __enter__(self) -> "FakeKubeAPIServer":
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None
                 ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        """The admin's token."""
        config = yaml.safe_load(self.admin_kubeconfig.read_text())
        return str(config["users"][0]["user"]["token"])

    def api_client(self, kubeconfig: Path | None = None) -> Any:
        """A `kubernetes.client.ApiClient` configured from `.kubeconfig` (or `kubeconfig`)."""
        from kubernetes import config
        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def _call(self, method: str, path: str) -> Any:
        resp = httpx.request(method, self.url + path, timeout=10,
                             headers={"Authorization": f"Bearer {self.token}"})
        resp.raise_for_status()
        return resp.json()

    def stats(self) -> dict[str, Any]:
        """{"created": {kind: count}, "requests": N (logged), "resourceVersion": N}."""
        return dict(self._call("GET", "/fake/stats"))

    def requests(self, since: int = 0) -> list[dict[str, Any]]:
        """Every API request received (from the `since`-th on): method, path, query, body
        (parsed), content_type, time, user, verb, resource ("pods/log"), group, namespace,
        code, forbidden (a 403's message, else None)."""
        return list(self._call("GET", f"/fake/requests?since={since}")["requests"])

    def compact(self) -> int:
        """Drops the watch history; returns the resourceVersion it was compacted at."""
        return int(self._call("POST", "/fake/compact")["compactedAt"])

    def pod_dir(self, namespace: str, name: str) -> Path:
        return self.root / "pods" / namespace / name


if __name__ == "__main__":
    main()
