"""A run's sandbox section (`RunSpec.sandbox`, docs/sandbox.md) from its JSON fields.

The trainer, `harnessrl eval` and `harnessrl up` build their runs' `SandboxSpec` here: the
fields a user gives (`{"read_only_paths": [...], "egress": [...]}`, `{"disabled": true}` for a
trusted harness), with the task files they read among its hidden paths, so that a harness whose
code lies beside its task file (which may hold the answers) cannot read it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf import json_format

from harnessrl.v1 import common_pb2 as c


def sandbox_spec(fields: Mapping[str, Any] | None = None, hide: Iterable[str] = (),
                 disabled: bool = False) -> c.SandboxSpec:
    """`ValueError` names a field that is not a SandboxSpec's."""
    spec = c.SandboxSpec()
    try:
        json_format.ParseDict(dict(fields or {}), spec)
    except json_format.ParseError as exc:
        raise ValueError(f"sandbox settings: {exc}") from None
    for path in hide:
        if path and os.path.abspath(path) not in spec.hidden_paths:
            spec.hidden_paths.append(os.path.abspath(path))
    spec.disabled = spec.disabled or disabled
    return spec
