"""Configuration of the controller service."""

from __future__ import annotations

from typing import ClassVar

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict

from harnessrl.config import ServiceConfig


class ControllerConfig(ServiceConfig):
    """harnessrl controller: runs harnesses for datasets of tasks, grades them, reports rewards."""

    model_config = SettingsConfigDict(env_prefix="HARNESSRL_CONTROLLER_", extra="forbid",
                                      populate_by_name=True)
    secret_fields: ClassVar[tuple[str, ...]] = ("secret",)

    bind: str = Field("127.0.0.1:50053", description="host:port of the gRPC server (port 0: any)")
    store_address: str = Field("127.0.0.1:50051", description="host:port of the store service")
    gateway_url: str = Field(
        "http://127.0.0.1:8080/v1",
        description="the gateway's OpenAI-compatible base URL (ends in /v1), given to every "
                    "harness as OPENAI_BASE_URL")
    secret: str | None = Field(
        None, validation_alias=AliasChoices("secret", "HARNESSRL_CONTROLLER_SECRET",
                                            "HARNESSRL_SECRET"),
        description="credential signing secret shared with the gateway (env HARNESSRL_SECRET); "
                    "when unset it is read from secret_file")
    secret_file: str = Field(
        ".harnessrl/secret",
        description="file holding the shared secret (created, mode 0600, when missing); the "
                    "gateway reads the same file by default")
    workdir_root: str = Field(
        ".harnessrl/rollouts",
        description="each attempt runs in <workdir_root>/<run>/<rollout>/attempt-<k>, which "
                    "keeps its stdout/stderr and the grader's")
    credential_ttl_margin_s: float = Field(
        120.0, description="a rollout credential expires this long after the attempt's "
                           "harness timeout")
    store_retry_s: float = Field(
        120.0, description="how long a run keeps retrying a store that is unavailable (say, "
                           "restarting) before the run fails")
    store_request_retry_s: float = Field(
        10.0, description="the same bound for the store calls CreateRun makes while its "
                          "caller waits")
    store_call_timeout_s: float = Field(15.0, description="deadline of one store RPC")
    kill_grace_s: float = Field(
        2.0, description="a job past its timeout (or cancelled) gets SIGTERM, then SIGKILL "
                         "after this many seconds")
    max_jobs: int = Field(
        64, description="harness runs at once over all runs of this controller (each run "
                        "also has its own `concurrency`)", ge=1)
    ready_file: str = Field("", description="write {pid, grpc_port} here once serving")
    log_level: str = Field("INFO", description="logging level")
