"""One rank of a sharded trainer against the test doubles of tests/test_checkpoint.py (the real
store, `StoreRuns` for the controller, a recording sink for the engines): what
tests/test_checkpoint_sharded.py starts N times through `services.trainer.launch.RankGroup`.

argv[1]: JSON {store, tmp, model, vocab, name, steps, stop_at_step?, delay_step?, delay_s?, out}.
Rank 0 writes <out>: the final full state dict, its pushes and the runs it launched."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from harnessrl.clients import StoreClient
from services.trainer.control import TrainerControl
from services.trainer.loop import Trainer, train_sync
from services.trainer.sharding import close_distributed, init_distributed

from test_checkpoint import StoreRuns, make_config


class GatheredSink:
    """Test double of the engines for a sharded trainer: records (version, digest of the full
    weights it was handed, gathered bucket by bucket)."""

    def __init__(self) -> None:
        self.version = 0
        self.pushes: list[tuple[int, str]] = []

    def push(self, weights, version: int) -> None:  # type: ignore[no-untyped-def]
        import hashlib

        h = hashlib.sha256()
        for name, t in weights:
            h.update(name.encode())
            h.update(t.detach().contiguous().numpy().tobytes())
        self.pushes.append((version, h.hexdigest()))
        self.version = version

    def close(self) -> None:
        pass


def main() -> None:
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    d = init_distributed("cpu", timeout_s=120)
    cfg = make_config(Path(args["tmp"]), args["name"], Path(args["model"]), args["steps"])
    control = TrainerControl()
    store = runs = sink = None
    if d.is_main:
        store = StoreClient.connect(args["store"], timeout=10)
        sink = GatheredSink()
        runs = StoreRuns(store, sink, args["vocab"])
        launch = runs.run

        def run(run_id, spec):  # type: ignore[no-untyped-def]
            if args.get("stop_at_step") and run_id.endswith(f"step{args['stop_at_step']:06d}"):
                control.request_stop()
            if run_id.endswith(f"step{args.get('delay_step', 0):06d}"):
                time.sleep(args.get("delay_s", 0.0))  # a window to kill a rank mid-step
            return launch(run_id, spec)

        runs.run = run  # type: ignore[method-assign]
    t = Trainer(cfg, runs, store, sink, control, dist=d)
    try:
        train_sync(t)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict)

        full = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))
        if d.is_main:
            torch.save({"state": full, "pushes": sink.pushes, "launched": runs.launched,
                        "step": t.state.step}, args["out"])
    finally:
        close_distributed()


if __name__ == "__main__":
    main()
