"""The fake kubelet's pod network in container mode: each pod in a network namespace of its own,
reaching only what the NetworkPolicies of its namespace allow (`--network-policies`).

A real cluster gives each pod an IP, routes between pods and Services, and its network plugin
(Calico, Cilium, ...) enforces NetworkPolicies. The fake runs on one machine, and what its pods
talk to (the gateway, the store, the engine of a test) are host processes, so it does the same
with doors, as the controller's local sandboxes do (services/controller/sandbox/egress.py):

- The pod's containers share one network namespace that holds loopback and nothing else. An
  infra container holds it (as the pause container does): `--network none`, the pod's first
  image running `sleep infinity` as nobody, read-only, without capabilities. Each container of
  the pod joins it (`--network container:<infra>`), and sees its /etc/hosts.
- What pods may reach is declared as `Endpoint`s (`--endpoints`): processes outside the fake
  that stand for the pods of a deployment (a namespace and labels), the names pods use for
  them (their Services) and their ports (the port a pod connects to, and the host address that
  serves it). Each endpoint has an address of its own inside every pod, 127.0.1.<n> (its
  Service IP), and its names resolve there through the pod's /etc/hosts, allowed or not, as
  cluster DNS would answer them.
- For each port that an egress rule of a policy selecting the pod allows to an endpoint, the
  kubelet listens on that address and port inside the pod's namespace and carries each
  connection to the endpoint's host address. Nothing else leaves the namespace: there is no
  interface and no route out, so any other connection is refused at once.
- A pod that no policy with Egress selects is not isolated (Kubernetes' default): it reaches
  every port of every endpoint. With no policies loaded at all, that is every pod: a cluster
  whose network plugin enforces none. Without endpoints the pods share the host's network,
  as before (`--network host`).

Rule shapes evaluated: the policy's podSelector and policyTypes; egress `to` peers with
podSelector, namespaceSelector (a namespace's labels are `kubernetes.io/metadata.name`) or
both; `ports` with numeric TCP ports; an empty `to` (all peers) or no `ports` (all ports).
Not enforced: ingress (nothing outside a pod's namespace can connect into it at all, stricter
than a policy that allows some ingress), ipBlock peers, named ports, endPort, UDP (so DNS:
there is no DNS server; names resolve from /etc/hosts), traffic between pods of the fake,
and policies changed after a pod started (policies are loaded when the server starts).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


from harnessrl.streams import relay

from .rbac import load_manifests
from .runtime import Launch

Obj = dict[str, Any]
CLONE_NEWNET = 0x40000000
NAMESPACE_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Endpoint:
    """A process outside the fake that stands for pods of the cluster: `labels` in
    `namespace`, reached by pods under `names` (Services) on `ports` (the port a pod
    connects to -> the host address, host:port, that serves it)."""
    namespace: str
    labels: dict[str, str]
    ports: dict[int, str]
    names: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, d: Obj) -> Endpoint:
        return cls(d["namespace"], dict(d["labels"]),
                   {int(k): str(v) for k, v in d["ports"].items()}, tuple(d.get("names", ())))

    def to_json(self) -> Obj:
        return {"namespace": self.namespace, "labels": self.labels,
                "ports": {str(k): v for k, v in self.ports.items()}, "names": list(self.names)}


@dataclass(frozen=True)
class Door:
    """One allowed way out: `address`:`port` inside the pod -> `target` (host:port)."""
    address: str
    port: int
    target: str


def service_ip(index: int) -> str:
    """The address of the endpoint `index` inside every pod (its Service IP)."""
    if not 0 <= index < 254:
        raise ValueError("at most 254 endpoints")
    return f"127.0.1.{index + 1}"


def load_policies(path: Path, namespace: str | None = None) -> list[Obj]:
    """The NetworkPolicies of a manifest file or a kustomization directory (its `resources`,
    its `namespace` set on each); a policy without a namespace gets `namespace` (else
    "default")."""
    return load_manifests(path, namespace, ("NetworkPolicy",), ("NetworkPolicy",))


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against labels; {} selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or [])
        if (op == "In" and labels.get(key) not in values) \
                or (op == "NotIn" and key in labels and labels[key] in values) \
                or (op == "Exists" and key not in labels) \
                or (op == "DoesNotExist" and key in labels):
            return False
    return True


def _peer_allows(peer: Obj, policy_ns: str, ep: Endpoint) -> bool:
    if "ipBlock" in peer:
        return False  # not evaluated (module docstring): allows nothing here
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], {NAMESPACE_LABEL: ep.namespace}):
            return False
    elif ep.namespace != policy_ns:  # a podSelector alone: the policy's namespace
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], ep.labels)


def egress_doors(policies: list[Obj], namespace: str, labels: dict[str, str],
                 endpoints: list[Endpoint]) -> list[Door]:
    """The doors of a pod (`labels` in `namespace`): to every endpoint port when no policy
    with Egress selects it (not isolated), else to those some egress rule allows."""
    chosen = [p for p in policies if p["metadata"]["namespace"] == namespace
              and "Egress" in (p["spec"].get("policyTypes") or
                               (["Egress"] if "egress" in p["spec"] else []))
              and selects(p["spec"].get("podSelector"), labels)]
    rules = [r for p in chosen for r in p["spec"].get("egress") or []] if chosen \
        else [{}]  # not isolated: one rule that allows everything
    doors: set[Door] = set()
    for rule in rules:
        peers = rule.get("to") or []
        ports = rule.get("ports")
        for i, ep in enumerate(endpoints):
            if peers and not any(_peer_allows(p, namespace, ep) for p in peers):
                continue
            for port, target in ep.ports.items():
                if ports is None or any((p.get("protocol") or "TCP") == "TCP"
                                        and p.get("port") == port for p in ports):
                    doors.add(Door(service_ip(i), port, target))
    return sorted(doors, key=lambda d: (d.address, d.port))


def hosts_entries(endpoints: list[Endpoint]) -> list[str]:
    """`--add-host` values: every endpoint's names at its address (as cluster DNS answers
    them, whether a policy lets the pod connect or not)."""
    return [f"{n}:{service_ip(i)}" for i, ep in enumerate(endpoints) for n in ep.names]


_libc = ctypes.CDLL(None, use_errno=True)


def listen_in(netns: str, address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address`:`port` inside the network namespace `netns` (a
    /proc/<pid>/ns/net path). setns moves only the calling thread, so a short-lived thread of
    its own enters the namespace; a socket stays in the namespace it was made in."""
    made: dict[str, Any] = {}

    def enter_and_listen() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({netns}): {os.strerror(err)} (the fake kubelet "
                                       "needs CAP_SYS_ADMIN for pod networks)")
            finally:
                os.close(fd)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(128)
            sock.setblocking(False)
            made["sock"] = sock
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            made["error"] = e

    t = threading.Thread(target=enter_and_listen, name="pod-netns")
    t.start()
    t.join()  # the thread ends inside the pod's namespace; nothing else runs on it
    if "error" in made:
        raise made["error"]
    return made["sock"]  # type: ignore[no-any-return]


