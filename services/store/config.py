"""Configuration of the store service."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from harnessrl.config import ServiceConfig
from harnessrl.metrics import METRICS_BIND_HELP


class StoreConfig(ServiceConfig):
    """harnessrl store: gRPC in front of Redis."""

    model_config = SettingsConfigDict(env_prefix="HARNESSRL_STORE_", extra="forbid")

    bind: str = Field("127.0.0.1:50051", description="host:port of the gRPC server (port 0: any)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis to keep everything in "
                           "(with a password in it, set HARNESSRL_STORE_REDIS_URL rather than "
                           "the flag, which ps shows; logs mask it)")
    key_prefix: str = Field("hrl:", description="prefix of every Redis key (one deployment each)")
    start_redis: bool = Field(
        False, description="start a private redis-server with AOF when none answers at redis_url"
    )
    redis_data_dir: str = Field(".harnessrl/redis", description="data dir of a started Redis")
    health_interval_s: float = Field(
        1.0, gt=0, description="Redis is pinged this often; health answers NOT_SERVING while "
        "a ping fails or takes longer than this (readiness probes use it)")
    max_state_value_bytes: int = Field(
        1024 * 1024, ge=1, description="largest value PutState accepts (INVALID_ARGUMENT above)")
    max_state_keys: int = Field(
        10_000, ge=1, description="keys per PutState namespace (RESOURCE_EXHAUSTED above)")
    ready_file: str = Field("", description="write {pid, grpc_port, metrics_port} here once "
                                           "serving")
    metrics_bind: str = Field("", description=METRICS_BIND_HELP)
    metrics_refresh_s: float = Field(5.0, gt=0, description="refresh the stream metrics (entries, "
                                     "lag, pending) from Redis this often")
    log_level: str = Field("INFO", description="logging level")
