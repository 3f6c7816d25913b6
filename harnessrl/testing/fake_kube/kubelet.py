"""The fake node: a scheduler (CPU requests against one node's capacity) and a kubelet that
runs each bound pod's containers through a runtime (`runtime.Runtime`: local processes by
default, `container_runtime.ContainerRuntime` for real containers), publishing the pod status
a real kubelet would (container states, phase, conditions).
"""

from __future__ import annotations

import base64
import copy
import re
import shutil
import signal
import threading
import time
from pathlib import Path

from .objects import ApiError, Obj, parse_quantity, rfc3339
from .runtime import ConfigError, Exit, Launch, Running, Runtime, expand
from .store import Store

NODE_NAME = "fake-node"
POLL = 0.1
RECHECK = 0.2


class PodGone(Exception):
    """The pod object disappeared (it was removed from the API)."""


def set_condition(status: Obj, type_: str, value: bool, reason: str | None = None,
                  message: str | None = None) -> None:
    conds = status.setdefault("conditions", [])
    text = "True" if value else "False"
    cond = next((c for c in conds if c["type"] == type_), None)
    if cond is None:
        cond = {"type": type_, "lastProbeTime": None}
        conds.append(cond)
    if cond.get("status") != text:
        cond["lastTransitionTime"] = rfc3339()
    cond["status"] = text
    for key, val in (("reason", reason), ("message", message)):
        if val is None:
            cond.pop(key, None)
        else:
            cond[key] = val


def cpu_request(spec: Obj) -> float:
    """What the scheduler counts: max(sum over containers, largest init container)."""
    def req(c: Obj) -> float:
        return parse_quantity(((c.get("resources") or {}).get("requests") or {}).get("cpu", 0))
    main = sum(req(c) for c in spec.get("containers") or [])
    return max([main] + [req(c) for c in spec.get("initContainers") or []])


def is_terminal(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class Node:
    """One node with `cpu` cores of allocatable CPU, running containers through `runtime`
    (which also says what images it can pull)."""

    def __init__(self, store: Store, root: Path, runtime: Runtime, cpu: float) -> None:
        self.store = store
        self.root = root
        self.runtime = runtime
        self.cpu = cpu
        self.workers: dict[str, PodWorker] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._schedule_loop, name="scheduler", daemon=True).start()

    def kill_all(self) -> None:
        """Shutdown: SIGKILL every container at once."""
        self.stopping.set()
        with self.lock:
            workers = list(self.workers.values())
        self.runtime.shutdown()
        for w in workers:
            w.kill_processes(signal.SIGKILL)

    def pod_dir(self, namespace: str, name: str) -> Path:
        return self.root / "pods" / namespace / name

    def _schedule_loop(self) -> None:
        while not self.stopping.wait(POLL):
            try:
                self._schedule_once()
            except Exception as e:  # keep the node alive; the log shows what broke
                print(f"scheduler: {e!r}", flush=True)

    def _schedule_once(self) -> None:
        pods, _ = self.store.list("Pod")
        used = sum(cpu_request(p["spec"]) for p in pods
                   if p["spec"].get("nodeName") and not is_terminal(p))
        pending = sorted((p for p in pods if not p["spec"].get("nodeName")),
                         key=lambda p: (p["metadata"]["creationTimestamp"],
                                        int(p["metadata"]["resourceVersion"])))
        for pod in pending:
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                self._remove(meta["namespace"], meta["name"])
                continue
            need = cpu_request(pod["spec"])
            if used + need <= self.cpu + 1e-9:
                used += need
                self._bind(pod)
            else:
                self._unschedulable(pod, need)

    def _remove(self, namespace: str, name: str) -> None:
        try:
            self.store.delete("Pod", namespace, name)
        except ApiError:
            pass

    def _bind(self, pod: Obj) -> None:
        def bind(p: Obj) -> None:
            p["spec"]["nodeName"] = NODE_NAME
            set_condition(p.setdefault("status", {}), "PodScheduled", True)
        meta = pod["metadata"]
        try:
            bound = self.store.mutate("Pod", meta["namespace"], meta["name"], bind)
        except ApiError:
            return
        worker = PodWorker(self, bound)
        with self.lock:
            self.workers[meta["uid"]] = worker
        worker.start()

    def _unschedulable(self, pod: Obj, need: float) -> None:
        message = (f"0/1 nodes are available: 1 Insufficient cpu (requested {need:g}, node "
                   f"allocatable {self.cpu:g}). preemption: 0/1 nodes are available: 1 No "
                   "preemption victims found for incoming pod.")

        def mark(p: Obj) -> None:
            set_condition(p.setdefault("status", {}), "PodScheduled", False, "Unschedulable",
                          message)
            p["status"]["phase"] = "Pending"
        try:
            self.store.mutate("Pod", pod["metadata"]["namespace"], pod["metadata"]["name"],
                              mark)
        except ApiError:
            pass


