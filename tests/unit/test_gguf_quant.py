"""The ``gguf`` quantizer: exact weights from the file's blocks, batch-invariant sums, loading."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.reference_attention import ModelHarness
from helpers.tiny_models import hf_logits

from loom.model_loader import load_model
from loom.model_loader.errors import ModelLoadError
from loom.model_loader.gguf_cache import BLOCKS_FILE, _matching_rows, _rows_after_reverse_permute
from loom.plugin_api import PluginRegistry
from loom_plugins.quant import gguf as gguf_quant

gguf = pytest.importorskip("gguf")

needs_kernel = pytest.mark.skipif(not gguf_quant.kernel_available(),
                                  reason=f"GGUF CPU kernel unavailable: {gguf_quant.cpu_unsupported_reason()}")

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")
BLOCK_WEIGHTS = {"Q4_K": 256}  # the others: 32


def random_blocks(rows: int, cols: int, type_name: str, seed: int = 0) -> torch.Tensor:
    """GGUF blocks [rows, cols / block weights * block bytes]: random payloads, finite fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    bb = gguf_quant._BLOCK_BYTES[type_name]
    nb = cols // BLOCK_WEIGHTS.get(type_name, 32)
    raw = torch.randint(0, 256, (rows, nb, bb), generator=g, dtype=torch.uint8)
    scales = (torch.rand(rows, nb, 2, generator=g) * 0.02 - 0.01).half()  # d (and m / dmin)
    raw[:, :, 0:2] = scales[:, :, 0:1].contiguous().view(torch.uint8)
    if type_name in ("Q4_1", "Q4_K"):
        raw[:, :, 2:4] = scales[:, :, 1:2].contiguous().view(torch.uint8)
    return raw.reshape(rows, nb * bb)


def cols_for(type_name: str, k: int) -> int:
    return max(k, BLOCK_WEIGHTS.get(type_name, 32)) // BLOCK_WEIGHTS.get(type_name, 32) * BLOCK_WEIGHTS.get(type_name, 32)


def gguf_py_dequantize(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[type_name]).copy())


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [8, 37, 200])
def test_kernel_weights_are_gguf_py_dequantized_values_bit_for_bit(type_name: str, rows: int) -> None:
    cols = cols_for(type_name, 96)
    raw = random_blocks(rows, cols, type_name)
    layer = gguf_quant.GGUFLinear.from_blocks(raw, type_name, cols)
    assert torch.equal(layer.dequantized_weight(), gguf_py_dequantize(raw, type_name))


@needs_kernel
def test_fused_parts_of_two_block_types_concatenate_exactly() -> None:
    q_part, k_part = random_blocks(24, 256, "Q4_1", seed=4), random_blocks(13, 256, "Q4_K", seed=5)
    parts = [gguf_quant.unpack(q_part, "Q4_1"), gguf_quant.unpack(k_part, "Q4_K")]
    layer = gguf_quant.GGUFLinear(parts, 256, None, "Q4_1+Q4_K")
    expected = torch.cat([gguf_py_dequantize(q_part, "Q4_1"), gguf_py_dequantize(k_part, "Q4_K")])
    assert torch.equal(layer.dequantized_weight(), expected)
    with pytest.raises(gguf_quant.QuantizationError, match="different kernel formats"):
        gguf_quant.pack([gguf_quant.unpack(q_part, "Q4_1"), gguf_quant.unpack(random_blocks(8, 256, "Q8_0"), "Q8_0")])


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
def test_linear_matches_dense_matmul_and_never_depends_on_the_batch(type_name: str) -> None:
    cols = cols_for(type_name, 320)
    raw = random_blocks(53, cols, type_name, seed=1)
    bias = torch.randn(53)
    layer = gguf_quant.GGUFLinear.from_blocks(raw, type_name, cols, bias)
    dense = gguf_py_dequantize(raw, type_name)
    x = torch.randn(41, cols, generator=torch.Generator().manual_seed(2))
    y = layer(x)
    torch.testing.assert_close(y, x @ dense.T + bias, atol=1e-4, rtol=1e-4)
    # Every row alone, and inside batches of every size on both kernel paths: the same bits.
    for i in range(41):
        assert torch.equal(layer(x[i:i + 1]), y[i:i + 1])
    for m in (2, 3, 6, 7, 13):
        assert torch.equal(layer(x[:m]), y[:m])
    assert torch.equal(layer(x.view(1, 41, cols))[0], y)  # leading dimensions pass through


