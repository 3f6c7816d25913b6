"""What a sandbox costs an attempt: job start to end of a trivial harness (`true`) through the
local backend, sandboxed (bubblewrap, cgroup, doors) and unsandboxed, interleaved in one run;
then the same sandboxed jobs while another attempt's fork bomb and memory hog run, to show
they are contained without harm to the others.

    python bench/sandbox_start.py [--jobs 200] [--out bench/results/sandbox_start.json]

Prints p50/p99 (ms) of each arm, their ratio, and the contained bomb's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.controller.backends import JobSpec, LocalBackend  # noqa: E402
from services.controller.sandbox import Sandbox  # noqa: E402
from services.controller.sandbox.policy import SandboxPolicy, runtime_paths  # noqa: E402

BOMB = """
import os, time
n = 0
try:
    while n < 5000:
        if os.fork() == 0:
            time.sleep(20); os._exit(0)
        n += 1
except OSError:
    pass
print("bomb stopped at", n, flush=True)
blocks = []
try:
    while len(blocks) < 256:
        blocks.append(bytearray(16 << 20))
except MemoryError:
    pass
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def one(backend: LocalBackend, root: Path, i: int, sandboxed: bool,
              argv: list[str] | None = None, memory_mb: int = 4096,
              max_processes: int = 512) -> tuple[float, int]:
    records = root / f"a{i}"
    work = records / "work"
    work.mkdir(parents=True, exist_ok=True)
    policy = SandboxPolicy(work=work, read_only=tuple(runtime_paths()), memory_mb=memory_mb,
                           max_processes=max_processes) if sandboxed else None
    t0 = time.perf_counter()
    await backend.launch(JobSpec(job_id=f"j{i}", argv=argv or ["true"], env={},
                                 workdir=records, cwd=work, timeout_s=60, sandbox=policy))
    result = await backend.wait(f"j{i}")
    await backend.cleanup(f"j{i}")
    return (time.perf_counter() - t0) * 1000, result.exit_code


async def main_async(a: argparse.Namespace) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="hrl-sbx-bench-"))
    sandbox = Sandbox(root / "doors")
    sandbox.check()
    backend = LocalBackend(sandbox=sandbox)
    times: dict[str, list[float]] = {"unsandboxed": [], "sandboxed": []}
    ids = itertools.count()
    for i in range(a.jobs):  # interleaved: both arms see the same machine
        for arm in (("unsandboxed", "sandboxed") if i % 2 else ("sandboxed", "unsandboxed")):
            ms, rc = await one(backend, root, next(ids), arm == "sandboxed")
            assert rc == 0, (arm, rc)
            times[arm].append(ms)
    # a fork bomb and memory hog in one sandbox (64 processes, 256 MB), others starting beside
    bomb_id = next(ids)
    bomb = asyncio.ensure_future(one(backend, root, bomb_id, True,
                                     [sys.executable, "-c", BOMB], 256, 64))
    await asyncio.sleep(0.5)
    beside = [(await one(backend, root, next(ids), True))[0] for _ in range(a.jobs // 4)]
    bomb_ms, bomb_rc = await bomb
    out_text = (root / f"a{bomb_id}" / "stdout.log").read_text().strip()
    await backend.close()
    res = {arm: {"p50_ms": round(pct(x, .5), 1), "p99_ms": round(pct(x, .99), 1),
                 "mean_ms": round(statistics.fmean(x), 1), "n": len(x)}
           for arm, x in times.items()}
    res["ratio_p50"] = round(res["sandboxed"]["p50_ms"] / res["unsandboxed"]["p50_ms"], 2)
    res["added_p50_ms"] = round(res["sandboxed"]["p50_ms"] - res["unsandboxed"]["p50_ms"], 1)
    res["beside_a_fork_bomb"] = {"p50_ms": round(pct(beside, .5), 1),
                                 "p99_ms": round(pct(beside, .99), 1), "n": len(beside),
                                 "bomb": out_text, "bomb_exit_code": bomb_rc}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=200, help="jobs per arm")
    ap.add_argument("--out", default="", help="write the figures here too (JSON)")
    a = ap.parse_args()
    res = asyncio.run(main_async(a))
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
