"""Configuration of the store service."""

from __future__ import annotations

from pathlib import Path
from typing import Self
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

from pydantic import Field, model_validator
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
    redis_password_file: str = Field(
        "", description="file holding Redis's password (of the user redis_url names, or the "
        "default user); read at start into redis_url, so no environment or flag holds it "
        "(docker-compose.yml: harnessrl/deploy_secrets.py makes it)")
    redis_tls_ca_file: str = Field(
        "", description="CA certificate(s) (PEM) that signed the certificate of a Redis reached "
        "with a rediss:// URL (TLS); empty: the system's trust store. The certificate must name "
        "the URL's host: the store verifies it, and refuses plaintext and unverified servers")
    redis_tls_cert_file: str = Field(
        "", description="client certificate (PEM) the store shows a rediss:// Redis that asks "
        "for one (tls-auth-clients); the store's own (HARNESSRL_TLS_DIR/tls.crt) serves where "
        "that Redis trusts the deployment's CA")
    redis_tls_key_file: str = Field("", description="key (PEM) of redis_tls_cert_file")
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
    max_image_bytes: int = Field(
        20 * 1024 * 1024, ge=1, description="largest image PutImages accepts "
        "(INVALID_ARGUMENT above; the gateway's own max_image_bytes should not be larger)")
    max_image_store_bytes: int = Field(
        2 * 1024 ** 3, ge=1, description="bytes of images the image store holds at most "
        "(PutImages answers RESOURCE_EXHAUSTED past it); images are kept in Redis, in memory: "
        "size Redis for them")
    image_retention_s: float = Field(
        0.0, ge=0, description="delete an image no PutImages has sent or named for this long "
        "(each PutImages deletes up to 256 such, before it checks the bounds); 0 keeps every "
        "image. A call recorded longer ago may then name an image GetImages does not find")
    ready_file: str = Field("", description="write {pid, grpc_port, metrics_port} here once "
                                           "serving")
    metrics_bind: str = Field("", description=METRICS_BIND_HELP)
    metrics_refresh_s: float = Field(5.0, gt=0, description="refresh the stream metrics (entries, "
                                     "lag, pending) from Redis this often")
    log_level: str = Field("INFO", description="logging level")

    @model_validator(mode="after")
    def _password_from_file(self) -> Self:
        if not self.redis_password_file:
            return self
        password = Path(self.redis_password_file).read_text().strip()
        if not password:
            raise ValueError(f"redis_password_file {self.redis_password_file} is empty")
        url = urlsplit(self.redis_url)
        if url.password is not None:
            raise ValueError("redis_url holds a password and redis_password_file is set: "
                             "give it in one place")
        user, _, host = url.netloc.rpartition("@")
        netloc = f"{user}:{quote(password, safe='')}@{host}"
        self.redis_url = urlunsplit(url._replace(netloc=netloc))
        return self

    def redis_tls_kwargs(self) -> dict[str, str]:
        """redis-py's connection options for the redis_tls_* fields that are set."""
        opts = {"ssl_ca_certs": self.redis_tls_ca_file, "ssl_certfile": self.redis_tls_cert_file,
                "ssl_keyfile": self.redis_tls_key_file}
        return {k: v for k, v in opts.items() if v}

    @model_validator(mode="after")
    def _tls_only_with_rediss(self) -> Self:
        """TLS settings with a plaintext URL would be ignored (everything sent in clear, the
        password included): refused, as is a TLS option given twice (the URL's query wins in
        redis-py) and a private Redis started for a rediss:// URL (it speaks no TLS)."""
        url = urlsplit(self.redis_url)
        tls = self.redis_tls_kwargs()
        query_ssl = {k for k in parse_qs(url.query) if k.startswith("ssl_")}
        if (tls or query_ssl) and url.scheme != "rediss":
            raise ValueError("TLS options (redis_tls_* or ssl_* in the URL) need a rediss:// "
                             f"redis_url, not {url.scheme}://")
        if both := query_ssl & set(tls):
            raise ValueError(f"{', '.join(sorted(both))} given in redis_url and as redis_tls_*: "
                             "give it in one place")
        if self.redis_tls_key_file and not self.redis_tls_cert_file:
            raise ValueError("redis_tls_key_file without redis_tls_cert_file")
        for path in tls.values():
            if not Path(path).is_file():
                raise ValueError(f"{path}: no such file (redis_tls_*)")
        if self.start_redis and url.scheme == "rediss":
            raise ValueError("start_redis starts a plaintext Redis on loopback: not for rediss://")
        return self