@needs_kernel
def test_kernel_refuses_mismatched_operands() -> None:
    layer = gguf_quant.GGUFLinear.from_blocks(random_blocks(16, 64, "Q4_1"), "Q4_1", 64)
    with pytest.raises(RuntimeError, match="features but the weight has"):
        torch.ops.loom_gguf_cpu.linear(torch.randn(2, 96), layer.qs, layer.d, layer.m, layer.qtype, 16)
    with pytest.raises(RuntimeError, match="unsupported GGUF type"):
        torch.ops.loom_gguf_cpu.linear(torch.randn(2, 64), layer.qs, layer.d, layer.m, 12, 16)
    with pytest.raises(RuntimeError, match="column groups"):
        torch.ops.loom_gguf_cpu.linear(torch.randn(2, 64), layer.qs, layer.d, layer.m, layer.qtype, 40)
    with pytest.raises(gguf_quant.QuantizationError, match="no kernel"):
        gguf_quant.GGUFLinear.from_blocks(random_blocks(8, 64, "Q4_1"), "Q5_K", 64)


def test_row_order_search_finds_transformers_q_k_permutation() -> None:
    values = np.random.default_rng(0).standard_normal((24, 32)).astype(np.float32)
    permuted = values[_rows_after_reverse_permute(24, 3)]
    order = _matching_rows(values, permuted, {3, 1})
    assert order is not None and np.array_equal(values[order], permuted)
    assert _matching_rows(values, values[::-1].copy(), {3}) is None  # no candidate matches: not kept
    assert np.array_equal(_matching_rows(values, values, {3}), np.arange(24))


def test_quantizer_is_listed_with_its_availability(quant_registry: PluginRegistry) -> None:
    info = quant_registry.get("quantizer", "gguf")
    assert info.spec.kind == "quantizer"
    assert info.unavailable_reason == gguf_quant.cpu_unsupported_reason()


@needs_kernel
def test_default_model_runs_on_its_own_blocks_with_the_exact_dense_weights(
    default_model_dir: Path, quant_registry: PluginRegistry
) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer, LlamaForCausalLM

    with safe_open(str(default_model_dir / BLOCKS_FILE), framework="pt") as f:
        types = json.loads(f.metadata()["types"])
    assert set(types.values()) == {"Q4_1", "Q8_0"} and len(types) == 30 * 7 + 1  # every matrix
    quantized = load_model(default_model_dir, torch.float32, torch.device("cpu"), quant_registry)
    dense = load_model(default_model_dir, torch.float32, torch.device("cpu"), quant_registry, quantize="none")
    assert (quantized.quantization, dense.quantization) == ("gguf", None)
    dense_params = dict(dense.model.named_parameters())
    layers = {n: m for n, m in quantized.model.named_modules()
              if isinstance(getattr(m, "quant_method", None), gguf_quant.GGUFLinearMethod)}
    assert len(layers) == 30 * 4 + 1  # qkv, o, gate_up, down per layer and the tied head
    for name, layer in layers.items():
        reference = dense_params["model.embed_tokens.weight" if name == "lm_head" else f"{name}.weight"]
        assert torch.equal(layer.quant_method.dequantized_weight(layer), reference), name

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = tokenizer("The capital of France is")["input_ids"]
    ours = ModelHarness(quantized.model, quantized.hf_config, num_blocks=16).prefill(prompt)
    hf = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, attn_implementation="eager")
    theirs = hf_logits(hf.eval(), prompt)
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_explicit_gguf_quantizer_says_why_it_cannot_serve(
    tiny_model_dir: Callable[[str], Path], default_model_dir: Path, quant_registry: PluginRegistry
) -> None:
    with pytest.raises(ModelLoadError, match="holds no GGUF blocks"):
        load_model(tiny_model_dir("llama"), torch.float32, torch.device("cpu"), quant_registry, quantize="gguf")
    with pytest.raises(ModelLoadError, match="compute in float32"):
        load_model(default_model_dir, torch.bfloat16, torch.device("cpu"), quant_registry, quantize="gguf")
    # auto: a checkpoint without blocks, or a dtype the kernel does not serve, stays dense
    assert load_model(tiny_model_dir("llama"), torch.float32, "cpu", quant_registry).quantization is None
    assert load_model(default_model_dir, torch.bfloat16, "cpu", quant_registry).quantization is None


@needs_kernel
def test_prefill_sized_inputs_use_the_dense_gemm_on_the_same_weights() -> None:
    raw = random_blocks(24, 64, "Q4_1", seed=3)
    layer = gguf_quant.GGUFLinear.from_blocks(raw, "Q4_1", 64, torch.randn(24))
    x = torch.randn(gguf_quant.DENSE_ROWS + 5, 64)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias))
