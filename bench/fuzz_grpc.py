"""The gRPC fuzz tests (`tests/test_fuzz_grpc.py`) with a larger count, run once for a note.

Runs the four services' fuzz tests with `HARNESSRL_FUZZ_EXAMPLES=N` inputs each (the trainer's
a third of that) under pytest, and ends with one JSON line: per service the inputs tried and
the statuses they got (kind:STATUS -> count), and whether every test passed (no UNKNOWN or
INTERNAL status, no hang, no crash, the canary data unchanged).

    python bench/fuzz_grpc.py [--examples 2000]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=2000, help="inputs per service")
    args = ap.parse_args()
    env = {**os.environ, "HARNESSRL_FUZZ_EXAMPLES": str(args.examples),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_fuzz_grpc.py", "-q", "-s",
                           "-p", "no:cacheprovider"], cwd=REPO, env=env, text=True,
                          capture_output=True, check=False)
    out = proc.stdout + proc.stderr
    tallies = {m.group(1): ast.literal_eval(m.group(2)) for m in re.finditer(
        r"^(store|gateway-admin|controller|trainer): (\{.*\})$", out, re.MULTILINE)}
    if proc.returncode:
        print(out[-6000:], file=sys.stderr)
    print(json.dumps({"examples_per_service": args.examples, "passed": proc.returncode == 0,
                      "seconds": round(time.monotonic() - t0, 1),
                      "inputs": {k: v.get("inputs", 0) for k, v in tallies.items()},
                      "statuses": tallies}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
