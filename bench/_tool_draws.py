"""The modes bench's tool-latency draws, paired across modes (bench/_slow_tool_harness.py draws
them, bench/modes.py reads them back into its results).

A draw is one harness process's schedule of tool-step sleeps: lognormal, median
HARNESSRL_BENCH_TOOL_MEDIAN_S, sigma HARNESSRL_BENCH_TOOL_SIGMA, the k-th tool step sleeping
the k-th number of a random stream. The stream is seeded by what is the same in every mode:

- the bench's seed (HARNESSRL_BENCH_DRAW_SEED), so the seeds are independent replicates;
- the task id without the pool's prefix: sync sends `calc-017`, async and collocated the same
  task as `s000001-calc-017` (services/trainer/rollouts.py, `pool_tasks`);
- the rollout's index in its group (HARNESSRL_INDEX_IN_GROUP);
- the draw count: how many harness processes of this (task, index) pair started before this one
  in the same bench run. The pool modes draw spare groups, and draw a task's groups at other
  trainer steps than sync does, so a step number does not pair them; the count does: the n-th
  rollout of `calc-017` index 3 sleeps the same schedule in every mode.

The count is kept in a folder the bench passes (HARNESSRL_BENCH_DRAWS_DIR, one per run): each
harness process claims the first free file `<task>/<index>.<n>` (n = 0, 1, ...) with
O_CREAT | O_EXCL, which the kernel makes atomic: of processes racing for the same n exactly one
creates the file, the others see it exists and try n + 1. So every draw gets its own count, the
counts of a pair are 0..N-1 with no gap or repeat, and no lock is held. The claimed file is also
the draw's record: a JSON header line, then each sleep as drawn (flushed, so a rollout cancelled
mid-sleep still shows what it was sleeping). The harness needs a writable folder outside its work
folder, which a sandbox forbids: the bench runs its harnesses unsandboxed (as the published
figures of docs/modes.md were measured, before the sandbox existed).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

DIR_ENV = "HARNESSRL_BENCH_DRAWS_DIR"
SEED_ENV = "HARNESSRL_BENCH_DRAW_SEED"
MEDIAN_ENV = "HARNESSRL_BENCH_TOOL_MEDIAN_S"
SIGMA_ENV = "HARNESSRL_BENCH_TOOL_SIGMA"
# async and collocated modes' task ids: f"s{step:06d}-{id}" (services/trainer/rollouts.py)
POOL_PREFIX = re.compile(r"^s\d{6,}-")


def base_task_id(task_id: str) -> str:
    """The task's id as sync mode sends it: the pool modes' `s<step>-` prefix taken off."""
    return POOL_PREFIX.sub("", task_id, count=1)


def claim(draws_dir: Path, task: str, index: int) -> tuple[int, int]:
    """The draw count of (task, index) for a new draw, and the open (write-only) descriptor of
    its record file: the first `<task>/<index>.<n>` not there yet, created exclusively."""
    folder = draws_dir / quote(task, safe="")
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    while True:
        try:
            return n, os.open(folder / f"{index}.{n}", os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                              0o644)
        except FileExistsError:
            n += 1


class ToolDraw:
    """One draw: the sleeps of a harness process's tool steps, in order."""

    def __init__(self, seed: str, task: str, index: int, draw: int, median_s: float,
                 sigma: float, record_fd: int | None = None) -> None:
        self.task, self.index, self.draw = task, index, draw
        self.mu, self.sigma = math.log(median_s), sigma
        self.rng = random.Random(f"{seed}:{task}:{index}:{draw}")
        self.fd = record_fd
        self.sleeps: list[float] = []

    def next_sleep(self) -> float:
        """The next tool step's sleep (s), recorded before it is slept."""
        s = self.rng.lognormvariate(self.mu, self.sigma)
        self.sleeps.append(s)
        if self.fd is not None:
            os.write(self.fd, f"{s!r}\n".encode())
        return s


def start_draw(env: Mapping[str, str]) -> ToolDraw | None:
    """This harness process's draw, from its environment (None when the median is 0: no
    sleeps). Claims its count and writes its record's header."""
    median = float(env.get(MEDIAN_ENV, "2.0"))
    if median <= 0:
        return None
    raw_id = str(json.loads(env["HARNESSRL_TASK_JSON"]).get("id", ""))
    task, index = base_task_id(raw_id), int(env.get("HARNESSRL_INDEX_IN_GROUP", "0"))
    if not env.get(DIR_ENV):
        raise RuntimeError(f"{DIR_ENV} is not set: the draw count of ({task}, {index}) needs "
                           f"the bench's draws folder (bench/_tool_draws.py)")
    seed = env.get(SEED_ENV, "0")
    n, fd = claim(Path(env[DIR_ENV]), task, index)
    os.write(fd, (json.dumps({"task": task, "raw_id": raw_id, "index": index, "draw": n,
                              "seed": seed, "pid": os.getpid(), "started": time.time()})
                  + "\n").encode())
    return ToolDraw(seed, task, index, n, median, float(env.get(SIGMA_ENV, "1.2")), fd)


def read_draws(draws_dir: Path) -> list[dict[str, Any]]:
    """Every draw recorded in `draws_dir`: task (prefix off), raw_id (as the mode sent it),
    index, draw and the sleeps drawn (s), by (task, index, draw)."""
    out = []
    for path in sorted(draws_dir.glob("*/*")) if draws_dir.is_dir() else []:
        lines = path.read_text().splitlines()
        if not lines:  # claimed, header not written yet (the process was killed at once)
            continue
        head = json.loads(lines[0])
        out.append({"task": head["task"], "raw_id": head["raw_id"], "index": head["index"],
                    "draw": head["draw"],
                    "sleeps_s": [float(x) for x in lines[1:] if x.strip()]})
    return sorted(out, key=lambda d: (d["task"], d["index"], d["draw"]))


def pairing(draws_by_arm: Mapping[str, Iterable[Mapping[str, Any]]]) -> dict[str, Any]:
    """Whether the arms of one (seed, latency) slept the same schedules: each (task, index,
    draw) drawn by every arm must have the same sleeps as far as each arm's rollout went (a
    rollout may take more tool steps in one mode than another). `keys_in_all` such draws,
    `mismatched` the ones whose sleeps differ (0 when the draws are paired)."""
    by_arm = {arm: {(d["task"], d["index"], d["draw"]): list(d["sleeps_s"]) for d in draws}
              for arm, draws in draws_by_arm.items()}
    if not by_arm:
        return {"keys_in_all": 0, "mismatched": 0, "examples": []}
    common = set.intersection(*(set(k) for k in by_arm.values()))
    bad = []
    for key in sorted(common):
        scheds = [by_arm[arm][key] for arm in by_arm]
        n = min(len(s) for s in scheds)
        if any(s[:n] != scheds[0][:n] for s in scheds):
            bad.append(key)
    return {"keys_in_all": len(common), "mismatched": len(bad),
            "examples": [list(k) for k in bad[:5]]}
