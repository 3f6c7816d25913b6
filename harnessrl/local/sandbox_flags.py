"""The command line's sandbox and setup flags (`harnessrl up`, `run`, `eval`), docs/sandbox.md."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
from collections.abc import Iterable

from harnessrl.run_sandbox import sandbox_spec
from harnessrl.v1 import common_pb2 as c

log = logging.getLogger("harnessrl.local")


def add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setup", default="", help="trusted setup command, run before each "
                   "attempt's harness outside its sandbox, in its work folder (builds what "
                   "the harness may see; docs/sandbox.md)")
    p.add_argument("--sandbox", default="", help="the rollouts' sandbox settings as JSON "
                   "(SandboxSpec fields: read_only_paths, hidden_paths, egress, memory_mb, "
                   "max_processes, cpu_time_s; docs/sandbox.md)")
    p.add_argument("--no-sandbox", action="store_true", help="run the harness and grader "
                   "unsandboxed: only for code you trust (a harness could read the secret and "
                   "forge its reward); logged as such")


def fields(args: argparse.Namespace) -> dict[str, object]:
    """The --sandbox / --no-sandbox settings as SandboxSpec JSON fields (`ValueError`)."""
    try:
        out = json.loads(args.sandbox) if getattr(args, "sandbox", "") else {}
    except ValueError as exc:
        raise ValueError(f"--sandbox is not JSON: {exc}") from None
    if not isinstance(out, dict):
        raise ValueError("--sandbox must be a JSON object of SandboxSpec fields")
    if getattr(args, "no_sandbox", False):
        out["disabled"] = True
        log.warning("--no-sandbox: the harness and grader run unsandboxed")
    return out


def apply(spec: c.RunSpec, args: argparse.Namespace, hide: Iterable[str] = ()) -> c.RunSpec:
    """`spec` with the flags' sandbox (the task files in `hide` hidden) and setup step."""
    spec.sandbox.CopyFrom(sandbox_spec(fields(args), hide=hide))
    if getattr(args, "setup", ""):
        spec.setup_command[:] = shlex.split(args.setup)
    return spec


def trainer_flags(args: argparse.Namespace) -> list[str]:
    """The same for the trainer's command line (it builds the runs)."""
    out = ["--sandbox", json.dumps(fields(args))]
    if getattr(args, "setup", ""):
        out += ["--setup-command", json.dumps(shlex.split(args.setup))]
    return out
