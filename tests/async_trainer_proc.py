"""A trainer in async mode in a process of its own, for tests/test_modes.py's kill -9 test: the
real loop (`train_async`) against the real store, with test_modes.PoolRuns as the controller
and test_checkpoint.RecordingSink as the engines.

    python tests/async_trainer_proc.py STORE_ADDRESS CONFIG_JSON SEED [STALL_FROM_VERSION]

STALL_FROM_VERSION: the controller double's groups admitted once the engines serve that version
never finish in this process (`PoolRuns`'s stall_from_version).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harnessrl.clients import StoreClient  # noqa: E402
from services.trainer.config import TrainerConfig  # noqa: E402
from services.trainer.loop import train_async  # noqa: E402
from test_checkpoint import RecordingSink  # noqa: E402
from test_modes import async_trainer  # noqa: E402

if __name__ == "__main__":
    store = StoreClient.connect(sys.argv[1], timeout=30)
    cfg = TrainerConfig(**json.loads(Path(sys.argv[2]).read_text()))
    vocab = int(json.loads((Path(cfg.model_path) / "config.json").read_text())["vocab_size"])
    stall = int(sys.argv[4]) if len(sys.argv) > 4 else None
    trainer, _ = async_trainer(cfg, store, RecordingSink(), vocab, seed=int(sys.argv[3]),
                               stall_from_version=stall)
    train_async(trainer)
