"""Configuration of the rollout gate."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from harnessrl.config import ServiceConfig


class GateConfig(ServiceConfig):
    """harnessrl gate: the Docker API for rollout containers alone (docs/sandbox.md)."""

    model_config = SettingsConfigDict(env_prefix="HARNESSRL_GATE_", extra="forbid")

    listen: str = Field(
        "/run/harnessrl-gate/docker.sock", description="Unix socket the gate answers on "
        "(mode 0666 in a folder only the controller shares: whoever reaches it may start "
        "rollout containers, nothing else)")
    allowed_uids: list[int] = Field(
        default_factory=list, description="the user ids whose processes may call (checked "
        "with SO_PEERCRED on each connection; JSON list); empty: whoever reaches the socket")
    docker_socket: str = Field("/var/run/docker.sock", description="the Docker daemon's socket")
    images: list[str] = Field(
        default_factory=list, description="the images rollout containers may run (JSON list); "
        "empty refuses every container")
    network: str = Field(
        "none", description="the one network rollout containers may join (besides 'none')")
    max_memory_mb: int = Field(8192, ge=16, description="the most memory a container may ask")
    max_pids: int = Field(4096, ge=8, description="the most processes a container may ask")
    max_cpus: float = Field(4.0, gt=0, description="the most CPUs a container may ask")
    ready_file: str = Field("", description="write {pid} here once serving")
    log_level: str = Field("INFO", description="logging level")
