"""`python -m services.controller --help`"""

import asyncio
import logging

from harnessrl import log as hlog
from services.controller.config import ControllerConfig
from services.controller.server import serve


def main() -> None:
    cfg = ControllerConfig.load(prog="python -m services.controller")
    hlog.setup("controller", cfg.log_level)
    logging.getLogger("harnessrl.controller").info("config %s", cfg.describe())
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
