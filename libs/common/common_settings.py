"""Settings every service shares: the `FLOTILLA_` prefix, the model cache, the bus and tracing.

Part of the settings (libs/common/settings.py re-exports these classes; import them from there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "FLOTILLA_"


class ModelCacheSettings(BaseSettings):
    """Where models are kept; read by libs/common/model_cache.py (every service and the library
    resolve model names through it)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    cache_dir: Path | None = Field(
        None, description="Model cache (the default model, hub downloads); unset = "
        "$XDG_CACHE_HOME/flotilla, else ~/.cache/flotilla")


class CommonSettings(BaseSettings):
    """Settings every service shares: the bus, shared state, tracing and stream liveness."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    nats_url: str = Field("nats://127.0.0.1:4222",
                          description="NATS server URL(s), comma-separated")
    nats_write_now: bool = Field(
        True, description="Requests and replies go to the NATS socket when published; off = "
        "nats-py's flusher task writes them, after every other ready task (a burst's requests "
        "then leave each hop together, late)")
    gc_freeze: bool = Field(
        True, description="After start-up, move every object Python holds into the garbage "
        "collector's permanent generation (gc.freeze), so full collections, which pause every "
        "thread of the process, do not walk the libraries, the model and the caches each time")
    redis_url: str | None = Field(None, description="Redis URL; unset = in-process store")
    log_level: str = Field("INFO", description="Python logging level")
    otel_exporter: Literal["none", "console", "otlp"] = Field(
        "none", description="Where spans go: nowhere, stderr, or an OTLP collector"
    )
    otel_endpoint: str | None = Field(None, description="OTLP gRPC endpoint, e.g. http://otel:4317")
    heartbeat_interval_s: float = Field(0.5, gt=0, description="Idle stream heartbeat period")
    heartbeat_timeout_s: float = Field(
        3.0, gt=0, description="A stream with no frame for this long is declared dead"
    )
    request_timeout_s: float = Field(
        10.0, gt=0, description="Reply timeout for request/reply calls (not for streams)"
    )
    discovery_interval_s: float = Field(1.0, gt=0, description="Period of service announcements")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Port of the Prometheus /metrics endpoint of the "
        "tokenizer, engine and tools services (the gateway serves /metrics on its API port and "
        "ignores this); 0 = off (`flotilla up` and docker-compose.yml turn it on)")
    metrics_host: str = Field(
        "127.0.0.1", description="Address the metrics port binds (0.0.0.0 in containers)")
    drain_timeout_s: float = Field(
        20.0, ge=0, description="On SIGTERM a service stops taking new work and waits this long "
        "for the work in flight (open streams) to finish before it exits; SIGINT, or a second "
        "signal, stops at once. Container stop grace periods must exceed it")
    # ---- a closed bus (docs/security.md): every NATS connection of every service uses these
    nats_user: str | None = Field(None, description="NATS user name (with nats_password)")
    nats_password: SecretStr | None = Field(None, description="NATS password of nats_user")
    nats_token: SecretStr | None = Field(None, description="NATS authentication token (instead "
                                         "of a user and password)")
    nats_nkey_seed: Path | None = Field(None, description="File holding this service's NATS "
                                        "nkey seed (SU...), instead of a password or token")
    nats_tls_ca: Path | None = Field(None, description="CA certificate (PEM) that signed the "
                                     "NATS server's certificate; set = connect with TLS")
    nats_tls_cert: Path | None = Field(None, description="Client certificate (PEM) for NATS "
                                       "servers that verify clients (with nats_tls_key)")
    nats_tls_key: Path | None = Field(None, description="Private key of nats_tls_cert")

    @field_validator("heartbeat_timeout_s")
    @classmethod
    def _timeout_exceeds_interval(cls, v: float, info):  # type: ignore[no-untyped-def]
        interval = info.data.get("heartbeat_interval_s", 0.5)
        if v <= interval:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        return v
