"""`python -m services.gateway --help`"""

import asyncio

import uvloop

from services.gateway.config import GatewayConfig
from services.gateway.server import serve


def main() -> None:
    cfg = GatewayConfig.for_service("gateway")
    uvloop.install()
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