def _container_status(c: Obj, reason: str) -> Obj:
    return {"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
            "started": False, "restartCount": 0, "state": {"waiting": {"reason": reason}},
            "lastState": {}}


class PodWorker(threading.Thread):
    """The kubelet's work on one pod, from binding until the pod object is removed."""

    def __init__(self, node: Node, pod: Obj) -> None:
        super().__init__(name=f"pod-{pod['metadata']['name']}", daemon=True)
        self.node = node
        self.store = node.store
        self.namespace = pod["metadata"]["namespace"]
        self.name = pod["metadata"]["name"]
        self.uid = pod["metadata"]["uid"]
        self.labels: dict[str, str] = dict(pod["metadata"].get("labels") or {})
        self.spec: Obj = pod["spec"]
        self.dir = node.pod_dir(self.namespace, self.name)
        self.procs: dict[str, Running] = {}  # container name -> running container
        self.status: Obj = copy.deepcopy(pod.get("status") or {})
        self.pull_attempts: dict[str, int] = {}

    # -- publishing state

    def pod(self) -> Obj:
        pod = self.store.get("Pod", self.namespace, self.name)
        if pod is None or pod["metadata"]["uid"] != self.uid:
            raise PodGone
        return pod

    def publish(self) -> None:
        status = copy.deepcopy(self.status)

        def write(p: Obj) -> None:
            p["status"] = status
        try:
            self.store.mutate("Pod", self.namespace, self.name, write)
        except ApiError:
            raise PodGone from None

    def cstatus(self, name: str) -> Obj:
        for key in ("initContainerStatuses", "containerStatuses"):
            for cs in self.status.get(key, []):
                if cs["name"] == name:
                    return cs
        raise KeyError(name)

    def deleting(self) -> bool:
        return bool(self.pod()["metadata"].get("deletionTimestamp")) \
            or self.node.stopping.is_set()

    # -- lifecycle

    def run(self) -> None:
        try:
            self._lifecycle()
        except PodGone:
            pass
        except Exception as e:
            print(f"pod {self.namespace}/{self.name}: kubelet error {e!r}", flush=True)
        finally:
            for proc in list(self.procs.values()):
                proc.remove()
            self.node.runtime.pod_gone(self.uid)
            with self.node.lock:
                self.node.workers.pop(self.uid, None)
            shutil.rmtree(self.dir, ignore_errors=True)

    def _lifecycle(self) -> None:
        self._accept()
        if self._wait_until_startable():
            self._setup_volumes()
            if self._run_init_containers():
                self._run_main_containers()
        while not self.deleting():
            time.sleep(RECHECK)
        self._finish_deletion()

    def _accept(self) -> None:
        s = self.status
        s.update({"phase": "Pending", "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
                  "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}], "startTime": rfc3339(),
                  "qosClass": "BestEffort" if cpu_request(self.spec) == 0 else "Burstable"})
        inits = self.spec.get("initContainers") or []
        if inits:
            s["initContainerStatuses"] = [_container_status(c, "PodInitializing") for c in inits]
            set_condition(s, "Initialized", False, "ContainersNotInitialized",
                          f"containers with incomplete status: [{inits[0]['name']}]")
        else:
            set_condition(s, "Initialized", True)
        s["containerStatuses"] = [_container_status(c, self._idle_reason(c["name"]))
                                  for c in self.spec["containers"]]
        set_condition(s, "Ready", False, "ContainersNotReady")
        set_condition(s, "ContainersReady", False, "ContainersNotReady")
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        (self.dir / "root").mkdir(exist_ok=True)
        self.publish()

    def _all_containers(self) -> list[Obj]:
        return (self.spec.get("initContainers") or []) + self.spec["containers"]

    def _wait_until_startable(self) -> bool:
        """Waits for images and configuration (secrets); False when the pod is deleted first."""
        while not self.deleting():
            blocked = self._blockers()
            changed = False
            for c in self._all_containers():
                cs = self.cstatus(c["name"])
                if c["name"] in blocked:
                    reason, message = blocked[c["name"]]
                    waiting = {"reason": reason, "message": message}
                else:
                    waiting = {"reason": self._idle_reason(c["name"])}
                if cs["state"] != {"waiting": waiting}:
                    cs["state"] = {"waiting": waiting}
                    changed = True
            if changed:
                self.publish()
            if not blocked:
                return True
            time.sleep(RECHECK)
        return False

    def _idle_reason(self, name: str) -> str:
        """Why a container that is not blocked waits: its pod is still being set up."""
        return "PodInitializing" if self.spec.get("initContainers") else "ContainerCreating"

    def _blockers(self) -> dict[str, tuple[str, str]]:
        blocked: dict[str, tuple[str, str]] = {}
        volume_error = self._volume_error()
        for c in self._all_containers():
            if not self.node.runtime.has_image(c["image"]):
                tries = self.pull_attempts[c["name"]] = self.pull_attempts.get(c["name"], 0) + 1
                if tries == 1:
                    blocked[c["name"]] = ("ErrImagePull", f'failed to pull and unpack image '
                                          f'"{c["image"]}": not in the fake node\'s image list')
                else:
                    blocked[c["name"]] = ("ImagePullBackOff",
                                          f'Back-off pulling image "{c["image"]}"')
            elif volume_error:
                blocked[c["name"]] = ("ContainerCreating", volume_error)
            else:
                try:
                    self._environment(c)
                    self.node.runtime.check(self.spec, c)
                except ConfigError as e:
                    blocked[c["name"]] = ("CreateContainerConfigError", str(e))
        return blocked

    def _secret(self, name: str) -> Obj | None:
        return self.store.get("Secret", self.namespace, name)

    def _volume_error(self) -> str | None:
        for vol in self.spec.get("volumes") or []:
            ref = vol.get("secret")
            if ref and not ref.get("optional") and self._secret(ref["secretName"]) is None:
                return (f'MountVolume.SetUp failed for volume "{vol["name"]}" : secret '
                        f'"{ref["secretName"]}" not found')
        return None

    # -- volumes and environment

    def _volume_dir(self, name: str) -> Path:
        return self.dir / "volumes" / name

    def _setup_volumes(self) -> None:
        for vol in self.spec.get("volumes") or []:
            d = self._volume_dir(vol["name"])
            d.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in vol:
                d.chmod(0o777)  # as a kubelet makes it: writable whatever the container's user
            ref = vol.get("secret")
            if ref:
                secret = self._secret(ref["secretName"]) or {}
                data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
                items = ref.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    if item["key"] in data:
                        f = d / item["path"]
                        f.parent.mkdir(parents=True, exist_ok=True)
                        f.write_bytes(data[item["key"]])
                        f.chmod(item.get("mode", ref.get("defaultMode", 0o644)))

    def _secret_value(self, name: str, key: str | None, optional: bool) -> dict[str, str] | None:
        secret = self._secret(name)
        if secret is None:
            if optional:
                return None
            raise ConfigError(f'secret "{name}" not found')
        data = {k: base64.b64decode(v).decode(errors="replace")
                for k, v in (secret.get("data") or {}).items()}
        if key is not None and key not in data:
            if optional:
                return None
            raise ConfigError(f"couldn't find key {key} in Secret {self.namespace}/{name}")
        return data

    def _field(self, path: str) -> str:
        meta = self.pod()["metadata"]
        simple = {"metadata.name": self.name, "metadata.namespace": self.namespace,
                  "metadata.uid": self.uid, "spec.nodeName": NODE_NAME,
                  "spec.serviceAccountName": self.spec.get("serviceAccountName", "default"),
                  "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1"}
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
        if m:
            return (meta.get(m[1]) or {}).get(m[2], "")
        raise ConfigError(f"fieldRef {path!r} is not supported by the fake kubelet")

    def _environment(self, c: Obj) -> dict[str, str]:
        """The declared environment (envFrom, then env), `$(VAR)` expanded, paths not mapped."""
        env: dict[str, str] = {}
        for src in c.get("envFrom") or []:
            if "secretRef" in src:
                ref = src["secretRef"]
                data = self._secret_value(ref["name"], None, bool(ref.get("optional")))
                for k, v in (data or {}).items():
                    env[src.get("prefix", "") + k] = v
            elif "configMapRef" in src and not src["configMapRef"].get("optional"):
                raise ConfigError(f'configmap "{src["configMapRef"]["name"]}" not found')
        for var in c.get("env") or []:
            source = var.get("valueFrom")
            if source is None:
                env[var["name"]] = expand(var.get("value", ""), env)
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                data = self._secret_value(ref["name"], ref["key"], bool(ref.get("optional")))
                if data is not None:
                    env[var["name"]] = data[ref["key"]]
            elif "fieldRef" in source:
                env[var["name"]] = self._field(source["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in source:
                if not source["configMapKeyRef"].get("optional"):
                    raise ConfigError(f'configmap "{source["configMapKeyRef"]["name"]}" not '
                                      'found')
            else:
                raise ConfigError(f"env {var['name']}: resourceFieldRef is not supported by "
                                  "the fake kubelet")
        return env

    # -- running containers

    def _launch(self, c: Obj) -> Running | str:
        """Starts the container; returns it, or why it could not start."""
        volumes = {v["name"]: self._volume_dir(v["name"]) for v in self.spec.get("volumes") or []}
        return self.node.runtime.start(Launch(
            self.namespace, self.name, self.uid, self.spec, c, self._environment(c), volumes,
            self.dir, self.dir / "logs" / f"{c['name']}.log", self.cstatus(c["name"])["restartCount"],
            self.labels))

    def _start(self, c: Obj) -> bool:
        cs = self.cstatus(c["name"])
        try:
            proc = self._launch(c)
        except ConfigError as e:
            proc = str(e)
        now = rfc3339()
        if isinstance(proc, str):
            cs["state"] = {"terminated": {"exitCode": 128, "reason": "StartError",
                                          "message": proc, "startedAt": "1970-01-01T00:00:00Z",
                                          "finishedAt": now}}
            return False
        self.procs[c["name"]] = proc
        cs["containerID"] = proc.container_id
        cs["imageID"] = proc.image_id
        cs["state"] = {"running": {"startedAt": now}}
        cs["started"] = True
        return True

    def _terminated(self, c: Obj, proc: Running, how: Exit) -> int:
        cs = self.cstatus(c["name"])
        started = "1970-01-01T00:00:00Z" if how.reason == "StartError" else \
            cs["state"].get("running", {}).get("startedAt", rfc3339())
        term = {"exitCode": how.code, "reason": how.reason, "startedAt": started,
                "finishedAt": rfc3339()}
        if how.message:
            term["message"] = how.message
        cs["state"] = {"terminated": term}
        cs["ready"] = False
        cs["started"] = False
        self.procs.pop(c["name"], None)
        proc.remove()   # a container's processes die with its pid 1
        return how.code

    def _run_containers(self, containers: list[Obj]) -> dict[str, int] | None:
        """Runs `containers` side by side until all have exited (restarting failures under
        restartPolicy OnFailure); exit codes, or None when the pod was deleted meanwhile."""
        codes: dict[str, int] = {}
        running: dict[str, Obj] = {}
        for c in containers:
            if self._start(c):
                running[c["name"]] = c
            else:
                codes[c["name"]] = 128
        self._on_started(containers)
        while running:
            if self.deleting():
                return None
            changed = False
            for name, c in list(running.items()):
                proc = self.procs[name]
                how = proc.poll()
                if how is None:
                    continue
                changed = True
                code = self._terminated(c, proc, how)
                del running[name]
                if code != 0 and self.spec["restartPolicy"] == "OnFailure":
                    cs = self.cstatus(name)
                    cs["lastState"] = cs["state"]
                    cs["restartCount"] += 1
                    if self._start(c):
                        running[name] = c
                        continue
                codes[name] = code
            if changed:
                self.publish()
            time.sleep(POLL)
        return codes

    def _on_started(self, containers: list[Obj]) -> None:
        names = {c["name"] for c in containers}
        if names & {c["name"] for c in self.spec["containers"]}:
            self.status["phase"] = "Running"
            for cs in self.status["containerStatuses"]:
                cs["ready"] = "running" in cs["state"]
            if all(cs["ready"] for cs in self.status["containerStatuses"]):
                set_condition(self.status, "Ready", True)
                set_condition(self.status, "ContainersReady", True)
        self.publish()

    def _run_init_containers(self) -> bool:
        for c in self.spec.get("initContainers") or []:
            codes = self._run_containers([c])
            if codes is None:
                return False
            if codes[c["name"]] != 0:
                self._finish_phase("Failed")
                return False
        if self.spec.get("initContainers"):
            set_condition(self.status, "Initialized", True)
            for cs in self.status["containerStatuses"]:
                cs["state"] = {"waiting": {"reason": "ContainerCreating"}}
            self.publish()
        return True

    def _run_main_containers(self) -> None:
        codes = self._run_containers(self.spec["containers"])
        if codes is not None:
            self._finish_phase("Succeeded" if all(v == 0 for v in codes.values()) else "Failed")

    def _finish_phase(self, phase: str) -> None:
        self.status["phase"] = phase
        set_condition(self.status, "Ready", False, "PodCompleted")
        set_condition(self.status, "ContainersReady", False, "PodCompleted")
        self.publish()

    # -- deletion

    def kill_processes(self, sig: int) -> None:
        for proc in list(self.procs.values()):
            proc.signal(sig)

    def _finish_deletion(self) -> None:
        """SIGTERM, SIGKILL after the grace period, final statuses, then the object goes."""
        pod = self.pod()
        grace = pod["metadata"].get("deletionGracePeriodSeconds",
                                    self.spec.get("terminationGracePeriodSeconds", 30))
        if self.procs:
            # The container threads may reap (and forget) a main process meanwhile: the
            # containers to kill are the ones running now, and all of them get the SIGKILL.
            running = list(self.procs.values())
            self.kill_processes(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while any(p.poll() is None for p in running) \
                    and time.monotonic() < deadline and not self.node.stopping.is_set():
                time.sleep(POLL / 2)
            for proc in running:
                proc.signal(signal.SIGKILL)
            ended = {id(proc): proc.wait_gone() for proc in running}  # as a runtime does: the
            containers = {c["name"]: c for c in self._all_containers()}  # container is gone
            for name, proc in list(self.procs.items()):  # once its processes are (then the pod)
                self._terminated(containers[name], proc, ended[id(proc)])
            if self.status.get("phase") not in ("Succeeded", "Failed"):
                self.status["phase"] = "Failed"
            self.publish()
        self.node._remove(self.namespace, self.name)

