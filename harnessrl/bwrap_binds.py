"""The system a bubblewrap sandbox shows read-only: the controller's job sandboxes
(`services/controller/sandbox/bwrap.py`) and a grader's nested sandbox for the tests it runs
(`harnessrl.graders.nested_sandbox`) make the same tree from here. Standard library only."""

from __future__ import annotations

import os

SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Of /etc, what programs need to run (libraries, certificates, time zone, names), not the
# machine's configuration and secrets.
ETC_PATHS = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
             "/etc/ssl", "/etc/ca-certificates", "/etc/ca-certificates.conf", "/etc/pki",
             "/etc/localtime", "/etc/timezone", "/etc/mime.types", "/etc/os-release",
             "/etc/nsswitch.conf", "/etc/host.conf", "/etc/hosts", "/etc/protocols",
             "/etc/services", "/etc/gitconfig", "/etc/python3", "/etc/fonts")


def system_binds() -> list[str]:
    """bwrap arguments binding the system read-only (merged /usr: /bin as its link)."""
    args: list[str] = []
    for p in (*SYSTEM_PATHS, *ETC_PATHS):
        if os.path.islink(p) and p in SYSTEM_PATHS:  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(p), p]
        elif os.path.exists(p):
            args += ["--ro-bind", p, p]
    return args
