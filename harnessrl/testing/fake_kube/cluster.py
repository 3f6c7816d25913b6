"""The control plane behind the REST surface: create / patch / delete with the API server's
semantics (defaults, generated names, preconditions, propagation policies), the Job
controller, the TTL-after-finished controller and the garbage collector (ownerReferences)."""

from __future__ import annotations

import base64
import copy
import random
import uuid
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kubelet import Node, is_terminal, set_condition
from .objects import KINDS, ApiError, Obj, bad_request, conflict, not_found, parse_time, rfc3339
from .rbac import Admit
from .runtime import Runtime
from .store import Store
from .validation import (JOB_LABELS, check_body_kind, check_job_update, check_labels,
                         check_schema, check_secret, raise_if, validate_new)

SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"   # what the real apiserver uses for generateName
CONTROLLER_PERIOD = 0.1
KNOWN_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


def random_suffix() -> str:
    return "".join(random.choice(SUFFIX_CHARS) for _ in range(5))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def cond_true(status: Obj, type_: str) -> Obj | None:
    return next((c for c in status.get("conditions") or []
                 if c["type"] == type_ and c["status"] == "True"), None)


def controller_uid(obj: Obj) -> str | None:
    return next((r["uid"] for r in obj["metadata"].get("ownerReferences") or []
                 if r.get("controller")), None)


def _fold_string_data(secret: Obj) -> None:
    """stringData is write-only: merged into data (base64) and never stored."""
    for key, value in (secret.pop("stringData", None) or {}).items():
        secret.setdefault("data", {})[key] = base64.b64encode(value.encode()).decode()


@dataclass
class JobTrack:
    """What the Job controller remembers about one Job's pods (finalizer tracking's role)."""
    counted: set[str] = field(default_factory=set)
    seen_active: set[str] = field(default_factory=set)
    not_failures: set[str] = field(default_factory=set)   # pods it deleted for suspension


