"""The sandbox a grader runs the agent's tests in, nested inside the grader's own.

The tests import the agent's code, so the test process is the agent's. Inside this sandbox
(bubblewrap, like the controller's job sandboxes) it sees:
- the system read-only (`harnessrl.bwrap_binds`) and the test Python's install read-only (its
  prefixes and the site-packages under them; nothing else of `sys.path`, so not a source tree
  that an editable install points at);
- one writable folder, `work`: the grader's scratch copy of the repository and the run's
  report files; a private `/tmp`;
- the runner script, bound read-only on its own at `/run/harnessrl/`.

It does not see: the task files (masked even where they lie under a bound folder: the gold fix,
the hidden tests), the grader's output (its working directory is not bound), the grader's
processes (its own pid namespace, and no `/proc` at all: the kernel refuses a new `/proc` in a
sandbox nested in the controller's, and binding the outer one would show the grader), the
network (none), the grader's environment (cleared). It cannot make a sandbox of its own
(`--disable-userns`), and its processes die with the runner (`--die-with-parent`).

Tests that need `/proc` or the network do not work in it: pass `sandbox=False` (the grader's
`--test-sandbox none`) for those, and the grade's report says the tests ran unsandboxed.
Standard library only (grader images copy it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from harnessrl.bwrap_binds import system_binds

INSIDE = Path("/run/harnessrl")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp",
       "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
FIX = ("bubblewrap must be installed (`apt-get install bubblewrap`) and user namespaces "
       "allowed; in a container that means `--security-opt seccomp=unconfined "
       "--security-opt apparmor=unconfined` (or a profile that allows unshare); the "
       "controller's local sandbox allows a grader one nested sandbox")


class Unavailable(RuntimeError):
    """No nested sandbox can be made here; the message says why and the fix."""


def python_paths(python: str) -> list[Path]:
    """What `python` needs to run: its executable's real folder, its prefixes, and the entries
    of its `sys.path` that lie under them (site-packages)."""
    if python == sys.executable:
        exe, prefixes, path = python, [sys.prefix, sys.base_prefix, sys.exec_prefix,
                                       sys.base_exec_prefix], sys.path
    else:
        probe = subprocess.run(
            [python, "-I", "-c", "import json, sys; print(json.dumps([sys.executable, "
             "[sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix], "
             "sys.path]))"], capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            raise Unavailable(f"cannot run the test Python {python}: {probe.stderr.strip()}")
        exe, prefixes, path = json.loads(probe.stdout)
    roots = {Path(p) for p in prefixes} | {Path(os.path.realpath(p)) for p in prefixes}
    roots |= {Path(os.path.realpath(exe)).parent.parent}
    found = set(roots)
    for entry in path:
        p = Path(entry)
        if entry and p.exists() and any(p == r or r in p.parents for r in roots):
            found.add(Path(os.path.realpath(p)))
    outer = sorted(p for p in found if not any(o in p.parents for o in found if o != p))
    return [p for p in outer if p.exists() and str(p) != "/"]


class NestedSandbox:
    """Wraps a command so that it runs in the nested sandbox (see the module docstring)."""

    def __init__(self, python: str, work: Path, *, hide: Iterable[Path] = (),
                 files: Sequence[Path] = ()):
        """`work`: the one writable folder; `hide`: paths masked wherever they are bound (the
        task files); `files`: read-only files shown at `INSIDE/<name>` (the runner script)."""
        self.bwrap = shutil.which("bwrap") or ""
        if not self.bwrap:
            raise Unavailable(f"no bwrap on PATH: {FIX}")
        self.python = python
        self.work = Path(work).resolve()
        self.read_only = python_paths(python)
        self.hide = [Path(os.path.realpath(p)) for p in hide]
        self.files = list(files)

    def inside(self, file: Path) -> str:
        """Where the sandbox sees one of `files`."""
        return str(INSIDE / file.name)

    def argv(self, command: list[str], env: dict[str, str] | None = None) -> list[str]:
        """`command` in the sandbox, with `ENV` and `env` its whole environment."""
        args = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
                "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--uid", "1000", "--gid", "1000", "--hostname", "tests", "--clearenv",
                *[a for k, v in {**ENV, **(env or {})}.items() for a in ("--setenv", k, v)],
                *system_binds(), "--dev", "/dev", "--tmpfs", "/tmp"]
        for p in self.read_only:
            args += ["--ro-bind", str(p), str(p)]
        for h in self.hide:
            if h.exists() and any(h == p or p in h.parents for p in self.read_only):
                args += (["--tmpfs", str(h)] if h.is_dir()
                         else ["--ro-bind", "/dev/null", str(h)])
        for f in self.files:
            args += ["--ro-bind", str(f), self.inside(f)]
        args += ["--bind", str(self.work), str(self.work), "--remount-ro", "/",
                 "--chdir", str(self.work), "--", *command]
        return args

    def check(self) -> None:
        """Raises `Unavailable` (why, and the fix) unless the sandbox can be made here."""
        probe = subprocess.run(self.argv(["/usr/bin/env", "true"]),
                               capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            raise Unavailable(f"bubblewrap cannot make the tests' sandbox here "
                              f"({probe.stderr.strip()[-300:]}); {FIX}")