@dataclass
class _PodDoors:
    servers: list[asyncio.Server] = field(default_factory=list)
    conns: set[asyncio.StreamWriter] = field(default_factory=set)


class DoorKeeper:
    """Serves every pod's doors on one event loop thread."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="pod-doors")
        self._thread.start()
        self._pods: dict[str, _PodDoors] = {}

    def open(self, pod: str, netns: str, doors: list[Door]) -> None:
        """Opens `doors` inside `netns` for the pod (uid) `pod`."""
        socks = [listen_in(netns, d.address, d.port) for d in doors]
        state = _PodDoors()
        self._pods[pod] = state

        async def serve() -> None:
            for door, sock in zip(doors, socks):
                state.servers.append(await asyncio.start_server(
                    self._carrier(state, door.target), sock=sock))
        self._call(serve())

    def close(self, pod: str) -> None:
        state = self._pods.pop(pod, None)
        if state is None:
            return

        async def shut() -> None:
            for server in state.servers:
                server.close()
            for writer in list(state.conns):
                writer.transport.abort()
        self._call(shut())

    def stop(self) -> None:
        for pod in list(self._pods):
            self.close(pod)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    @staticmethod
    def _carrier(state: _PodDoors, target: str) -> Callable[..., Any]:
        host, _, port = target.rpartition(":")

        async def carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(host, int(port))
            except OSError:
                writer.transport.abort()
                return
            state.conns.update((writer, up_writer))
            try:
                await asyncio.gather(relay(reader, up_writer), relay(up_reader, writer))
            finally:
                for w in (writer, up_writer):
                    state.conns.discard(w)
                    w.transport.abort()
        return carry


class Docker(Protocol):
    """What the pod networks need of the container runtime: its docker CLI."""

    def cli(self, *args: str, env: dict[str, str] | None = None) -> str: ...

    def remove(self, *names: str) -> None: ...


class PodNetworks:
    """The container runtime's pod networks: `policies` and `endpoints` (module docstring);
    for each pod, its infra container and its doors."""

    def __init__(self, policies: list[Obj], endpoints: list[Endpoint]) -> None:
        self.policies = policies
        self.endpoints = endpoints
        self.doors = DoorKeeper()
        self.infra: dict[str, str] = {}  # pod uid -> its infra container's name
        self.lock = threading.Lock()

    @classmethod
    def from_files(cls, policy_paths: list[Path], endpoints_file: Path | None) -> PodNetworks:
        endpoints = [Endpoint.from_json(e) for e in
                     json.loads(endpoints_file.read_text())] if endpoints_file else []
        return cls([p for path in policy_paths for p in load_policies(path)], endpoints)

    def join(self, docker: Docker, infra: str, launch: Launch, labels: dict[str, str]) -> str:
        """The infra container (named `infra`, labelled `labels`) whose network namespace the
        pod of `launch` joins: made, with the pod's doors, for its first
        container. A pod's containers may start at once: one infra container each."""
        with self.lock:
            if launch.uid in self.infra:
                return self.infra[launch.uid]
            doors = egress_doors(self.policies, launch.namespace, launch.labels, self.endpoints)
            argv = ["run", "-d", "--name", infra, "--network", "none", "--read-only",
                    "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                    "--user", "65534:65534", "--entrypoint", "sleep"]
            for k, v in labels.items():
                argv += ["--label", f"{k}={v}"]
            for entry in hosts_entries(self.endpoints):
                argv += ["--add-host", entry]
            docker.remove(infra)
            docker.cli(*argv, launch.container["image"], "infinity")
            self.infra[launch.uid] = infra
            pid = docker.cli("inspect", "--format", "{{.State.Pid}}", infra)
            self.doors.open(launch.uid, f"/proc/{pid}/ns/net", doors)
            return infra

    def close(self, docker: Docker, uid: str) -> None:
        """The pod `uid` is over: its doors closed, its infra container removed."""
        infra = self.infra.pop(uid, None)
        if infra is not None:
            self.doors.close(uid)
            docker.remove(infra)

    def close_all(self, docker: Docker) -> None:
        for uid in list(self.infra):
            self.close(docker, uid)

    def stop(self) -> None:
        self.doors.stop()
