"""The REST surface: Kubernetes paths and JSON over HTTP/1.1 (stdlib `http.server`), bearer
token authentication and RBAC authorization of every request (`rbac`), chunked watch streams
and pod logs, discovery, and the `/fake/*` test hooks (non-resource paths: the admin's)."""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .cluster import Cluster
from .objects import (BY_RESOURCE, KINDS, ApiError, Obj, bad_request, fields_match, labels_match,
                      parse_field_selector, parse_label_selector)
from .rbac import (Admit, Attributes, Authorizer, Identity, forbidden, owner_references_admission,
                   request_attributes)
from .store import Event

PATH = re.compile(r"^/(?P<prefix>api/v1|apis/batch/v1)(?:/namespaces/(?P<ns>[^/]+))?"
                  r"/(?P<resource>[a-z]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[a-z]+))?)?/?$")
DEFAULT_WATCH_TIMEOUT = 1800
MERGE_PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


class FakeKubeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, cluster: Cluster, tokens: dict[str, Identity],
                 authorizer: Authorizer, owner_refs_admission: bool, kube_version: str,
                 bookmark_seconds: float) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.cluster = cluster
        self.tokens = tokens
        self.authorizer = authorizer
        self.owner_refs_admission = owner_refs_admission
        self.kube_version = kube_version
        self.bookmark_seconds = bookmark_seconds
        self.requests: list[Obj] = []
        self.requests_lock = threading.Lock()


