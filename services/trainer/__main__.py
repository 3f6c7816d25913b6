"""`python -m services.trainer --help`"""

import logging
import sys

from harnessrl import log as hlog
from services.trainer.config import TrainerConfig
from services.trainer.server import serve


def main() -> None:
    cfg = TrainerConfig.load(prog="python -m services.trainer")
    hlog.setup("trainer", cfg.log_level)
    logging.getLogger("harnessrl.trainer").info("config %s", cfg.describe())
    sys.exit(serve(cfg))


if __name__ == "__main__":
    main()
