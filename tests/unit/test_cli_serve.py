"""``loom serve`` flags: defaults, LOOM_* environment variables, and flag-over-env precedence."""

from __future__ import annotations

import pytest

from loom.cli import build_parser, env_name, main
from loom.config import EngineConfig
from loom.server.serve_command import settings_from_args
from loom.server.settings import ServerSettings


def settings(argv: list[str]) -> ServerSettings:
    args = build_parser().parse_args(["serve", *argv])
    result = settings_from_args(args)
    assert isinstance(result, ServerSettings)
    return result


def test_env_name() -> None:
    assert env_name("--max-input-tokens") == "LOOM_MAX_INPUT_TOKENS"


def test_defaults_follow_the_dataclasses(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LOOM_PORT", "LOOM_MAX_BEST_OF", "LOOM_JSON_OUTPUT"):
        monkeypatch.delenv(var, raising=False)
    s = settings([])
    assert s.port == 50051 and s.max_concurrent_requests == 128 and s.max_stop_sequences == 4
    assert s.max_top_n_tokens == 5 and s.max_best_of == 2 and s.graceful_termination_timeout == 90
    assert s.engine == EngineConfig() and not s.json_output


def test_env_sets_and_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_PORT", "6000")
    monkeypatch.setenv("LOOM_MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("LOOM_JSON_OUTPUT", "true")
    monkeypatch.setenv("LOOM_WAITING_SERVED_RATIO", "0.5")
    s = settings(["--port", "7000"])
    assert s.port == 7000 and s.engine.max_batch_size == 8 and s.json_output
    assert s.engine.waiting_served_ratio == 0.5
    assert not settings(["--no-json-output"]).json_output


def test_bad_env_value_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LOOM_MAX_BEST_OF", "many")
    with pytest.raises(SystemExit):
        build_parser()
    assert "LOOM_MAX_BEST_OF" in capsys.readouterr().err


def test_invalid_config_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--block-size", "3"]) == 2
    assert "--block-size" in capsys.readouterr().err
