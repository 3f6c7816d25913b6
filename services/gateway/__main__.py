"""`python -m services.gateway --help`"""

import asyncio
import logging

import uvloop

from harnessrl import log as hlog
from services.gateway.config import GatewayConfig
from services.gateway.server import serve


def main() -> None:
    cfg = GatewayConfig.load(prog="python -m services.gateway")
    hlog.setup("gateway", cfg.log_level)
    logging.getLogger("harnessrl.gateway").info("config %s", cfg.describe())
    uvloop.install()
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
