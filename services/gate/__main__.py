"""`python -m services.gate --help`"""

import asyncio

from services.gate.config import GateConfig
from services.gate.server import serve, setup_logging


def main() -> None:
    cfg = GateConfig.load(prog="python -m services.gate")
    setup_logging(cfg)
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
