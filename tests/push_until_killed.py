"""A trainer killed in the middle of a push (tests/test_weight_transfer.py): pushes a model's
weights as `version` into the engines registered with the gateway, the way the trainer does
(`EngineWeights`, with the gateway hooks), and when the transport reads tensor `at` it writes
the file `signal` and hangs there until the test kills it with SIGKILL.

argv[1]: JSON {admin, model_dir, seed, version, at, signal}."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harnessrl.clients import GatewayAdminClient
from harnessrl.weight_transfer import PushConfig, weights_of
from harnessrl.weight_transfer.devtools import TrippedWeights, load_hf, perturb
from services.trainer.weights import EngineWeights


def main() -> None:
    args = json.loads(sys.argv[1])
    model = load_hf(Path(args["model_dir"]))
    perturb(model, seed=args["seed"])

    def hang() -> None:
        Path(args["signal"]).write_text("mid-push")
        time.sleep(3600)

    weights = EngineWeights(GatewayAdminClient.connect(args["admin"]),
                            PushConfig(bucket_mb=0.01), attempts=1)
    weights.push(TrippedWeights(weights_of(model), args["at"], hang),  # type: ignore[arg-type]
                 version=args["version"])
    raise SystemExit("the push finished: it was meant to be killed first")


if __name__ == "__main__":
    main()
