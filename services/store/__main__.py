"""`python -m services.store --help`"""

import asyncio
import logging

from harnessrl import log as hlog
from services.store.config import StoreConfig
from services.store.server import serve


def main() -> None:
    cfg = StoreConfig.load(prog="python -m services.store")
    hlog.setup("store", cfg.log_level)
    logging.getLogger("harnessrl.store").info("config %s", cfg.describe())
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
