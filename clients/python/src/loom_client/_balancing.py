"""Client-side balancing over several servers and retries of UNAVAILABLE, through gRPC's own
service config (no balancer of our own): ``round_robin`` spreads calls over every address the
target resolves to (``dns:///loom-headless:50051``, ``ipv4:10.0.0.1:50051,10.0.0.2:50051``) and
drops a server whose connection fails or that sent GOAWAY.

gRPC retries a call only until it is committed: once the server has sent response headers or a
message. Loom answers UNAVAILABLE (draining, shutting down) before either, so such a call is
retried on another server; a stream that fails after its first token is reported to the caller,
never replayed (the caller has already seen part of its output).
"""

from __future__ import annotations

import json
from typing import Any

from ._requests import ChannelOptions

__all__ = ["LOAD_BALANCING_POLICIES", "channel_options"]

LOAD_BALANCING_POLICIES = ("pick_first", "round_robin")
SERVICE = "loom.v1.GenerationService"


def channel_options(
    options: ChannelOptions | None, load_balancing: str | None, max_attempts: int
) -> list[tuple[str, Any]]:
    """``options`` plus a service config for ``load_balancing`` and ``max_attempts``.

    ``max_attempts`` counts the first try: 1 retries nothing; gRPC caps it at 5.
    """
    merged = list(options or ())
    if load_balancing is None and max_attempts == 1:
        return merged
    if load_balancing is not None and load_balancing not in LOAD_BALANCING_POLICIES:
        raise ValueError(f"load_balancing must be one of {', '.join(LOAD_BALANCING_POLICIES)}, got {load_balancing!r}")
    if not 1 <= max_attempts <= 5:
        raise ValueError(f"max_attempts must be in 1..5 (gRPC's limit), got {max_attempts}")
    if any(key == "grpc.service_config" for key, _ in merged):
        raise ValueError("pass load_balancing / max_attempts or a grpc.service_config option, not both")
    config: dict[str, Any] = {}
    if load_balancing is not None:
        config["loadBalancingConfig"] = [{load_balancing: {}}]
    if max_attempts > 1:
        config["methodConfig"] = [{
            "name": [{"service": SERVICE}],
            "retryPolicy": {
                "maxAttempts": max_attempts,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }]
        merged.append(("grpc.enable_retries", 1))
    merged.append(("grpc.service_config", json.dumps(config)))
    return merged
