"""Rendezvous (highest random weight) hashing: every replica that knows the same names picks
the same one for a key, and a name that joins or leaves moves only the keys it wins or won.
A rollout's engine among the engines that serve it (engines.py, with peers) and a rollout's
owner among the live replicas (replicas.py) are chosen by it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def weight(key: str, name: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest()


def choose(key: str, names: Iterable[str]) -> str | None:
    """The name `key` hashes highest with (None when there is none)."""
    return max(names, key=lambda n: weight(key, n), default=None)
