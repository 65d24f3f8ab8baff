"""Server settings: the front end's limits and the engine configuration, validated once.

Defaults follow TGI's launcher where the concept is the same (--max-concurrent-requests 128,
--max-stop-sequences 4, --max-top-n-tokens 5, --max-best-of 2, --graceful-termination-timeout 90).

``default_max_new_tokens``: a request that leaves ``max_new_tokens`` unset generates at most this
many tokens, and never more than its budget leaves (max_total_tokens minus its prompt). TGI uses
the whole budget, which makes an unbounded request hold KV blocks for thousands of tokens; a cap
keeps the default cheap while an explicit value can still use the full budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.config import ConfigError, EngineConfig

from .tls import TlsFiles

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class ServerSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "0.0.0.0"
    port: int = 50051
    max_concurrent_requests: int = 128  # requests in the engine at once; more wait in the queue
    max_queue: int = 1024  # requests waiting for a slot; more fail with RESOURCE_EXHAUSTED; 0: no queue
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_best_of: int = 2
    default_max_new_tokens: int = 256
    graceful_termination_timeout: float = 90.0  # seconds in-flight requests get on SIGTERM
    json_output: bool = False
    log_level: str = "INFO"
    warmup: bool = True  # run one short generation before reporting SERVING
    # Security and size limits (see auth.py, tls.py). repr=False: the key never reaches a log.
    api_key: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    max_request_bytes: int = 4 << 20  # gRPC's max receive message size; larger get RESOURCE_EXHAUSTED
    max_input_chars: int = 262_144  # characters of text/chat input (bounds tokenizing work)
    # Observability (see metrics.py, tracing.py and docs/observability.md), TGI's flags.
    prometheus_port: int = 9000  # /metrics over plain HTTP on `host`; 0: no endpoint
    otlp_endpoint: str | None = None  # OTLP/gRPC collector for traces; unset: no tracing
    otlp_service_name: str = "loom"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if not 0 <= self.prometheus_port <= 65535:
            raise ConfigError(f"--prometheus-port must be in [0, 65535] (0: off), got {self.prometheus_port}")
        for flag, value in (
            ("--max-concurrent-requests", self.max_concurrent_requests),
            ("--max-best-of", self.max_best_of),
            ("--default-max-new-tokens", self.default_max_new_tokens),
        ):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        for flag, value in (("--max-stop-sequences", self.max_stop_sequences),
                            ("--max-top-n-tokens", self.max_top_n_tokens)):
            if value < 0:
                raise ConfigError(f"{flag} must be at least 0, got {value}")
        for flag, value in (("--max-request-bytes", self.max_request_bytes),
                            ("--max-input-chars", self.max_input_chars)):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        if self.max_queue < 0:
            raise ConfigError(f"--max-queue must be at least 0, got {self.max_queue}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
        TlsFiles(self.tls_cert, self.tls_key, self.tls_client_ca).validate()
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {self.log_level!r}")
        if self.graceful_termination_timeout < 0:
            raise ConfigError("--graceful-termination-timeout must be at least 0")

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_client_ca)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"
