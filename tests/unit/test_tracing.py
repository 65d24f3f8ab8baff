"""--otlp-endpoint start-up: off when unset, and a missing package is named in a clear error."""

from __future__ import annotations

import sys

import pytest

from loom.config import ConfigError
from loom.server.tracing import mono_to_ns, setup_tracing

EXPORTER = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"


def test_off_without_an_endpoint() -> None:
    assert setup_tracing(None, "loom") is None
    assert setup_tracing("", "loom") is None


def test_missing_exporter_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry.sdk.trace")
    monkeypatch.setitem(sys.modules, EXPORTER, None)  # importing it now raises ImportError
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-grpc"):
        setup_tracing("http://127.0.0.1:4317", "loom")


def test_missing_sdk_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ConfigError, match=r"opentelemetry-sdk .*loom-server\[otel\]"):
        setup_tracing("http://127.0.0.1:4317", "loom")


def test_monotonic_readings_become_epoch_nanoseconds() -> None:
    import time

    now_ns = time.time_ns()
    assert abs(mono_to_ns(time.monotonic()) - now_ns) < 50_000_000
    assert mono_to_ns(time.monotonic() - 2.0) < now_ns - 1_900_000_000
