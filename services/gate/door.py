"""The gateway's door onto the rollout network (Compose): one TCP port carried to the gateway's
OpenAI-compatible HTTP port and nothing else, so a rollout container reaches that port alone,
not the gateway's admin gRPC or metrics ports, nor any other service.

`python -m services.gate.door --listen 0.0.0.0:8080 --target gateway:8080`
"""

from __future__ import annotations

import asyncio
import logging
import signal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from harnessrl import log as hlog
from harnessrl.config import ServiceConfig
from harnessrl.streams import splice

log = logging.getLogger("harnessrl.door")


class DoorConfig(ServiceConfig):
    """harnessrl door: one TCP port carried to one target."""

    model_config = SettingsConfigDict(env_prefix="HARNESSRL_DOOR_", extra="forbid")

    listen: str = Field("0.0.0.0:8080", description="host:port the rollouts connect to")
    target: str = Field("gateway:8080", description="host:port each connection is carried to")
    log_level: str = Field("INFO", description="logging level")


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


async def serve(cfg: DoorConfig) -> None:
    host, port = _split(cfg.target)

    async def carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await splice(reader, writer, host, port)
        except OSError as exc:
            log.warning("target %s unreachable: %s", cfg.target, exc)

    server = await asyncio.start_server(carry, *_split(cfg.listen))
    log.info("door %s -> %s", cfg.listen, cfg.target)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    cfg = DoorConfig.load(prog="python -m services.gate.door")
    hlog.setup("door", cfg.log_level)
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
