"""The client's load_balancing / max_attempts become a gRPC service config; bad values are refused
before a channel exists. (Two real servers: tests/e2e/test_load_balancing.py.)"""

from __future__ import annotations

import json

import pytest

from loom_client import LoomClient
from loom_client._balancing import channel_options
from loom_client.cli import build_parser


def service_config(options: list[tuple[str, object]]) -> dict[str, object]:
    (raw,) = [value for key, value in options if key == "grpc.service_config"]
    assert isinstance(raw, str)
    config: dict[str, object] = json.loads(raw)
    return config


def test_defaults_add_nothing() -> None:
    assert channel_options(None, None, 1) == []
    assert channel_options([("grpc.max_receive_message_length", 1)], None, 1) == [("grpc.max_receive_message_length", 1)]


def test_round_robin_and_retries_of_unavailable_only() -> None:
    options = channel_options([("grpc.keepalive_time_ms", 1000)], "round_robin", 3)
    assert ("grpc.keepalive_time_ms", 1000) in options and ("grpc.enable_retries", 1) in options
    config = service_config(options)
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]  # type: ignore[misc]
    assert method["name"] == [{"service": "loom.v1.GenerationService"}]
    assert method["retryPolicy"]["maxAttempts"] == 3
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert "methodConfig" not in service_config(channel_options(None, "round_robin", 1))


@pytest.mark.parametrize(("policy", "attempts", "message"), [
    ("least_request", 1, "load_balancing must be one of pick_first, round_robin, got 'least_request'"),
    (None, 0, "max_attempts must be in 1..5"),
    ("round_robin", 6, "max_attempts must be in 1..5 (gRPC's limit), got 6"),
])
def test_bad_values_are_refused_with_the_argument(policy: str | None, attempts: int, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LoomClient("localhost:1", load_balancing=policy, max_attempts=attempts)


def test_a_service_config_option_and_the_arguments_do_not_mix() -> None:
    with pytest.raises(ValueError, match="not both"):
        channel_options([("grpc.service_config", "{}")], "round_robin", 1)


def test_cli_flags() -> None:
    args = build_parser().parse_args(["--target", "ipv4:127.0.0.1:1,127.0.0.1:2", "--load-balancing", "round_robin",
                                      "--max-attempts", "3", "info"])
    assert (args.load_balancing, args.max_attempts) == ("round_robin", 3)
