"""Bad quantized checkpoints and conflicting --quantize: one sentence naming the field or tensor,
before the model loads where config.json tells (exit 2), never a stack trace or garbage."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.quant_checkpoints import gptq_checkpoint

from loom.config import ConfigError, EngineConfig
from loom.model_loader import load_model
from loom.model_loader.errors import ModelLoadError
from loom.plugin_api import PluginRegistry
from loom.preflight import check_engine_config

TinyDir = Callable[[str], Path]


@pytest.fixture(scope="module")
def gptq_dir(tiny_model_dir: TinyDir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gptq_checkpoint(tiny_model_dir("llama"), tmp_path_factory.mktemp("gptq") / "m")[0]


def _with_config(src: Path, dst: Path, **changes: Any) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _preflight(path: Path, quantize: str, registry: PluginRegistry) -> str:
    with pytest.raises(ConfigError) as info:
        check_engine_config(EngineConfig(model_id=str(path), device="cpu", quantize=quantize), _with_attention(registry))
    return str(info.value)


def _with_attention(registry: PluginRegistry) -> PluginRegistry:
    import loom_plugins.attention

    if not registry.infos("attention"):
        registry.register(loom_plugins.attention, "loom-attention", "loom-server")
    return registry


@pytest.mark.parametrize(("changes", "message"), [
    ({"quant_method": "hqq"}, "quantization_config.quant_method is 'hqq', which no installed quantizer serves"),
    ({"bits": 3}, "GPTQ quantization_config.bits is 3; supported: 2, 4, 8"),
    ({"group_size": 0}, "GPTQ quantization_config.group_size is 0; expected a positive number"),
    ({"checkpoint_format": "marlin"}, "GPTQ quantization_config.checkpoint_format is 'marlin'"),
    ({"desc_act": "yes"}, "GPTQ quantization_config.desc_act must be true or false, got 'yes'"),
    ({"lm_head": 1}, "GPTQ quantization_config.lm_head must be true or false, got 1"),
])
def test_unsupported_quantization_config_fails_preflight(changes: dict[str, Any], message: str, gptq_dir: Path,
                                                         quant_registry: PluginRegistry, tmp_path: Path) -> None:
    path = _with_config(gptq_dir, tmp_path / "m", **changes)
    assert message in _preflight(path, "auto", quant_registry)


@pytest.fixture(scope="module")
def wna16_dir(tiny_model_dir: TinyDir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.quant_checkpoints import wna16_checkpoint

    return wna16_checkpoint(tiny_model_dir("llama"), tmp_path_factory.mktemp("wna16") / "m", sym=False)[0]


def _with_weights(src: Path, dst: Path, top: dict[str, Any] | None = None, **weights: Any) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(top or {})
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("top", "weights", "message"), [
    ({"format": "int-quantized"}, {}, "compressed-tensors quantization_config.format is 'int-quantized'; supported: "
     "float-quantized (FP8, the fp8 quantizer) and pack-quantized (integer weights, the wna16 quantizer)"),
    ({"config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
                                    "input_activations": {"num_bits": 8, "type": "int"}}}}, {},
     "config_groups.group_0.input_activations is 8-bit 'int': quantized activations (W8A8, W4A8) are not supported"),
    ({}, {"num_bits": 3}, "config_groups.group_0.weights.num_bits is 3; supported: 4, 8"),
    ({}, {"strategy": "tensor"}, "config_groups.group_0.weights.strategy is 'tensor'; supported: group, channel"),
    ({}, {"group_size": 0}, "config_groups.group_0.weights.group_size is 0; expected a positive number"),
    ({}, {"actorder": "sideways"}, "config_groups.group_0.weights.actorder is 'sideways'; supported: null, weight"),
    ({}, {"actorder": ["group"]}, "config_groups.group_0.weights.actorder is ['group']; supported: null, weight"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, {},
     "quantization_config.sparsity_config is set: 2:4 sparse compressed-tensors checkpoints are not supported"),
])
def test_unsupported_compressed_tensors_config_fails_preflight(top: dict[str, Any], weights: dict[str, Any],
                                                               message: str, wna16_dir: Path,
                                                               quant_registry: PluginRegistry, tmp_path: Path) -> None:
    path = _with_weights(wna16_dir, tmp_path / "m", top, **weights)
    assert message in _preflight(path, "auto", quant_registry)


def test_compressed_tensors_checkpoints_go_to_their_quantizer_by_format(wna16_dir: Path, tiny_model_dir: TinyDir,
                                                                        quant_registry: PluginRegistry,
                                                                        tmp_path: Path) -> None:
    """Two quantizers serve quant_method compressed-tensors: pack-quantized integers are wna16's,
    float-quantized FP8 fp8's; --quantize naming the other is a conflict naming the right one."""
    from helpers.quant_checkpoints import fp8_checkpoint

    assert ("--quantize fp8 conflicts with the checkpoint's quantization_config.quant_method 'compressed-tensors', "
            "which the wna16 quantizer serves" in _preflight(wna16_dir, "fp8", quant_registry))
    fp8_dir, _ = fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", per_channel=True, static=False)
    assert "which the fp8 quantizer serves" in _preflight(fp8_dir, "wna16", quant_registry)
    for path, quantize in ((wna16_dir, "wna16"), (wna16_dir, "auto"), (fp8_dir, "fp8")):
        check_engine_config(EngineConfig(model_id=str(path), device="cpu", quantize=quantize),
                            _with_attention(quant_registry))


