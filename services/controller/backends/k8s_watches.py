"""What the Kubernetes API says of the backend's Jobs and their pods, kept current by two
watches (Jobs and Pods carrying `app.kubernetes.io/managed-by=harnessrl`, in one namespace).

Each watch lists, then watches from the list's resourceVersion, resumed from the last one it
saw; it lists afresh every `relist_s`, and at once after a 410 Gone or an error. While the
API refuses a watch (401/403: the Role lacks list or watch) `start` raises with the API's
message. The client library is synchronous: each watch runs in a thread of its own and hands
its events to the event loop, where the tables are updated and `on_change` is told the names
of the Jobs concerned (the backend wakes those jobs).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s, watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from services.controller.backends import k8s_manifests as manifests
from services.controller.backends.k8s_api import why as _why

# the backend's own log: what its watches do is part of what the backend says
log = logging.getLogger("services.controller.backends.kubernetes")

SELECTOR = f"{manifests.MANAGED_BY_LABEL}={manifests.MANAGED_BY}"
_WATCH_TIMEOUT_S = 5  # a watch is resumed this often (from its last resourceVersion)


class JobWatches:
    def __init__(self, batch: k8s.BatchV1Api, core: k8s.CoreV1Api, namespace: str,
                 relist_s: float, on_change: Callable[[str], None]) -> None:
        self.namespace = namespace
        self.relist_s = relist_s
        self._listers = {"jobs": batch.list_namespaced_job, "pods": core.list_namespaced_pod}
        self._on_change = on_change
        self.jobs: dict[str, Any] = {}  # Job name -> V1Job, as the watch last saw it
        self.pods: dict[str, Any] = {}  # Job name -> its (newest) V1Pod
        self.synced = {"jobs": threading.Event(), "pods": threading.Event()}  # first list
        self._denied: dict[str, str] = {}  # "jobs"/"pods" -> why the API refuses its watch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    async def start(self, resume_from: str | None = None) -> None:
        """Starts the two watches (once) and waits for their first list; `resume_from`: a
        resourceVersion to watch from before any list (what a watch whose connection broke
        does). Raises `PermissionError` while the API refuses a watch."""
        if not self._threads:
            self._loop = asyncio.get_running_loop()
            for kind, lister in self._listers.items():
                t = threading.Thread(target=self._watch, args=(kind, lister, resume_from),
                                     daemon=True, name=f"k8s-watch-{kind}")
                t.start()
                self._threads.append(t)
            for ev in self.synced.values():  # the first list, so adopt sees what exists
                await asyncio.to_thread(ev.wait, 30)
        if self._denied:
            raise PermissionError("; ".join(self._denied.values()))

    def stop(self) -> None:
        """The watches end (each within `_WATCH_TIMEOUT_S`)."""
        self._stop.set()

    def _watch(self, kind: str, lister: Callable[..., Any], rv: str | None) -> None:
        """List, then watch from the list's resourceVersion. A watch ends every
        `_WATCH_TIMEOUT_S` and resumes from the last resourceVersion it saw; every `relist_s`
        the state is listed afresh, and at once after a 410 Gone (that resourceVersion is
        compacted away) or an error."""
        listed_at = time.monotonic()
        while not self._stop.is_set():
            try:
                if rv is None or time.monotonic() - listed_at > self.relist_s:
                    listed = lister(self.namespace, label_selector=SELECTOR)
                    listed_at = time.monotonic()
                    rv = listed.metadata.resource_version
                    self._deliver(kind, "LIST", listed.items)
                    self.synced[kind].set()
                w = k8s_watch.Watch()
                for event in w.stream(lister, self.namespace, label_selector=SELECTOR,
                                      resource_version=rv, timeout_seconds=_WATCH_TIMEOUT_S,
                                      allow_watch_bookmarks=True):
                    if self._stop.is_set():
                        w.stop()
                        break
                    rv = event["raw_object"].get("metadata", {}).get("resourceVersion", rv)
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._deliver(kind, event["type"], [event["object"]])
                self._denied.pop(kind, None)
            except ApiException as exc:
                rv = None
                if exc.status == 410:
                    log.info("watch of %s: 410 Gone (resourceVersion compacted); listing "
                             "again", kind)
                else:
                    log.warning("watch of %s: %s; listing again", kind, _why(exc))
                    if exc.status in (401, 403):
                        self._denied[kind] = _why(exc)
                        self.synced[kind].set()  # nothing to wait for
                    self._stop.wait(1.0)
            except Exception as exc:  # noqa: BLE001 - the API server away: keep trying
                rv = None
                if self._stop.is_set():
                    return
                log.warning("watch of %s failed (%s: %s); listing again", kind,
                            type(exc).__name__, exc)
                self._stop.wait(1.0)

    def _deliver(self, kind: str, type_: str, objs: list[Any]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_event, kind, type_, objs)

    def _on_event(self, kind: str, type_: str, objs: list[Any]) -> None:
        """Updates the tables (on the event loop) and tells `on_change` the Jobs concerned."""
        table = self.jobs if kind == "jobs" else self.pods
        touched = set()
        if type_ == "LIST":
            seen = set()
            for obj in objs:
                name = self._owner_name(kind, obj)
                seen.add(name)
                table[name] = obj
            touched = set(table) - seen | seen
            for gone in set(table) - seen:
                del table[gone]
        else:
            for obj in objs:
                name = self._owner_name(kind, obj)
                touched.add(name)
                if type_ == "DELETED":
                    if kind == "jobs" or (name in table and
                                          table[name].metadata.name == obj.metadata.name):
                        table.pop(name, None)
                else:
                    table[name] = obj
        for name in touched:
            self._on_change(name)

    @staticmethod
    def _owner_name(kind: str, obj: Any) -> str:
        if kind == "jobs":
            return str(obj.metadata.name)
        labels = obj.metadata.labels or {}
        return str(labels.get("batch.kubernetes.io/job-name") or labels.get("job-name") or "")
