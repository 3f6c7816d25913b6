"""`python -m services.controller --help`"""

import asyncio

from services.controller.config import ControllerConfig
from services.controller.server import serve


def main() -> None:
    cfg = ControllerConfig.for_service("controller")
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
