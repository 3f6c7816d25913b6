"""`python -m services.trainer --help`"""

import sys

from services.trainer.config import TrainerConfig
from services.trainer.server import serve


def main() -> None:
    cfg = TrainerConfig.for_service("trainer")
    sys.exit(serve(cfg))


if __name__ == "__main__":
    main()
