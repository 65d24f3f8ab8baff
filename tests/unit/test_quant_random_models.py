"""``--quantize gptq|awq|fp8|nf4`` on a random-weight model (``random:NAME``, what the W6 benchmark
loads): each drawn weight is quantized while it loads into the method's packed format, exactly the
round-to-nearest of the dense draw; a dense checkpoint still refuses gptq / awq."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.reference_attention import ModelHarness

from loom.config import ConfigError, EngineConfig
from loom.model_loader import load_model, resolve_model_dir
from loom.model_loader.random_model import random_weights_of
from loom.plugin_api import PluginRegistry
from loom.preflight import check_engine_config
from loom_plugins.quant.make.group_quant import rtn

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128]


def _dense_draws(model: Any, config: Any) -> dict[str, torch.Tensor]:
    """The dense weights ``feed_random_dense_weights`` drew for each layer quantized while loading
    (the same generator, seed and order), to check the quantized layers against."""
    weights = random_weights_of(config)
    assert weights is not None
    generator = torch.Generator().manual_seed(weights.seed + 1)
    draws = {}
    for name, module in model.named_modules():
        if getattr(getattr(module, "quant_method", None), "quantizes_while_loading", False):
            rows, cols = sum(module.output_partition_sizes), module.input_size_per_partition
            draws[name] = torch.empty(rows, cols).normal_(0.0, weights.std, generator=generator)
    return draws


@pytest.mark.parametrize(("quantize", "sym"), [("gptq", True), ("awq", False)])
def test_int4_quantizes_random_weights_while_loading(quantize: str, sym: bool, quant_registry: PluginRegistry) -> None:
    loaded = load_model(resolve_model_dir("random:tiny-llama"), torch.float32, "cpu", quant_registry, quantize)
    assert loaded.quantization == quantize
    settings = loaded.quantization_settings
    assert settings["format"] == "rtn while loading" and settings["bits"] == "4"
    assert settings["group_size"] == "64"  # tiny-llama's hidden size 64: groups of 128 do not fit
    draws = _dense_draws(loaded.model, loaded.hf_config)
    assert len(draws) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers; the head stays dense
    for name, module in loaded.model.named_modules():
        if name in draws:
            assert "weight" not in module._parameters  # the dense placeholder is gone
            expected = rtn(draws[name], 4, 64, sym=sym, min_zero=1 if sym else 0).dequantize()
            assert torch.equal(module.quant_method.dequantize(module, torch.float32), expected), name
    logits = ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)
    assert bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("quantize", ["gptq", "awq", "fp8", "nf4"])
def test_random_model_takes_every_quantizer_in_preflight(quantize: str, quant_registry: PluginRegistry) -> None:
    import loom_plugins.attention

    if not quant_registry.infos("attention"):
        quant_registry.register(loom_plugins.attention, "loom-attention", "loom-server")
    check_engine_config(EngineConfig(model_id="random:tiny-llama", device="cpu", quantize=quantize), quant_registry)


def test_dense_checkpoint_still_refuses_int4_while_loading(tiny_model_dir: Any, quant_registry: PluginRegistry) -> None:
    import loom_plugins.attention

    if not quant_registry.infos("attention"):
        quant_registry.register(loom_plugins.attention, "loom-attention", "loom-server")
    with pytest.raises(ConfigError, match="--quantize gptq: the checkpoint is not in its format"):
        check_engine_config(EngineConfig(model_id=str(tiny_model_dir("llama")), device="cpu", quantize="gptq"),
                            quant_registry)
