"""`--nproc`: the rank launcher ends the group together and within a bound (no torch here: the
ranks are tiny Python programs that read the torchrun environment)."""

from __future__ import annotations

import signal
import sys
import time

from services.trainer.launch import RankGroup

RANK = "import os, sys, time; r = int(os.environ['RANK']); "


def ranks(code: str, n: int = 3, grace_s: float = 2.0) -> RankGroup:
    return RankGroup([sys.executable, "-c", RANK + code], n, grace_s=grace_s).start()


def test_all_ranks_succeed_with_the_torchrun_environment() -> None:
    code = ("assert os.environ['WORLD_SIZE'] == '3' and os.environ['LOCAL_RANK'] == str(r); "
            "assert os.environ['MASTER_ADDR'] and int(os.environ['MASTER_PORT']) > 0")
    assert ranks(code).wait(timeout_s=60) == 0


def test_a_failing_rank_ends_the_others_at_once() -> None:
    g = ranks("sys.exit(3) if r == 1 else time.sleep(120)")
    t0 = time.monotonic()
    assert g.wait(timeout_s=60) == 3
    assert time.monotonic() - t0 < 20 and all(p.poll() is not None for p in g.procs)


def test_a_rank_killed_by_a_signal_ends_the_group_with_128_plus_n() -> None:
    g = ranks("time.sleep(120)")
    time.sleep(0.5)
    g.procs[2].send_signal(signal.SIGKILL)
    assert g.wait(timeout_s=60) == 128 + signal.SIGKILL
    assert all(p.poll() is not None for p in g.procs)


def test_a_rank_left_running_after_rank_0_ended_is_killed_after_the_grace() -> None:
    g = ranks("time.sleep(0 if r == 0 else 120)", n=2, grace_s=1.0)
    t0 = time.monotonic()
    assert g.wait(timeout_s=60) == 1
    assert time.monotonic() - t0 < 20 and g.procs[1].poll() is not None
