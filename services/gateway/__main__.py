"""`python -m services.gateway --help`"""

import asyncio
import gc

import uvloop

from services.gateway.config import GatewayConfig
from services.gateway.server import serve


def main() -> None:
    cfg = GatewayConfig.for_service("gateway")
    uvloop.install()
    # What start-up made lives as long as the process: no collection walks it again. A young
    # collection once 2,000 more objects are live than after the last (the default is 700,
    # which the objects of the calls in flight pass every few calls: 5-6% of the gateway's CPU
    # at 32 connections, measured with perf; with 2,000, too little to be seen).
    gc.freeze()
    gc.set_threshold(2000, *gc.get_threshold()[1:])
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
