"""The gateway under load: N rollouts (default 1,000) calling at once through the gateway
against the stub engine, with the store live (Redis); each rollout its own keep-alive
connection and key, `--calls` calls one after another (every `--stream-every`-th streamed).
Then the store is checked: every call recorded once under its own rollout, nothing lost.

Prints one JSON line: rollouts, calls, ok, errors (must be 0), lost (must be 0), p50/p99/max
latency (ms), calls/s.

    python bench/gateway_load.py [--rollouts 1000] [--calls 5] [--stream-every 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._services import start_gateway, start_world  # noqa: E402
from harnessrl import procs  # noqa: E402
from harnessrl.clients import StoreClient  # noqa: E402
from harnessrl.credentials import CredentialSigner  # noqa: E402
from harnessrl.testing import gateway_load  # noqa: E402

SECRET = "bench-secret-0123456789abcdef0123"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=5, help="calls per rollout")
    ap.add_argument("--stream-every", type=int, default=5, help="each N-th call streamed (0: none)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hrl-bench-load-"))
    started: list[procs.ServiceProcess] = []
    try:
        _, store_addr, stub_url = start_world(work, "tiny", started)
        gw_proc, gw = start_gateway(work, store_addr, SECRET,
                                    [{"name": "stub", "base_url": stub_url, "model": "tiny"}])
        started.append(gw_proc)
        store = StoreClient.connect(store_addr, timeout=30)
        rollouts = gateway_load.make_rollouts(store, CredentialSigner(SECRET.encode()), "load",
                                              args.rollouts)
        report = asyncio.run(gateway_load.drive(gw["http_port"], [k for _, k in rollouts],
                                                args.calls, args.stream_every))
        problems = gateway_load.verify(store, [r for r, _ in rollouts], args.calls)
        store.close()
        print(json.dumps({**report.summary(), "lost_or_wrong_rollouts": len(problems),
                          "problems": problems[:5], "calls_per_rollout": args.calls,
                          "stream_every": args.stream_every}))
    finally:
        for p in reversed(started):
            p.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
