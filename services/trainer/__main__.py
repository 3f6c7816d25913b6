"""`python -m services.trainer --help`

With `--nproc N` (N > 1) and no torchrun environment, this process only starts and watches N
ranks of itself (`launch.py`); each rank (WORLD_SIZE set, by `--nproc` or by torchrun) runs
`serve`.
"""

import os
import sys

from services.trainer.config import TrainerConfig
from services.trainer.server import serve


def main() -> None:
    cfg = TrainerConfig.for_service("trainer")
    if cfg.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from services.trainer.launch import run_ranks

        sys.exit(run_ranks(cfg.nproc, cfg.rank_grace_s))
    sys.exit(serve(cfg))


if __name__ == "__main__":
    main()
