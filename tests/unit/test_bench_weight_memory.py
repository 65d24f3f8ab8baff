"""W6's weight memory and weight-read limit: the bytes of the weights as the engine serves them
(measured on one decoder layer for random-weight models), and the limits computed from them."""

from __future__ import annotations

import pytest
import torch

from loom.bench.limits import Hardware, ModelCost, served_cost, w1_limit, weight_read_limit
from loom.bench.weight_memory import measure_weight_memory, module_weight_bytes
from loom.bench.workloads import decode_w1
from loom.model_loader import load_model, resolve_model_dir
from loom.plugin_api import PluginRegistry

CPU = torch.device("cpu")


@pytest.mark.parametrize("quantize", ["none", "gptq", "awq", "fp8", "nf4"])
def test_one_layer_measurement_equals_the_whole_model(quantize: str, quant_registry: PluginRegistry) -> None:
    path = resolve_model_dir("random:tiny-llama")
    measured = measure_weight_memory(path, torch.float32, CPU, quantize, quant_registry)
    whole = load_model(path, torch.float32, CPU, quant_registry, quantize)
    assert measured["weight_bytes"] == module_weight_bytes(whole.model)
    assert measured["num_layers"] == 2 and measured["quantization"] == (None if quantize == "none" else quantize)


def test_weight_bytes_count_the_packed_formats(quant_registry: PluginRegistry) -> None:
    from loom.bench.limits import model_cost

    path = resolve_model_dir("random:tiny-llama")
    dense = measure_weight_memory(path, torch.float32, CPU, "none", quant_registry)
    assert dense["weight_bytes"] == model_cost(path, torch.float32).weight_bytes  # every parameter once
    gptq = measure_weight_memory(path, torch.float32, CPU, "gptq", quant_registry)
    # tiny-llama's decoder layer: qkv 64 -> 128, o 64 -> 64, gate/up 64 -> 256, down 128 -> 64, groups of 64;
    # on the CPU the GPTQ tensors stay as the checkpoint has them: codes K*N/2, fp16 scales, 4-bit zeros
    linears = [(64, 128), (64, 64), (64, 256), (128, 64)]
    packed = sum(k * n // 2 + (k // 64) * n * 2 + (k // 64) * n // 2 for k, n in linears)
    norms = 2 * 64 * 4
    assert gptq["decoder_layer_bytes"] == packed + norms
    assert dense["decoder_layer_bytes"] == sum(k * n * 4 for k, n in linears) + norms


def test_limits_use_the_served_weight_bytes() -> None:
    cost = ModelCost(weight_bytes=16_060_522_496, body_matmul_params=6_979_321_856, head_params=525_336_576,
                     num_layers=32, num_heads=32, head_dim=128, kv_bytes_per_token=131072)
    hw = Hardware("cuda", "bfloat16", copy_bytes_per_s=4.3e12, matmul_flop_per_s=790e12)
    int4 = served_cost(cost, 5_700_000_000)  # llama-8b int4: ~3.5 GB packed layers + 2.1 GB embedding and head
    assert int4.body_matmul_params == cost.body_matmul_params and int4.weight_bytes == 5_700_000_000
    dense, packed = w1_limit(cost, hw, decode_w1()), w1_limit(int4, hw, decode_w1())
    assert packed["min_decode_step_s"] < dense["min_decode_step_s"] / 2.5
    alone = weight_read_limit(5_700_000_000, hw)
    assert alone["min_step_s"] == pytest.approx(5.7e9 / 4.3e12) and alone["max_decode_tok_s"] == pytest.approx(754.4, 0.01)


def test_fp8_experts_are_charged_their_served_bytes(quant_registry: PluginRegistry) -> None:
    """An MoE model with FP8 experts: the experts' bytes are measured as served (one byte a weight
    and a float32 scale a row), one layer's times the layers equals the whole model's, and the
    batch-1 read limit charges the chosen experts at those bytes."""
    from loom.bench.limits import model_cost

    path = resolve_model_dir("random:tiny-moe")
    cost = model_cost(path, torch.float32)
    dense = measure_weight_memory(path, torch.float32, CPU, "none", quant_registry)
    fp8 = measure_weight_memory(path, torch.float32, CPU, "fp8", quant_registry)
    assert dense["expert_bytes"] == cost.expert_bytes  # float32: four bytes a weight
    whole = load_model(path, torch.float32, CPU, quant_registry, "fp8")
    from loom.bench.weight_memory import expert_weight_bytes

    assert fp8["expert_bytes"] == expert_weight_bytes(whole.model)
    weights = cost.expert_bytes // 4
    rows = fp8["expert_bytes"] - weights  # the scales: a float32 per output row of every expert
    assert 0 < rows < weights // 8 and rows % 4 == 0
    served = served_cost(cost, fp8["weight_bytes"], fp8["expert_bytes"])
    idle = 1 - served.active_expert_fraction(1)
    assert served.step_weight_bytes(1) == pytest.approx(fp8["weight_bytes"] - fp8["expert_bytes"] * idle
                                                        - served.embedding_bytes)
