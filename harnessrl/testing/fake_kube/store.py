"""The fake API server's storage: objects by (kind, namespace, name), one global
resourceVersion counter and the event history that watches replay (etcd's role)."""

from __future__ import annotations

import builtins
import copy
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .objects import KINDS, Obj, already_exists, expired, not_found, rfc3339

HISTORY_LIMIT = 20000


@dataclass
class Event:
    rv: int
    type: str            # ADDED, MODIFIED, DELETED
    kind: str
    obj: Obj             # the new state (the last state for DELETED)
    old: Obj | None      # the state before (None for ADDED)


class Store:
    """Thread-safe; every method returns deep copies, so callers never share state."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.rv = 1    # never "0": to a watch or list that means "any version"
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {k: {} for k in KINDS}
        self._events: list[Event] = []
        self.history_start = 0   # a watch from a resourceVersion below this gets 410
        self.created: Counter[str] = Counter()

    # -- reads

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        with self.cond:
            obj = self._objects[kind].get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, kind: str, namespace: str | None = None) -> tuple[list[Obj], int]:
        """Objects sorted by (namespace, name), as etcd's key order; and the list's rv."""
        with self.cond:
            items = [copy.deepcopy(o) for (ns, _), o in sorted(self._objects[kind].items())
                     if namespace is None or ns == namespace]
            return items, self.rv

    def uids(self) -> set[str]:
        with self.cond:
            return {o["metadata"]["uid"] for objs in self._objects.values()
                    for o in objs.values()}

    def events_since(self, rv: int) -> tuple[builtins.list[Event], int]:
        """Events after `rv` and the current rv; raises 410 Expired when `rv` is older than
        the retained history."""
        with self.cond:
            if rv < self.history_start:
                raise expired(rv, self.history_start)
            # events are in rv order; rv values are dense only across all kinds
            lo = next((i for i in range(len(self._events) - 1, -1, -1)
                       if self._events[i].rv <= rv), -1) + 1
            return self._events[lo:], self.rv

    # -- writes

    def _emit(self, type_: str, kind: str, obj: Obj, old: Obj | None) -> None:
        self._events.append(Event(self.rv, type_, kind, copy.deepcopy(obj), old))
        if len(self._events) > HISTORY_LIMIT:
            dropped = self._events[: len(self._events) - HISTORY_LIMIT]
            del self._events[: len(dropped)]
            self.history_start = dropped[-1].rv
        self.cond.notify_all()

    def create(self, kind: str, obj: Obj) -> Obj:
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        with self.cond:
            if key in self._objects[kind]:
                raise already_exists(KINDS[kind], meta["name"])
            self.rv += 1
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = str(self.rv)
            meta["creationTimestamp"] = rfc3339()
            self._objects[kind][key] = copy.deepcopy(obj)
            self.created[kind] += 1
            self._emit("ADDED", kind, obj, None)
            return copy.deepcopy(obj)

    def mutate(self, kind: str, namespace: str, name: str,
               change: Callable[[Obj], None]) -> Obj:
        """Applies `change` to a copy of the object; stores it (new rv, MODIFIED event) only
        when something changed. Raises NotFound."""
        with self.cond:
            current = self._objects[kind].get((namespace, name))
            if current is None:
                raise not_found(KINDS[kind], name)
            new = copy.deepcopy(current)
            change(new)
            new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            if new == current:
                return copy.deepcopy(current)
            self.rv += 1
            new["metadata"]["resourceVersion"] = str(self.rv)
            self._objects[kind][(namespace, name)] = new
            self._emit("MODIFIED", kind, new, copy.deepcopy(current))
            return copy.deepcopy(new)

    def delete(self, kind: str, namespace: str, name: str) -> Obj:
        with self.cond:
            current = self._objects[kind].pop((namespace, name), None)
            if current is None:
                raise not_found(KINDS[kind], name)
            old = copy.deepcopy(current)
            self.rv += 1
            current["metadata"]["resourceVersion"] = str(self.rv)
            self._emit("DELETED", kind, current, old)
            return copy.deepcopy(current)

    def compact(self) -> int:
        """Drops the watch history, as an etcd compaction does."""
        with self.cond:
            self._events.clear()
            self.history_start = self.rv
            return self.rv
