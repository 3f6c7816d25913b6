"""`python -m services.store --help`"""

import asyncio

import uvloop

from services.store.config import StoreConfig
from services.store.server import serve


def main() -> None:
    cfg = StoreConfig.for_service("store")
    uvloop.install()
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
