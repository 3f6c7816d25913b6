"""Sandboxes for rollouts on the local backend (docs/sandbox.md): bubblewrap namespaces, an
allow-listed filesystem and environment, the gateway as the only way out, cgroup limits.

- `policy`: what one job may reach (`SandboxPolicy`, built from the run's spec);
- `bwrap`: makes the sandbox (`Sandbox`: checks the machine, wraps each job's command);
- `cgroups`: memory and process limits per attempt (v2, or v1);
- `egress`: the controller's side of the doors out (gateway, allowed egress);
- `init`: the first process inside (its side of the doors; runs the command).
"""

from services.controller.sandbox.bwrap import Sandbox, Unavailable
from services.controller.sandbox.policy import SandboxPolicy

__all__ = ["Sandbox", "SandboxPolicy", "Unavailable"]
