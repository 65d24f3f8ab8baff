"""An FP8 layer's input quantized by the kernel that makes it (``loom.layers.quantized_input``): the
RMSNorms before qkv and gate/up and the SiLU-and-mul before down hand their layer e4m3 rows when it
would quantize them itself, and the model's outputs are the same bits.

On CUDA the FP8 method says so for W8A8 calls (5 rows and more) and the producers run fused
Triton kernels (their codes checked bit for bit in the interpreter: ``test_fused_layers.py``, group
``quantized_input``; on a GPU: ``tests/gpu/test_fused_layers_gpu.py``). Here, on the CPU, the
method's answer is patched to "always", so the same plumbing runs with the producers' torch path
and the CPU emulation of the FP8 product.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers.reference_attention import ModelHarness

from loom import kernel_switches
from loom.layers import quantized_input
from loom.layers.activation import SiluAndMul
from loom.layers.linear import LinearBase
from loom.layers.norm import RMSNorm
from loom.model_loader import load_model, resolve_model_dir
from loom.plugin_api import PluginRegistry
from loom.plugin_api.quantization import QuantizedRows, RowQuantization
from loom_plugins.quant import fp8

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128]


@pytest.fixture(scope="module")
def fp8_model(quant_registry: PluginRegistry) -> Any:
    return load_model(resolve_model_dir("random:tiny-llama"), torch.float32, "cpu", quant_registry, "fp8")


@pytest.fixture
def producers_quantize(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every FP8 layer asks for its input quantized per row (as W8A8 on CUDA does); yields the
    count of pre-quantized inputs the layers multiplied."""
    calls = [0]
    original = fp8.FP8Forward.apply_quantized

    def counted(self: Any, layer: Any, x: QuantizedRows, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls[0] += 1
        return original(self, layer, x, bias)

    monkeypatch.setattr(fp8, "fp8_input_quantization", lambda layer, rows, dtype: RowQuantization(None))
    monkeypatch.setattr(fp8.FP8Forward, "apply_quantized", counted)
    yield calls


def test_quantized_by_the_producers_gives_the_same_logits(fp8_model: Any, producers_quantize: list[int]) -> None:
    harness = ModelHarness(fp8_model.model, fp8_model.hf_config)
    want = ModelHarness(fp8_model.model, fp8_model.hf_config)
    kernel_switches.fused_input_quant = False
    try:
        plain = want.prefill(PROMPT)
    finally:
        kernel_switches.fused_input_quant = True
    assert producers_quantize[0] == 0  # switched off: every layer quantized its own input
    got = harness.prefill(PROMPT)
    layers = fp8_model.hf_config.num_hidden_layers
    assert producers_quantize[0] == 3 * layers  # qkv, gate/up and down of every layer; o_proj quantizes itself
    assert torch.equal(got, plain)


def test_the_producers_ask_the_layer_they_feed(fp8_model: Any, producers_quantize: list[int]) -> None:
    layer = fp8_model.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    norm: RMSNorm = layer.input_layernorm
    assert quantized_input.wanted(norm, 5, torch.float32) == RowQuantization(None)
    assert quantized_input.wanted(layer.mlp.act_fn, 5, torch.float32) == RowQuantization(None)
    assert quantized_input.wanted(RMSNorm(64), 5, torch.float32) is None  # feeds nothing
    assert "_feeds" not in dict(norm.named_modules())  # not a second parent of qkv
    kernel_switches.fused_input_quant = False
    try:
        assert quantized_input.wanted(norm, 5, torch.float32) is None
    finally:
        kernel_switches.fused_input_quant = True
    qkv.lora = object()  # LoRA adapters multiply the dense input: it stays dense
    try:
        assert qkv.input_quantization(5, torch.float32) is None
        assert quantized_input.wanted(norm, 5, torch.float32) is None
    finally:
        del qkv.lora


def test_without_cuda_state_the_fp8_layers_take_dense_input(fp8_model: Any) -> None:
    """On the CPU no FP8 layer has ``_scaled_mm`` operands: every call keeps its dense input, and
    a dense model's layers never ask for anything."""
    qkv: LinearBase = fp8_model.model.model.layers[0].self_attn.qkv_proj
    assert qkv.input_quantization(64, torch.float32) is None
    dense = LinearBase.__new__(LinearBase)
    from loom.plugin_api.quantization import UnquantizedLinearMethod

    assert UnquantizedLinearMethod().input_quantization(dense, 64, torch.float32) is None


@pytest.mark.parametrize("static", [False, True])
def test_torch_quantize_matches_the_fp8_emulation(static: bool) -> None:
    """``quantized_input.quantize`` (what the fused kernels make, and the producers' torch path)
    dequantizes to exactly what an FP8 layer's ``transform_input`` multiplies."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 96, generator=g) * torch.logspace(-3, 2, 9)[:, None]).to(torch.bfloat16)
    x[4] = 0
    scale = torch.tensor([0.0173]) if static else None
    rows = quantized_input.quantize(x, RowQuantization(scale))
    assert rows.codes.dtype == torch.float8_e4m3fn and rows.scales.shape == (9, 1) and rows.shape == x.shape
    assert torch.equal(rows.dequantize(), fp8.fake_quantize_activations(x, scale))


def test_silu_and_norm_hand_dense_output_to_a_dense_consumer() -> None:
    act, norm = SiluAndMul(), RMSNorm(8)
    x = torch.randn(3, 16)
    assert torch.equal(act.forward_for_linear(x), act(x))
    normed, h = norm.forward_for_linear(x[:, :8], None)
    assert torch.equal(normed, norm(x[:, :8])) and h is not None
