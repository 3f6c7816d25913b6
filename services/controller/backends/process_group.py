"""A local job's process group, seen from outside: who is in it, whether its leader still is
the process it was, and signalling all of it (`local.LocalBackend`)."""

from __future__ import annotations

import os


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    members: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: ask the kernel whether the group still exists at all
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(name))
    return members


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None when it does not run; with
    the pid it names one process, whatever pids the kernel reuses later."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def signal_group(pgid: int, sig: int) -> bool:
    """Sends `sig` to the group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies left, or a member changed uid: nothing to signal
        return False
    return True
