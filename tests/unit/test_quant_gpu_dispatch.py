"""Where the quantizers' GPU kernels apply, checked without a GPU: FP8 on a GPU older than compute
capability 8.9 is unavailable and ``loom plugins`` says why; the CPU never repacks or calls a
kernel; ``LOOM_FUSED_KERNELS=0`` and another activation dtype fall back to the dequantizing path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import quant_layers as ql

from loom import kernel_switches
from loom.plugin_api import PluginRegistry
from loom.plugin_api.listing import format_plugins
from loom.plugin_api.quantization import QuantizationError
from loom_plugins.quant import fp8, w4a16_triton
from loom_plugins.quant.dequant_linear import DequantLinearMethod


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, capabilities: list[tuple[int, int]]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capabilities[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"GPU-{capabilities[i][0]}{capabilities[i][1]}")


def test_fp8_on_an_older_gpu_is_unavailable_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import loom_plugins.quant

    _fake_gpus(monkeypatch, [(8, 0)])
    reason = "FP8 matmul needs compute capability 8.9 (Ada, Hopper or newer); GPU 0 (GPU-80) is 8.0"
    assert fp8.unsupported_reason() == reason
    registry = PluginRegistry()
    registry.register(loom_plugins.quant, "loom-quant", "loom-server")
    line = next(row for row in format_plugins(registry).splitlines() if " fp8 " in f" {row} ")
    assert f"unavailable: {reason}" in line
    _fake_gpus(monkeypatch, [(8, 0), (9, 0)])  # one GPU that can: available
    assert fp8.unsupported_reason() is None


def test_fp8_config_refuses_an_older_cuda_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    _fake_gpus(monkeypatch, [(9, 0), (7, 5)])
    with pytest.raises(QuantizationError, match=r"FP8 matmul needs compute capability 8\.9 .* GPU 1 \(GPU-75\) is 7\.5"):
        fp8.FP8Config(tmp_path, torch.device("cuda", 1), torch.bfloat16)
    fp8.FP8Config(tmp_path, torch.device("cuda", 0), torch.bfloat16)  # a Hopper: accepted
    fp8.FP8Config(tmp_path, torch.device("cpu"), torch.float32)  # the CPU emulates


@pytest.mark.parametrize("scheme", [ql.gptq_scheme(32), ql.awq_scheme(32), ql.nf4_scheme(), ql.fp8_scheme(True, False)],
                         ids=lambda s: s.name)
def test_cpu_layers_keep_the_checkpoint_layout_and_no_kernel(scheme: ql.Scheme) -> None:
    layer = ql.build_layer(scheme, 128, [64, 32], ql.dense_parts(128, [64, 32], seed=0), "cpu", torch.float32)
    assert "w4a16" not in layer.__dict__ and "fp8_gpu" not in layer.__dict__
    method = layer.quant_method
    assert isinstance(method, DequantLinearMethod) and "cpu" not in method.kernels and "cuda" in method.kernels
    x = torch.randn(3, 128)
    expected = torch.nn.functional.linear(method.transform_input(layer, x), method.dequantize(layer, torch.float32))
    assert torch.equal(layer(x), expected)


def test_kernel_declines_when_switched_off_or_for_another_dtype() -> None:
    layer = ql.build_layer(ql.gptq_scheme(32), 128, [64], ql.dense_parts(128, [64], seed=0), "cpu", torch.float16)
    checkpoint = layer.quant_method.dequantize(layer, torch.float32)
    layout = layer.quant_method.to_layout(layer)
    layout.register(layer)  # as a CUDA load would (the kernel itself is not launched here)
    assert layer.w4a16 is layout and layer.w4a16_qweight is layout.qweight
    assert w4a16_triton.layer_kernel(layer, torch.randn(2, 128), None) is None  # float32 activations: not its dtype
    with kernel_switches.fused_kernels_off():
        assert w4a16_triton.layer_kernel(layer, torch.randn(2, 128).half(), None) is None
    # the dequantizing path (the kernel's fallback) now reads the repacked layout: the same weight
    assert torch.equal(layer.quant_method.dequantize(layer, torch.float32), checkpoint)
    assert not w4a16_triton.repacks_on(torch.device("cpu"))
