"""What /proc says of the machine's processes, for the benches that measure CPU
(bench/gateway_overhead.py, bench/modes.py)."""

from __future__ import annotations

import os
from typing import NamedTuple

TICK = os.sysconf("SC_CLK_TCK")


class ProcStat(NamedTuple):
    ppid: int
    cpu_s: float
    """user + system time of the process itself (all its threads)"""
    reaped_cpu_s: float
    """user + system time of its children that ended and that it waited for"""


def proc_table() -> dict[int, ProcStat]:
    """Every process now: pid -> ProcStat (one that ends while it is read is left out)."""
    table: dict[int, ProcStat] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the command: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
        table[int(entry)] = ProcStat(int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK,
                                     (int(fields[13]) + int(fields[14])) / TICK)
    return table


def children(table: dict[int, ProcStat]) -> dict[int, list[int]]:
    """pid -> the pids of its live children."""
    out: dict[int, list[int]] = {}
    for pid, st in table.items():
        out.setdefault(st.ppid, []).append(pid)
    return out
