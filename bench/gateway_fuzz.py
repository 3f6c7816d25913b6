"""Generated bad input against the gateway's HTTP surface, long form (10,000 inputs by default;
`tests/test_gateway_fuzz.py` runs a bounded count with a fixed seed).

A real gateway, store (Redis) and the stub engine; inputs from `harnessrl.testing.http_fuzz`
(hypothesis) against every data-plane route: chat completions, completions, Responses,
Messages and Messages count_tokens (streamed and not), the reward report. Kinds: one field
mutated under a valid key (`mutated`, any value) or given a JSON kind its API does not accept
(`wrong_type`: must be 400 naming the field in the API's own error shape), at least half
together; bad keys, malformed JSON, odd framing and headers. Afterwards the store must hold
exactly the calls that were answered, under the key's own rollout, and nothing for the others.
Prints one JSON line: inputs by kind and key, wrong_type inputs by request, statuses, failures
by reason (must be none) with examples, the store check.

    python bench/gateway_fuzz.py [--examples 10000] [--seed 1] [--only-wrong-type]
    python bench/gateway_fuzz.py --every-wrong-type
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._services import start_world  # noqa: E402
from harnessrl import procs  # noqa: E402
from harnessrl.clients import StoreClient  # noqa: E402
from harnessrl.credentials import CredentialSigner  # noqa: E402
from harnessrl.testing import http_fuzz  # noqa: E402
from harnessrl.v1 import common_pb2 as c  # noqa: E402
from harnessrl.v1 import store_pb2 as spb  # noqa: E402

SECRET = "bench-secret-0123456789abcdef0123"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=10_000, help="inputs to send (10,000)")
    ap.add_argument("--seed", type=int, default=1, help="hypothesis seed (1)")
    ap.add_argument("--only-wrong-type", action="store_true",
                    help="wrong_type inputs only (one field of a valid request of each API, "
                         "streamed and not, given a JSON kind the API does not accept)")
    ap.add_argument("--every-wrong-type", action="store_true",
                    help="each wrong_type input once (every field of every request with every "
                         "kind it does not accept; --examples and --seed unused)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hrl-bench-fuzz-"))
    started: list[procs.ServiceProcess] = []
    try:
        _, store_addr, stub_url = start_world(work, "tiny", started)
        gw_proc, gw = procs.start_service(
            "gateway", "services.gateway",
            ["--http-port", "0", "--grpc-bind", "127.0.0.1:0", "--store-address", store_addr,
             "--max-body-bytes", "262144", "--http-read-timeout-s", "2", "--engines",
             json.dumps([{"name": "stub", "base_url": stub_url, "model": "tiny"}])], work,
            env={"HARNESSRL_SECRET": SECRET})
        started.append(gw_proc)
        store = StoreClient.connect(store_addr, timeout=30)
        ids = ["fuzz/a/0", "fuzz/b/0", "fuzz/done/0"]
        store.create_rollouts([c.Rollout(rollout_id=r, run_id="fuzz", task_id=r.split("/")[1],
                                         group_id=r[:-2], group_size=1, max_attempts=3,
                                         stream="-") for r in ids])
        for r in ids:
            store.start_attempt(r, 1)
        store.finish_attempt(spb.FinishAttemptRequest(
            rollout_id=ids[2], attempt=1, status=c.ROLLOUT_STATUS_SUCCEEDED, reward=1.0))
        signer = CredentialSigner(SECRET.encode())
        keys = http_fuzz.Keys(valid=signer.mint(ids[0], 1, 36000),
                              expired=signer.mint(ids[0], 1, -60),
                              finished=signer.mint(ids[2], 1, 36000),
                              other_attempt=signer.mint(ids[0], 2, 36000))
        inputs = http_fuzz.every_wrong_type(keys.valid) if args.every_wrong_type else \
            http_fuzz.wrong_type_inputs(keys.valid) if args.only_wrong_type else None
        report = http_fuzz.run(gw["http_port"], keys, args.examples, args.seed, inputs)
        calls = list(store.get_rollout(ids[0], include_calls=True).calls)
        others = [len(store.get_rollout(r, include_calls=True).calls) for r in ids[1:]]
        alive = gw_proc.alive and httpx.get(
            f"http://127.0.0.1:{gw['http_port']}/health").status_code == 200
        store_ok = (sum(not x.aborted for x in calls) == report.expected_calls
                    and all(x.rollout_id == ids[0] for x in calls) and others == [0, 0])
        print(json.dumps({**report.summary(), "recorded_calls": len(calls),
                          "recorded_not_aborted": sum(not x.aborted for x in calls),
                          "other_rollouts_calls": others, "store_ok": store_ok,
                          "gateway_alive": alive, "failure_examples": {
                              reason: [f for f in report.failures if f.startswith(reason + ":")][:3]
                              for reason in report.failures_by_reason}}))
        store.close()
    finally:
        for p in reversed(started):
            p.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