def test_conflicting_quantize_flags_fail_preflight(gptq_dir: Path, tiny_model_dir: TinyDir,
                                                   quant_registry: PluginRegistry) -> None:
    assert ("--quantize fp8 conflicts with the checkpoint's quantization_config.quant_method 'gptq'"
            in _preflight(gptq_dir, "fp8", quant_registry))
    assert "--quantize none: the checkpoint's linear weights are gptq-quantized" in _preflight(
        gptq_dir, "none", quant_registry)
    message = _preflight(tiny_model_dir("llama"), "awq", quant_registry)
    assert "--quantize awq: the checkpoint is not in its format" in message
    assert "loom quantize --method awq" in message and "--quantize fp8 or nf4" in message
    # a named quantizer that quantizes while loading, and the checkpoint's own: accepted
    for path, quantize in ((tiny_model_dir("llama"), "nf4"), (gptq_dir, "gptq"), (gptq_dir, "auto")):
        check_engine_config(EngineConfig(model_id=str(path), device="cpu", quantize=quantize),
                            _with_attention(quant_registry))


def test_group_size_that_does_not_tile_a_layer_names_it(gptq_dir: Path, quant_registry: PluginRegistry,
                                                         tmp_path: Path) -> None:
    path = _with_config(gptq_dir, tmp_path / "m", group_size=48)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.qkv_proj: its input size 64 is not a "
                                             r"multiple of quantization_config\.group_size 48"):
        load_model(path, torch.float32, "cpu", quant_registry)


def test_a_quantized_head_the_checkpoint_lacks_is_named(gptq_dir: Path, quant_registry: PluginRegistry,
                                                        tmp_path: Path) -> None:
    path = _with_config(gptq_dir, tmp_path / "m", lm_head=True)
    with pytest.raises(ModelLoadError, match=r"GPTQ quantization_config\.lm_head is true but the checkpoint has no "
                                             r"lm_head\.qweight"):
        load_model(path, torch.float32, "cpu", quant_registry)


@pytest.mark.parametrize(("checkpoint", "tensor", "fmt"), [
    ("gptq_dir", "model.layers.1.mlp.up_proj.scales", "GPTQ"),
    ("wna16_dir", "model.layers.0.mlp.down_proj.weight_zero_point", "compressed-tensors"),
])
def test_missing_scale_or_zero_tensor_names_it(checkpoint: str, tensor: str, fmt: str, request: pytest.FixtureRequest,
                                               quant_registry: PluginRegistry, tmp_path: Path) -> None:
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(request.getfixturevalue(checkpoint), tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    del tensors[tensor]
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=re.escape(f"{fmt} checkpoint tensor {tensor} is missing")):
        load_model(tmp_path / "m", torch.float32, "cpu", quant_registry)


def test_misshapen_packed_tensor_names_it(gptq_dir: Path, quant_registry: PluginRegistry, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(gptq_dir, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.scales"
    tensors[name] = tensors[name][:1].contiguous()
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"weight '{name}' has shape \(1, 64\) in the checkpoint but "):
        load_model(tmp_path / "m", torch.float32, "cpu", quant_registry)


def test_serve_refuses_a_bad_checkpoint_with_exit_2(gptq_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from loom.cli import main as loom_main

    path = _with_config(gptq_dir, tmp_path / "m", bits=3)
    assert loom_main(["serve", "--model-id", str(path), "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"loom serve: {path}/config.json: GPTQ quantization_config.bits is 3; supported: 2, 4, 8 "
                   "(widths that fill int32 words)"]