class Cluster:
    def __init__(self, root: Path, runtime: Runtime, node_cpu: float, kube_version: str,
                 namespaces: list[str]) -> None:
        self.store = Store()
        self.kube_version = kube_version
        self.namespaces = set(KNOWN_NAMESPACES) | set(namespaces)
        self.node = Node(self.store, root, runtime, node_cpu)
        self.tracks: dict[str, JobTrack] = {}
        self.stopping = threading.Event()

    def start(self) -> None:
        self.node.start()
        threading.Thread(target=self._controller_loop, name="controllers", daemon=True).start()

    def shutdown(self) -> None:
        self.stopping.set()
        self.node.kill_all()

    # ------------------------------------------------------------------ API verbs

    def create(self, kind: str, namespace: str, body: Any, dry_run: bool = False,
               admit: Admit | None = None) -> Obj:
        """`admit`: the validating admission plugins, called with (object, None) once the
        object is valid, before it is stored."""
        obj = check_body_kind(kind, body)
        meta = obj["metadata"]
        if meta.get("namespace", namespace) != namespace:
            raise bad_request("the namespace of the provided object does not match the "
                              "namespace sent on the request")
        if namespace not in self.namespaces:
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                           {"name": namespace, "kind": "namespaces"})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"][:58] + random_suffix()
        validate_new(kind, obj, self.kube_version)
        if admit is not None:
            admit(obj, None)
        for server_field in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp",
                             "deletionGracePeriodSeconds", "generation"):
            meta.pop(server_field, None)
        meta["namespace"] = namespace
        if kind == "Job":
            self._default_job(obj)
        else:
            _fold_string_data(obj)
            obj.setdefault("type", "Opaque")
        if dry_run:
            return obj
        return self.store.create(kind, obj)

    def _default_job(self, job: Obj) -> None:
        meta, spec = job["metadata"], job["spec"]
        uid = meta["uid"] = str(uuid.uuid4())
        meta["generation"] = 1
        template = spec["template"]
        tmeta = template.setdefault("metadata", {})
        if not meta.get("labels") and tmeta.get("labels"):
            meta["labels"] = dict(tmeta["labels"])
        if spec.get("completions") is None and spec.get("parallelism") is None:
            spec["completions"] = 1
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completionMode", "NonIndexed")
        spec.setdefault("suspend", False)
        spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        tmeta["labels"] = {**(tmeta.get("labels") or {}),
                           **dict(zip(JOB_LABELS, (uid, meta["name"], uid, meta["name"])))}
        pod_spec = template["spec"]
        pod_spec.setdefault("terminationGracePeriodSeconds", 30)
        pod_spec.setdefault("dnsPolicy", "ClusterFirst")
        pod_spec.setdefault("schedulerName", "default-scheduler")
        pod_spec.setdefault("securityContext", {})
        for c in (pod_spec.get("initContainers") or []) + pod_spec["containers"]:
            tag = c["image"].rpartition(":")[2] if ":" in c["image"].rpartition("/")[2] else ""
            c.setdefault("imagePullPolicy", "Always" if tag in ("", "latest") else "IfNotPresent")
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            c.setdefault("resources", {})
        job["status"] = {}

    def get(self, kind: str, namespace: str, name: str) -> Obj:
        obj = self.store.get(kind, namespace, name)
        if obj is None:
            raise not_found(KINDS[kind], name)
        return obj

    def patch(self, kind: str, namespace: str, name: str, patch: Any,
              dry_run: bool = False, admit: Admit | None = None) -> Obj:
        if not isinstance(patch, dict):
            raise bad_request("a merge patch must be a JSON object")

        def apply(obj: Obj) -> None:
            old = copy.deepcopy(obj)
            new = merge_patch(obj, patch)
            want_rv = (patch.get("metadata") or {}).get("resourceVersion")
            if want_rv is not None and want_rv != old["metadata"]["resourceVersion"]:
                raise conflict(KINDS[kind], name, "the object has been modified; please apply "
                               "your changes to the latest version and try again")
            for key in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion",
                        "generation", "deletionTimestamp"):
                if key in old["metadata"]:
                    new["metadata"][key] = old["metadata"][key]
            new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
            if "status" in old:
                new["status"] = old["status"]   # the main resource ignores status changes
            self._validate_update(kind, old, new)
            if admit is not None:
                admit(new, old)
            if kind == "Job" and new["spec"] != old["spec"]:
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            if not dry_run:
                obj.clear()
                obj.update(new)

        return self.store.mutate(kind, namespace, name, apply)

    def _validate_update(self, kind: str, old: Obj, new: Obj) -> None:
        name = old["metadata"]["name"]
        causes = check_schema(new, self.kube_version)
        causes = causes or check_labels(new["metadata"].get("labels"), "metadata.labels")
        if kind == "Job" and not causes:
            check_job_update(old, new)
        if kind == "Secret" and not causes:
            _fold_string_data(new)
            causes = check_secret(new)
            if old.get("immutable") and (new.get("data") != old.get("data")
                                         or not new.get("immutable")):
                causes = [("data", "Forbidden: field is immutable when `immutable` is set")]
        raise_if(causes, kind, name)

    def delete(self, kind: str, namespace: str, name: str, options: Obj) -> Obj:
        """Returns the response body: the object while it is still being deleted (a pod in
        its grace period, a foreground deletion), else a Success Status."""
        current = self.get(kind, namespace, name)
        self._check_preconditions(kind, current, options.get("preconditions") or {})
        if kind == "Pod":
            return self.delete_pod(namespace, name, options.get("gracePeriodSeconds"))
        policy = options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is not None:
            policy = "Orphan" if options["orphanDependents"] else "Background"
        if policy is None:
            # batch/v1 Jobs keep the legacy default: their pods are orphaned
            policy = "Orphan" if kind == "Job" else "Background"
        if policy not in ("Orphan", "Background", "Foreground"):
            raise ApiError(422, "Invalid", f'DeleteOptions.meta.k8s.io "" is invalid: '
                           f'propagationPolicy: Unsupported value: "{policy}": supported '
                           'values: "Foreground", "Background", "Orphan", "nil"')
        if policy == "Foreground":
            return self._mark_foreground(kind, namespace, name)
        if policy == "Orphan":
            self._orphan_dependents(current["metadata"]["uid"])
        gone = self.store.delete(kind, namespace, name)
        kind_obj = KINDS[kind]
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "group": kind_obj.group, "kind": kind_obj.resource,
                            "uid": gone["metadata"]["uid"]}}

    def _check_preconditions(self, kind: str, obj: Obj, pre: Obj) -> None:
        meta = obj["metadata"]
        for key in ("uid", "resourceVersion"):
            if pre.get(key) and pre[key] != meta[key]:
                raise conflict(KINDS[kind], meta["name"], f"Precondition failed: {key} in "
                               f"precondition: {pre[key]}, {key} in object meta: {meta[key]}")

    def delete_pod(self, namespace: str, name: str, grace: int | None = None) -> Obj:
        def mark(pod: Obj) -> None:
            meta = pod["metadata"]
            g = grace if grace is not None else pod["spec"].get("terminationGracePeriodSeconds",
                                                                  30)
            if meta.get("deletionGracePeriodSeconds") is not None:
                g = min(g, meta["deletionGracePeriodSeconds"])
            meta["deletionGracePeriodSeconds"] = g
            meta["deletionTimestamp"] = rfc3339(time.time() + g)
        return self.store.mutate("Pod", namespace, name, mark)

    def _mark_foreground(self, kind: str, namespace: str, name: str) -> Obj:
        def mark(obj: Obj) -> None:
            meta = obj["metadata"]
            meta.setdefault("deletionTimestamp", rfc3339())
            meta.setdefault("deletionGracePeriodSeconds", 0)
            if "foregroundDeletion" not in meta.setdefault("finalizers", []):
                meta["finalizers"].append("foregroundDeletion")
        return self.store.mutate(kind, namespace, name, mark)

    def _dependents(self, owner_uid: str) -> list[tuple[str, Obj]]:
        out = []
        for kind in KINDS:
            for obj in self.store.list(kind)[0]:
                if any(r["uid"] == owner_uid for r in obj["metadata"].get("ownerReferences")
                       or []):
                    out.append((kind, obj))
        return out

    def _orphan_dependents(self, owner_uid: str) -> None:
        def strip(obj: Obj) -> None:
            refs = [r for r in obj["metadata"]["ownerReferences"] if r["uid"] != owner_uid]
            if refs:
                obj["metadata"]["ownerReferences"] = refs
            else:
                del obj["metadata"]["ownerReferences"]
        for kind, obj in self._dependents(owner_uid):
            self._ignore_gone(self.store.mutate, kind, obj["metadata"]["namespace"],
                              obj["metadata"]["name"], strip)

    @staticmethod
    def _ignore_gone(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ApiError as e:
            if e.code != 404:
                raise
            return None

    def _delete_background(self, kind: str, obj: Obj) -> None:
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            return
        if kind == "Pod":
            self._ignore_gone(self.delete_pod, meta["namespace"], meta["name"])
        else:
            self._ignore_gone(self.store.delete, kind, meta["namespace"], meta["name"])

    # ------------------------------------------------------------------ controllers

    def _controller_loop(self) -> None:
        while not self.stopping.wait(CONTROLLER_PERIOD):
            try:
                self._collect_garbage()
                self._sync_jobs()
            except Exception as e:  # keep the controllers alive; the log shows what broke
                print(f"controllers: {e!r}", flush=True)

    def _collect_garbage(self) -> None:
        uids = self.store.uids()
        for kind in KINDS:
            for obj in self.store.list(kind)[0]:
                meta = obj["metadata"]
                refs = meta.get("ownerReferences") or []
                if refs and all(r["uid"] not in uids for r in refs):
                    self._delete_background(kind, obj)
                if "foregroundDeletion" in (meta.get("finalizers") or []):
                    dependents = self._dependents(meta["uid"])
                    for dep_kind, dep in dependents:
                        self._delete_background(dep_kind, dep)
                    if not dependents:
                        self._ignore_gone(self.store.delete, kind, meta["namespace"],
                                          meta["name"])

    def _sync_jobs(self) -> None:
        jobs, _ = self.store.list("Job")
        pods, _ = self.store.list("Pod")
        by_owner: dict[str, list[Obj]] = {}
        for pod in pods:
            owner = controller_uid(pod)
            if owner:
                by_owner.setdefault(owner, []).append(pod)
        live = set()
        for job in jobs:
            uid = job["metadata"]["uid"]
            live.add(uid)
            if not job["metadata"].get("deletionTimestamp"):
                self._sync_job(job, by_owner.get(uid, []))
        for uid in set(self.tracks) - live:
            del self.tracks[uid]

    def _sync_job(self, job: Obj, pods: list[Obj]) -> None:
        JobSync(self, job, pods).run()


class JobSync:
    """One pass of the Job controller over one Job."""

    def __init__(self, cluster: Cluster, job: Obj, pods: list[Obj]) -> None:
        self.cluster = cluster
        self.job = job
        self.meta = job["metadata"]
        self.spec = job["spec"]
        self.status: Obj = copy.deepcopy(job.get("status") or {})
        self.pods = pods
        self.track = cluster.tracks.setdefault(self.meta["uid"], JobTrack())
        self.now = time.time()

    def run(self) -> None:
        self._count_finished_pods()
        active = [p for p in self.pods if not is_terminal(p)
                  and not p["metadata"].get("deletionTimestamp")]
        terminating = [p for p in self.pods if not is_terminal(p)
                       and p["metadata"].get("deletionTimestamp")]
        if cond_true(self.status, "Complete") or cond_true(self.status, "Failed"):
            self._expire_after_ttl()
        elif cond_true(self.status, "FailureTarget") or cond_true(self.status,
                                                                  "SuccessCriteriaMet"):
            self._finish(active, terminating)
        elif self.spec.get("suspend"):
            self._suspend(active)
        else:
            self._progress(active)
        self._write(active, terminating)

    def _count_finished_pods(self) -> None:
        present = {p["metadata"]["uid"] for p in self.pods}
        for pod in self.pods:
            uid = pod["metadata"]["uid"]
            if uid in self.track.counted or uid in self.track.not_failures:
                continue
            phase = pod["status"].get("phase")
            if phase in ("Succeeded", "Failed"):
                self.track.counted.add(uid)
                key = "succeeded" if phase == "Succeeded" else "failed"
                self.status[key] = self.status.get(key, 0) + 1
            else:
                self.track.seen_active.add(uid)
        # a pod that vanished before it finished (deleted, deadline) counts as failed
        for uid in self.track.seen_active - present - self.track.counted \
                - self.track.not_failures:
            self.track.counted.add(uid)
            self.status["failed"] = self.status.get("failed", 0) + 1
        self.track.seen_active &= present

    def _condition(self, type_: str, value: bool, reason: str, message: str) -> None:
        set_condition(self.status, type_, value, reason, message)

    def _suspend(self, active: list[Obj]) -> None:
        for pod in active:
            self.track.not_failures.add(pod["metadata"]["uid"])
            self.cluster._delete_background("Pod", pod)
        active.clear()
        self._condition("Suspended", True, "JobSuspended", "Job suspended")

    def _progress(self, active: list[Obj]) -> None:
        if cond_true(self.status, "Suspended"):
            self._condition("Suspended", False, "JobResumed", "Job resumed")
            self.status["startTime"] = rfc3339(self.now)
        self.status.setdefault("startTime", rfc3339(self.now))
        deadline = self.spec.get("activeDeadlineSeconds")
        restarts = sum(cs.get("restartCount", 0) for p in self.pods
                       for cs in (p["status"].get("containerStatuses") or [])
                       + (p["status"].get("initContainerStatuses") or []))
        completions = self.spec.get("completions")
        succeeded = self.status.get("succeeded", 0)
        if deadline is not None and self.now >= parse_time(self.status["startTime"]) + deadline:
            self._condition("FailureTarget", True, "DeadlineExceeded",
                            "Job was active longer than specified deadline")
        elif self.status.get("failed", 0) + restarts > self.spec.get("backoffLimit", 6):
            self._condition("FailureTarget", True, "BackoffLimitExceeded",
                            "Job has reached the specified backoff limit")
        elif succeeded >= (completions or 1) and (completions is not None or not active):
            self._condition("SuccessCriteriaMet", True, "CompletionsReached",
                            "Reached expected number of succeeded pods")
        else:
            want = self.spec.get("parallelism", 1)
            if completions is not None:
                want = min(want, completions - succeeded)
            elif succeeded:
                want = 0
            for _ in range(want - len(active)):
                active.append(self._create_pod())
            return
        self._finish(active, [])

    def _finish(self, active: list[Obj], terminating: list[Obj]) -> None:
        """After FailureTarget / SuccessCriteriaMet: remove the remaining pods, then the
        terminal condition."""
        for pod in active:
            self.cluster._delete_background("Pod", pod)
        if active or terminating:
            active.clear()
            return
        target = cond_true(self.status, "FailureTarget")
        if target:
            self._condition("Failed", True, target["reason"], target["message"])
        else:
            self._condition("Complete", True, "CompletionsReached",
                            "Reached expected number of succeeded pods")
            self.status["completionTime"] = rfc3339(self.now)

    def _expire_after_ttl(self) -> None:
        ttl = self.spec.get("ttlSecondsAfterFinished")
        if ttl is None:
            return
        finished = self.status.get("completionTime") or (cond_true(self.status, "Failed")
                                                        or {}).get("lastTransitionTime")
        if finished and self.now >= parse_time(finished) + ttl:
            self.cluster._ignore_gone(self.cluster._mark_foreground, "Job",
                                      self.meta["namespace"], self.meta["name"])

    def _create_pod(self) -> Obj:
        template = self.spec["template"]
        tmeta = template.get("metadata") or {}
        base = self.meta["name"][:57] + "-"
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"generateName": base, "namespace": self.meta["namespace"],
                            "labels": dict(tmeta.get("labels") or {}),
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                                 "name": self.meta["name"],
                                                 "uid": self.meta["uid"], "controller": True,
                                                 "blockOwnerDeletion": True}]},
               "spec": copy.deepcopy(template["spec"]),
               "status": {"phase": "Pending", "qosClass": "BestEffort"}}
        if tmeta.get("annotations"):
            pod["metadata"]["annotations"] = dict(tmeta["annotations"])
        while True:
            pod["metadata"]["name"] = base + random_suffix()
            try:
                return self.cluster.store.create("Pod", copy.deepcopy(pod))
            except ApiError as e:
                if e.code != 409:
                    raise

    def _write(self, active: list[Obj], terminating: list[Obj]) -> None:
        s = self.status
        for key, value in (("active", len(active)),):
            if value:
                s[key] = value
            else:
                s.pop(key, None)
        s["ready"] = sum(1 for p in active if cond_true(p["status"], "Ready"))
        s["terminating"] = len(terminating)
        s.setdefault("uncountedTerminatedPods", {})
        if s != (self.job.get("status") or {}):
            status = copy.deepcopy(s)

            def write(job: Obj) -> None:
                if job["metadata"]["uid"] == self.meta["uid"]:
                    job["status"] = status
            self.cluster._ignore_gone(self.cluster.store.mutate, "Job", self.meta["namespace"],
                                      self.meta["name"], write)