def strip_for_list(obj: Obj) -> Obj:
    obj.pop("apiVersion", None)
    obj.pop("kind", None)
    return obj


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeKubeHTTPServer

    # ------------------------------------------------------------------ plumbing

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionResetError, BrokenPipeError):
            pass   # the client went away; nothing to answer

    def log_message(self, format: str, *args: Any) -> None:
        print(f"{self.address_string()} {format % args}", flush=True)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise bad_request(f"the body of the request could not be decoded as JSON: {e}") \
                from None

    def send_response(self, code: int, message: str | None = None) -> None:
        if self.entry is not None:
            self.entry["code"] = code
        super().send_response(code, message)

    def _send_json(self, code: int, body: Obj) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, code: int, text: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def _start_chunked(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    def _end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _authenticate(self) -> Identity:
        """The token's identity; no token or an unknown one is 401 (anonymous requests are
        refused, as with --anonymous-auth=false)."""
        auth = self.headers.get("Authorization", "")
        who = self.server.tokens.get(auth[7:]) if auth.startswith("Bearer ") else None
        if who is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return who

    entry: Obj | None = None   # this request's entry in the request log

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        body: Any = None
        self.entry = None
        try:
            body = self._body()
            who = self._authenticate()
            attrs = request_attributes(method, url.path, query)
            if not url.path.startswith("/fake/"):
                self._record(method, url.path, query, body, who, attrs)
            if not self.server.authorizer.allows(who, attrs):
                raise forbidden(who, attrs)
            if url.path.startswith("/fake/"):
                return self._fake(method, url.path, query)
            self._route(method, url.path, query, body, self._admission(who, attrs))
        except ApiError as e:
            if self.entry is not None and e.code == 403:
                self.entry["forbidden"] = e.message
            self._send_json(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _admission(self, who: Identity, attrs: Attributes) -> Admit | None:
        if not self.server.owner_refs_admission:
            return None
        return owner_references_admission(self.server.authorizer, who, attrs)

    def _record(self, method: str, path: str, query: dict[str, str], body: Any,
                who: Identity, attrs: Attributes) -> None:
        """Every API request: what it asked, as whom, and (filled in as it is answered) the
        status code and a 403's message."""
        self.entry = {
            "method": method, "path": path, "query": query, "body": copy.deepcopy(body),
            "content_type": self.headers.get("Content-Type"), "time": time.time(),
            "user": who.name, "verb": attrs.verb, "resource": attrs.combined,
            "group": attrs.group, "namespace": attrs.namespace, "code": None,
            "forbidden": None}
        with self.server.requests_lock:
            self.server.requests.append(self.entry)

    do_GET = lambda self: self._dispatch("GET")        # noqa: E731
    do_POST = lambda self: self._dispatch("POST")      # noqa: E731
    do_PUT = lambda self: self._dispatch("PUT")        # noqa: E731
    do_PATCH = lambda self: self._dispatch("PATCH")    # noqa: E731
    do_DELETE = lambda self: self._dispatch("DELETE")  # noqa: E731

    # ------------------------------------------------------------------ routing

    def _fake(self, method: str, path: str, query: dict[str, str]) -> None:
        cluster = self.server.cluster
        if method == "GET" and path == "/fake/stats":
            with cluster.store.cond:
                created = dict(cluster.store.created)
            return self._send_json(200, {"created": created, "requests": len(
                self.server.requests), "resourceVersion": cluster.store.rv})
        if method == "GET" and path == "/fake/requests":
            with self.server.requests_lock:
                entries = [dict(e) for e in self.server.requests[int(query.get("since", 0)):]]
            return self._send_json(200, {"requests": entries})
        if method == "POST" and path == "/fake/compact":
            return self._send_json(200, {"compactedAt": cluster.store.compact()})
        raise ApiError(404, "NotFound", "the server could not find the requested resource")

    def _route(self, method: str, path: str, query: dict[str, str], body: Any,
               admit: Admit | None) -> None:
        if method == "GET" and path in ("/version", "/version/"):
            major, minor = self.server.kube_version.split(".")[:2]
            return self._send_json(200, {"major": major, "minor": minor,
                                         "gitVersion": f"v{major}.{minor}.0-fake",
                                         "gitCommit": "0" * 40, "gitTreeState": "clean",
                                         "buildDate": "2026-01-01T00:00:00Z",
                                         "goVersion": "go1.25", "compiler": "gc",
                                         "platform": "linux/amd64"})
        if method == "GET" and path in ("/healthz", "/livez", "/readyz"):
            return self._send_text(200, b"ok")
        if method == "GET" and path.rstrip("/") in ("/api", "/apis"):
            return self._send_json(200, self._discovery(path.rstrip("/")))
        m = PATH.match(path)
        kind = BY_RESOURCE.get(m["resource"]) if m else None
        if m is None or kind is None or kind.path_prefix != "/" + m["prefix"]:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        ns, name, sub = m["ns"], m["name"], m["sub"]
        if name is None:
            self._collection(method, kind.name, ns, query, body, admit)
        elif sub is None or (sub == "status" and method == "GET"):
            if ns is None:
                raise ApiError(404, "NotFound", "the server could not find the requested "
                               "resource")
            self._item(method, kind.name, ns, name, query, body, admit)
        elif sub == "log" and kind.name == "Pod" and method == "GET" and ns is not None:
            self._pod_log(ns, name, query)
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")

    def _verb(self, kind: str, verb: str, method: str) -> None:
        if verb not in KINDS[kind].verbs:
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on "
                           f"the requested resource ({method} {KINDS[kind].resource})")

    @staticmethod
    def _discovery(path: str) -> Obj:
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"]}
        groups = sorted({k.group for k in KINDS.values() if k.group})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": g, "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
             "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"}}
            for g in groups]}

    def _collection(self, method: str, kind: str, ns: str | None, query: dict[str, str],
                    body: Any, admit: Admit | None) -> None:
        cluster = self.server.cluster
        if method == "GET":
            watch = query.get("watch", "").lower() in ("true", "1")
            self._verb(kind, "watch" if watch else "list", method)
            return self._watch(kind, ns, query) if watch else self._list(kind, ns, query)
        if method == "POST" and ns is not None:
            self._verb(kind, "create", method)
            obj = cluster.create(kind, ns, body, dry_run=query.get("dryRun") == "All",
                                 admit=admit)
            return self._send_json(201, obj)
        if method == "DELETE" and ns is not None:
            self._verb(kind, "deletecollection", method)
            items = self._selected(kind, ns, query)[0]
            options = self._delete_options(query, body)
            for obj in items:
                cluster._ignore_gone(cluster.delete, kind, ns, obj["metadata"]["name"], options)
            return self._list(kind, ns, {})
        raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on the "
                       f"requested resource ({method} {KINDS[kind].resource})")

    def _item(self, method: str, kind: str, ns: str, name: str, query: dict[str, str],
              body: Any, admit: Admit | None) -> None:
        cluster = self.server.cluster
        if method == "GET":
            self._verb(kind, "get", method)
            return self._send_json(200, cluster.get(kind, ns, name))
        if method == "PATCH":
            self._verb(kind, "patch", method)
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            if ctype not in MERGE_PATCH_TYPES:
                raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an "
                               f"unknown format - accepted media types include: "
                               f"{', '.join(MERGE_PATCH_TYPES)}")
            obj = cluster.patch(kind, ns, name, body, dry_run=query.get("dryRun") == "All",
                                admit=admit)
            return self._send_json(200, obj)
        if method == "DELETE":
            self._verb(kind, "delete", method)
            result = cluster.delete(kind, ns, name, self._delete_options(query, body))
            return self._send_json(200, result)
        raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on the "
                       f"requested resource ({method} {KINDS[kind].resource})")

    @staticmethod
    def _delete_options(query: dict[str, str], body: Any) -> Obj:
        options = dict(body) if isinstance(body, dict) else {}
        if "propagationPolicy" in query:
            options["propagationPolicy"] = query["propagationPolicy"]
        if "gracePeriodSeconds" in query:
            options["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
        return options

    # ------------------------------------------------------------------ list and watch

    def _selectors(self, query: dict[str, str]) -> tuple[Any, Any]:
        return (parse_label_selector(query.get("labelSelector")),
                parse_field_selector(query.get("fieldSelector")))

    def _matches(self, selectors: tuple[Any, Any], obj: Obj) -> bool:
        return labels_match(selectors[0], obj["metadata"].get("labels")) \
            and fields_match(selectors[1], obj)

    def _selected(self, kind: str, ns: str | None, query: dict[str, str]
                  ) -> tuple[list[Obj], int]:
        selectors = self._selectors(query)
        items, rv = self.server.cluster.store.list(kind, ns)
        return [o for o in items if self._matches(selectors, o)], rv

    def _list(self, kind: str, ns: str | None, query: dict[str, str]) -> None:
        items, rv = self._selected(kind, ns, query)
        meta: Obj = {"resourceVersion": str(rv)}
        start = 0
        if query.get("continue"):
            try:
                token = json.loads(base64.b64decode(query["continue"]))
                start = int(token["start"])
            except (ValueError, KeyError, TypeError):
                raise bad_request("continue key is not valid") from None
        limit = int(query.get("limit") or 0)
        page = items[start:start + limit] if limit else items[start:]
        if limit and start + limit < len(items):
            meta["continue"] = base64.b64encode(json.dumps(
                {"start": start + limit, "rv": rv}).encode()).decode()
            meta["remainingItemCount"] = len(items) - start - limit
        self._send_json(200, {"kind": f"{kind}List", "apiVersion": KINDS[kind].api_version,
                              "metadata": meta, "items": [strip_for_list(o) for o in page]})

    def _event_for(self, event: Event, ns: str | None, selectors: tuple[Any, Any]
                   ) -> tuple[str, Obj] | None:
        """What a filtered watcher sees of a store event, if anything (an object that stops
        matching the selector is DELETED for it, one that starts matching is ADDED)."""
        if ns is not None and event.obj["metadata"]["namespace"] != ns:
            return None
        new_ok = self._matches(selectors, event.obj)
        old_ok = event.old is not None and self._matches(selectors, event.old)
        if event.type == "DELETED":
            return ("DELETED", event.obj) if old_ok or new_ok else None
        if event.type == "ADDED" or (new_ok and not old_ok):
            return ("ADDED", event.obj) if new_ok else None
        if old_ok and not new_ok:
            deleted = dict(event.old or {})
            deleted["metadata"] = {**deleted["metadata"], "resourceVersion": str(event.rv)}
            return "DELETED", deleted
        return ("MODIFIED", event.obj) if new_ok else None

    def _send_event(self, type_: str, obj: Obj) -> None:
        self._chunk(json.dumps({"type": type_, "object": obj}).encode() + b"\n")

    def _watch(self, kind: str, ns: str | None, query: dict[str, str]) -> None:
        store = self.server.cluster.store
        selectors = self._selectors(query)
        timeout = float(query.get("timeoutSeconds") or DEFAULT_WATCH_TIMEOUT)
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        deadline = time.monotonic() + timeout
        rv_text = query.get("resourceVersion") or "0"
        if not rv_text.isdigit():
            raise bad_request(f"invalid resource version: {rv_text}")
        self._start_chunked("application/json")
        if rv_text == "0":
            items, cursor = self._selected(kind, ns, query)
            for obj in items:
                self._send_event("ADDED", obj)
        else:
            cursor = int(rv_text)
        last_bookmark = time.monotonic()
        while time.monotonic() < deadline:
            try:
                events, current = store.events_since(cursor)
            except ApiError as e:
                self._send_event("ERROR", e.status())
                break
            for event in events:
                if event.kind == kind and (seen := self._event_for(event, ns, selectors)):
                    self._send_event(*seen)
            cursor = current
            if bookmarks and time.monotonic() - last_bookmark >= self.server.bookmark_seconds:
                self._bookmark(kind, cursor)
                last_bookmark = time.monotonic()
            with store.cond:
                store.cond.wait_for(lambda: store.rv > cursor,
                                    timeout=max(0.0, min(deadline - time.monotonic(), 1.0)))
        else:
            if bookmarks:
                self._bookmark(kind, cursor)
        self._end_chunked()

    def _bookmark(self, kind: str, rv: int) -> None:
        self._send_event("BOOKMARK", {"kind": kind, "apiVersion": KINDS[kind].api_version,
                                      "metadata": {"resourceVersion": str(rv)}})

    # ------------------------------------------------------------------ pod logs

    def _pod_log(self, ns: str, name: str, query: dict[str, str]) -> None:
        pod = self.server.cluster.get("Pod", ns, name)
        containers = [c["name"] for c in (pod["spec"].get("initContainers") or [])
                      + pod["spec"]["containers"]]
        container = query.get("container")
        if not container:
            if len(pod["spec"]["containers"]) > 1:
                raise bad_request(f"a container name must be specified for pod {name}, choose "
                                  f"one of: [{' '.join(containers)}]")
            container = pod["spec"]["containers"][0]["name"]
        if container not in containers:
            raise bad_request(f"container {container} is not valid for pod {name}")
        state = self._container_state(pod, container)
        if "waiting" in state and not self._ever_started(pod, container):
            raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: '
                              f'{state["waiting"].get("reason", "ContainerCreating")}')
        path = self.server.cluster.node.pod_dir(ns, name) / "logs" / f"{container}.log"
        data = path.read_bytes() if path.exists() else b""
        offset = len(data)
        if query.get("tailLines"):
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(query["tailLines"]):]) if int(query["tailLines"]) else b""
        limit = int(query["limitBytes"]) if query.get("limitBytes") else None
        if limit is not None:
            data = data[:limit]
        if query.get("follow", "").lower() not in ("true", "1"):
            return self._send_text(200, data)
        self._follow_log(pod, container, path, data, offset, limit)

    @staticmethod
    def _container_state(pod: Obj, container: str) -> Obj:
        for key in ("initContainerStatuses", "containerStatuses"):
            for cs in (pod.get("status") or {}).get(key) or []:
                if cs["name"] == container:
                    return cs.get("state") or {}
        return {"waiting": {"reason": "ContainerCreating"}}

    @staticmethod
    def _ever_started(pod: Obj, container: str) -> bool:
        for key in ("initContainerStatuses", "containerStatuses"):
            for cs in (pod.get("status") or {}).get(key) or []:
                if cs["name"] == container:
                    return bool(cs.get("containerID"))
        return False

    def _follow_log(self, pod: Obj, container: str, path: Any, first: bytes, offset: int,
                    limit: int | None) -> None:
        """Streams the log until the container has terminated and its log is read, or the
        pod is gone."""
        cluster = self.server.cluster
        meta = pod["metadata"]
        self._start_chunked("text/plain")
        sent = len(first)
        self._chunk(first)
        while limit is None or sent < limit:
            current = cluster.store.get("Pod", meta["namespace"], meta["name"])
            done = current is None or current["metadata"]["uid"] != meta["uid"] \
                or "running" not in self._container_state(current, container)
            data = b""
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            if limit is not None:
                data = data[:limit - sent]
            offset += len(data)
            sent += len(data)
            self._chunk(data)
            if done and not data:
                break
            if not data:
                time.sleep(0.1)
        self._end_chunked()
