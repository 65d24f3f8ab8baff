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


# Everything that can be checked before the model loads is: one line on stderr naming the flag,
# exit 2, and no server started (no "listening" / "loading model" line, no engine process).
@pytest.mark.parametrize(("argv", "expected"), [
    (["--quantize", "nosuch"], "--quantize: unknown quantizer plugin 'nosuch'. Choose one of: "),
    (["--attention-backend", "nosuch"], "--attention-backend: unknown attention plugin 'nosuch'. Choose one of: "),
    (["--device", "cuda"], "--device cuda: CUDA is not available"),
    (["--device", "gpu0"], "--device must be auto, cpu, cuda or cuda:N; got 'gpu0'"),
    (["--log-level", "LOUD"], "--log-level must be one of DEBUG, INFO, WARNING, ERROR; got 'LOUD'"),
    (["--max-total-tokens", "0"], "--max-total-tokens must be at least 1"),
    (["--max-input-tokens", "0"], "--max-input-tokens must be at least 1"),
    (["--max-batch-total-tokens", "-5"], "--max-batch-total-tokens must be at least 1"),
    (["--max-input-tokens", "100", "--max-total-tokens", "50"],
     "--max-input-tokens (100) must be below --max-total-tokens (50)"),
    (["--model-id", "/nonexistent/model"], "--model-id '/nonexistent/model' does not exist"),
    (["--model-id", "random:nosuch"], "unknown random-weight shape 'nosuch'"),
    (["--lora-adapters", "a=/nonexistent/adapter"], "--lora-adapters a=/nonexistent/adapter: not a directory"),
    (["--lora-adapters", "a=/tmp,a=/tmp"], "--lora-adapters: a given more than once"),
    (["--lora-adapters", "a=/tmp,b=/tmp", "--max-loras", "1"], "--lora-adapters gives 2 adapters, more than --max-loras 1"),
    (["--max-lora-rank", "0"], "--max-lora-rank must be between 1 and 512, got 0"),
])
def test_configuration_errors_are_one_line_before_loading(
        argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if argv[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["serve", "--port", "0", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("loom serve: ") and expected in lines[0], lines[0]
    assert captured.out == ""


def test_an_architecture_no_plugin_serves_is_one_line_naming_the_installed_ones(
        tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    from pathlib import Path

    model = Path(str(tmp_path)) / "foo"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    assert main(["serve", "--port", "0", "--model-id", str(model)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured.err
    assert lines[0].startswith(f"loom serve: --model-id {model}: unsupported model architecture FooForCausalLM. "
                               "Known architectures: Gemma2ForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM"), lines[0]
    assert "MixtralForCausalLM" in lines[0] and "Phi3ForCausalLM" in lines[0] and "Qwen3MoeForCausalLM" in lines[0]


def test_an_unavailable_attention_backend_names_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    # The Triton backend runs on CUDA only: choosing it for the CPU is refused before loading.
    assert main(["serve", "--attention-backend", "paged", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("loom serve: --attention-backend paged "), err


def test_lora_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    s = settings(["--lora-adapters", "sql=/m/sql, chat=/m/chat", "--max-lora-rank", "32"])
    assert s.engine.lora_adapters == (("sql", "/m/sql"), ("chat", "/m/chat")) and s.engine.max_lora_rank == 32
    assert s.engine.num_lora_slots == 4 and settings([]).engine.num_lora_slots == 0
    assert settings(["--max-loras", "2"]).engine.num_lora_slots == 2
    monkeypatch.setenv("LOOM_LORA_ADAPTERS", "x=/m/x")
    assert settings([]).engine.lora_adapters == (("x", "/m/x"),)
    monkeypatch.setenv("LOOM_LORA_ADAPTERS", "no-equals-sign")
    with pytest.raises(SystemExit):
        build_parser()
    err = capsys.readouterr().err
    assert "LOOM_LORA_ADAPTERS" in err and "NAME=DIR" in err
