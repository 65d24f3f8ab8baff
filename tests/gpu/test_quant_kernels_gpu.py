"""The quantizers' GPU kernels against the CPU dequantizing reference, on llama-8b's layer shapes.

Each layer is built twice from the same checkpoint tensors, the way the loader builds it: on the
CPU (the checkpoint's layout, dequantized per call: the reference) and on CUDA (repacked at load
for the kernels). For M in {1, 7, 32, 128, 300} tokens (the GEMV, the transposed split-K GEMM at
7, 32 and 128, the dequantize-then-matmul path from ``DENSE_FROM_TOKENS`` (129) on; and at 300
the GEMM's 256-token tiles, the dense path moved up as LOOM_W4A16_DENSE_FROM does), the CUDA
output ``y`` (bf16) must satisfy, for every output element,

    |y - ref| <= (2u + K 2^-24) * (|x| @ |W|^T) + u * |ref|,   u = 2^-8 (bf16's unit roundoff)

with ``ref = x @ W^T`` in float64 and ``W`` the CPU reference weight: the kernels round each scale
to bf16 once and (the GEMM) the dequantized weight once, accumulate in float32 (K 2^-24) and round
the output once. An off-by-one zero point or a misplaced group would exceed it by orders of
magnitude. FP8: ``ref`` is the e4m3 activations (the CPU's own per-token codes and scales) times
W in float64; the e4m3 products are exact and the tensor cores' accumulation is looser than
float32, so the bound there is ``2^-10 * (|xq| @ |W|^T) + u * |ref|``. At 1-4 rows FP8 layers run
the weight-only GEMV (``fp8_gemv``: W8A16, the activations not rounded), so there ``ref`` is the
activations themselves times W, within ``(K 2^-20) (|x| @ |W|^T) + u |ref|`` plus ``2^-30
max|x_row| sum_k |W[n, k]|`` (the fp16 rounding of a bf16 row scaled by a power of two).

Then: the kernels (and FP8's ``_scaled_mm``) replay inside a captured CUDA graph with the same
bits as eager calls; NF4 matches bitsandbytes' own dequantization (with and without double
quantization); a tiny random model quantized while loading gives the same logits through the
kernels as through the torch path (``LOOM_FUSED_KERNELS=0``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from helpers import quant_layers as ql
from helpers.reference_attention import ModelHarness

from loom import kernel_switches
from loom.model_loader import load_model, resolve_model_dir
from loom.plugin_api import PluginRegistry
from loom_plugins.quant import fp8_gemv, fp8_triton, w4a16_triton
from loom_plugins.quant.fp8 import FP8_MAX, quantize_fp8
from loom_plugins.quant.fp8 import fp8_kernel as fp8_layer_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
DTYPE = torch.bfloat16
U = 2.0**-8  # bf16's unit roundoff
M_VALUES = (1, 7, 32, 128, 300)
SCHEMES: dict[str, ql.Scheme] = {
    "gptq-g128": ql.gptq_scheme(128),
    "gptq-g128-act-order": ql.gptq_scheme(128, act_order=True),
    "gptq-8bit-g128": ql.gptq_scheme(128, bits=8),
    "awq-g128": ql.awq_scheme(128),
    "wna16-g128": ql.wna16_scheme(128),
    "wna16-g128-asym-act-order": ql.wna16_scheme(128, sym=False, act_order=True),
    "nf4": ql.nf4_scheme(),
    "gptq-random-while-loading": ql.while_loading_scheme("gptq"),
    "nf4-while-loading": ql.while_loading_scheme("nf4"),
    "fp8-channel-dynamic": ql.fp8_scheme(per_channel=True, static=False),
    "fp8-tensor-static": ql.fp8_scheme(per_channel=False, static=True),
    "fp8-while-loading": ql.while_loading_scheme("fp8"),
}


def _is_fp8(layer: Any) -> bool:
    return "fp8_gpu" in layer.__dict__


def _kernel(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The layer's CUDA kernel called directly (it must take the call)."""
    y = fp8_layer_kernel(layer, x, layer.bias) if _is_fp8(layer) else w4a16_triton.layer_kernel(layer, x, layer.bias)
    assert y is not None, "the CUDA kernel did not take the call"
    return y


def _fp8_activations(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The e4m3 activations the GPU multiplies, computed by the CPU code: codes times scales, float64."""
    state = layer.__dict__["fp8_gpu"]
    xf = x.float().cpu()
    if state.input_scale is not None:
        scale = state.input_scale.cpu().reshape(1, 1)
    else:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (quantize_fp8(xf, scale).double() * scale.double()).to(x.device)


def check_close(layer: Any, w_ref: torch.Tensor, x: torch.Tensor, y: torch.Tensor, label: str) -> float:
    """Assert the stated bound; returns the largest error / bound."""
    k = x.shape[-1]
    if _is_fp8(layer) and fp8_gemv.plan_for(x, layer.fp8_gpu.weight) is not None:  # W8A16 at 1-4 rows
        xr = x.double()
        ref = xr @ w_ref.t()
        bound = (k * 2.0**-20) * (xr.abs() @ w_ref.abs().t()) + U * ref.abs()
        bound = bound + 2.0**-30 * xr.abs().amax(dim=1, keepdim=True) * w_ref.abs().sum(dim=1)[None, :]
    elif _is_fp8(layer):
        xr = _fp8_activations(layer, x)
        ref = xr @ w_ref.t()
        bound = 2.0**-10 * (xr.abs() @ w_ref.abs().t()) + U * ref.abs()
    else:
        xr = x.double()
        ref = xr @ w_ref.t()
        bound = (2 * U + k * 2.0**-24) * (xr.abs() @ w_ref.abs().t()) + U * ref.abs()
    if layer.bias is not None:
        ref = ref + layer.bias.double()
        bound = bound + U * layer.bias.double().abs()
    err = (y.double() - ref).abs()
    ratio = float((err / (bound + 1e-30)).max())
    assert y.dtype == DTYPE and y.shape == ref.shape, label
    assert ratio <= 1.0, f"{label}: max error / bound {ratio:.3f}"
    return ratio


def _layers(scheme: ql.Scheme, k: int, parts: list[int], seed: int, bias: bool = False) -> tuple[Any, Any, torch.Tensor]:
    weights = ql.dense_parts(k, parts, seed)
    b = torch.randn(sum(parts), generator=torch.Generator().manual_seed(seed)) * 0.1 if bias else None
    cpu = ql.build_layer(scheme, k, parts, weights, "cpu", DTYPE, b)
    gpu = ql.build_layer(scheme, k, parts, weights, CUDA, DTYPE, b)
    assert "w4a16" in gpu.__dict__ or _is_fp8(gpu), f"{scheme.name}: the CUDA layer was not prepared for a kernel"
    w_ref = cpu.quant_method.dequantize(cpu, torch.float32).to(CUDA, torch.float64)  # the CPU reference
    return cpu, gpu, w_ref


@pytest.mark.parametrize("shape", ql.LLAMA_8B_SHAPES, ids=[s[0] for s in ql.LLAMA_8B_SHAPES])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_kernels_match_the_cpu_reference_on_llama_8b_shapes(name: str, shape: tuple[str, int, list[int]]) -> None:
    _, k, parts = shape
    _, gpu, w_ref = _layers(SCHEMES[name], k, parts, seed=len(name) + k)
    g = torch.Generator(device=CUDA).manual_seed(0)
    for m in M_VALUES:
        x = torch.randn(m, k, device=CUDA, generator=g).to(DTYPE)
        y = _kernel(gpu, x)
        check_close(gpu, w_ref, x, y, f"{name} {shape[0]} M={m}")
        assert torch.equal(gpu(x), y)  # the layer's forward is the kernel
    if not _is_fp8(gpu):  # the dequantize-then-matmul path at 7 tokens; the fused GEMM at 300
        x = torch.randn(7, k, device=CUDA, generator=g).to(DTYPE)
        check_close(gpu, w_ref, x, w4a16_triton.w4a16_linear(x, gpu.w4a16, None, dense_from=1),
                    f"{name} {shape[0]} dense path")
        x = torch.randn(300, k, device=CUDA, generator=g).to(DTYPE)
        check_close(gpu, w_ref, x, w4a16_triton.w4a16_linear(x, gpu.w4a16, None, dense_from=1024),
                    f"{name} {shape[0]} fused GEMM at 300 tokens")


@pytest.mark.parametrize("name", ["gptq-g128-act-order", "awq-g128", "nf4", "fp8-channel-dynamic"])
def test_bias_and_3d_inputs(name: str) -> None:
    _, gpu, w_ref = _layers(SCHEMES[name], 4096, [1024, 512], seed=5, bias=True)
    x = torch.randn(2, 9, 4096, device=CUDA).to(DTYPE)
    y = gpu(x)
    assert y.shape == (2, 9, 1536)
    check_close(gpu, w_ref, x.reshape(18, 4096), y.reshape(18, 1536), f"{name} bias, 3-d input")


@pytest.mark.parametrize("name", [n for n in SCHEMES if n.startswith("fp8")])
def test_fp8_row_wise_and_per_tensor_forms_agree(name: str) -> None:
    """The probe's answer on this GPU, and the fallback forced: both within the bound."""
    _, gpu, w_ref = _layers(SCHEMES[name], 4096, [4096, 1024, 1024], seed=11)
    state = gpu.fp8_gpu
    assert state.rowwise == fp8_triton.rowwise_supported(0, DTYPE)
    x = torch.randn(32, 4096, device=CUDA).to(DTYPE)
    first = _kernel(gpu, x)
    check_close(gpu, w_ref, x, first, f"{name} rowwise={state.rowwise}")
    state.rowwise = not state.rowwise
    try:
        check_close(gpu, w_ref, x, _kernel(gpu, x), f"{name} rowwise={state.rowwise}")
    except RuntimeError as exc:  # row-wise scales not supported here: the probe said so
        assert not fp8_triton.rowwise_supported(0, DTYPE), exc
    finally:
        state.rowwise = not state.rowwise


def test_fp8_activation_quantization_is_the_cpu_emulation_bit_for_bit() -> None:
    from loom_plugins.quant.fp8 import fake_quantize_activations

    x = (torch.randn(300, 14336, device=CUDA) * torch.logspace(-3, 3, 300, device=CUDA).unsqueeze(1)).to(DTYPE)
    x[7] = 0
    q, scales = fp8_triton.quantize_rows(x)
    xf = x.float().cpu()
    expected_scales = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    assert torch.equal(scales.cpu(), expected_scales)
    assert torch.equal(q.cpu().view(torch.uint8), quantize_fp8(xf, expected_scales).view(torch.uint8))
    assert torch.equal((q.float() * scales).to(DTYPE).cpu(), fake_quantize_activations(x.cpu(), None))
    static = torch.tensor([0.05], device=CUDA)
    q, scales = fp8_triton.quantize_rows(x, static)
    assert torch.equal(q.cpu().view(torch.uint8), quantize_fp8(xf, static.cpu()).view(torch.uint8))
    assert bool((scales == 0.05).all())


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_kernel_matches_bitsandbytes(double_quant: bool) -> None:
    pytest.importorskip("bitsandbytes")
    k, parts = 4096, [4096, 1024, 1024]
    weights = ql.dense_parts(k, parts, seed=3)
    gpu = ql.build_layer(ql.bnb_nf4_scheme(double_quant), k, parts, weights, CUDA, DTYPE)
    w_ref = ql.bnb_reference(weights, double_quant).to(CUDA, torch.float64)
    for m in M_VALUES:
        x = torch.randn(m, k, device=CUDA).to(DTYPE)
        check_close(gpu, w_ref, x, _kernel(gpu, x), f"bitsandbytes NF4 double_quant={double_quant} M={m}")


@pytest.mark.parametrize("name", list(SCHEMES))
def test_kernels_replay_in_a_cuda_graph(name: str) -> None:
    """A forward captured once, replayed on new inputs written into the captured buffer: the same
    bits as eager calls (the kernels are deterministic: split-K partials are summed in order)."""
    _, gpu, _ = _layers(SCHEMES[name], 4096, [2048, 512, 512], seed=7)
    for m in (1, 32, 128, 300):
        x = torch.empty(m, 4096, device=CUDA, dtype=DTYPE)
        g = torch.Generator(device=CUDA).manual_seed(m)
        x.copy_(torch.randn(m, 4096, device=CUDA, generator=g))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                gpu(x)  # compile, probe and warm up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gpu(x)
        for _ in range(2):
            x.copy_(torch.randn(m, 4096, device=CUDA, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, gpu(x)), f"{name} M={m}"


PACKED_SCHEMES = {**{n: SCHEMES[n] for n in ("gptq-g128", "gptq-g128-act-order", "awq-g128")},
                  "gptq-g32": ql.gptq_scheme(32)}  # 32-deep K tiles: four words a tile row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(PACKED_SCHEMES))
def test_packed_4bit_tile_gives_the_float32_tiles_bits(name: str, dtype: torch.dtype,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``LOOM_W4A16_PACKED``: the transposed GEMM's 4-bit tile dequantized two weights to a 32-bit
    operation in the activations' dtype (and whole K tiles loaded without predicates) gives the
    same output bits as the float32 tile rounded once, at every count the GEMM serves (a partial
    M tile, split K, 256-token tiles with the dense path moved up), with a bias, on a layer whose
    N is not a multiple of the tile."""
    k, parts = 4096, [1024, 200]
    weights = ql.dense_parts(k, parts, seed=11)
    bias = torch.randn(sum(parts), generator=torch.Generator().manual_seed(5)) * 0.1
    layer = ql.build_layer(PACKED_SCHEMES[name], k, parts, weights, CUDA, dtype, bias)
    g = torch.Generator(device=CUDA).manual_seed(3)
    for m in (2, 7, 32, 100, 128, 300):
        x = torch.randn(m, k, device=CUDA, generator=g).to(dtype)
        outs, plans = [], []
        for packed in (False, True):
            monkeypatch.setattr(w4a16_triton, "PACKED", packed)
            outs.append(w4a16_triton.w4a16_linear(x, layer.w4a16, layer.bias, dense_from=1024))
            plans.append(w4a16_triton.plan(m, sum(parts), k, layer.w4a16.group_size, w4a16_triton.sm_count(CUDA), 1024))
        # the same K splits both ways (the packed tile's split cap does not reach N = 1,224), so
        # the float32 partial sums add in the same order and the bits can be compared
        assert plans[0] == plans[1], plans
        assert torch.equal(outs[0], outs[1]), f"{name} {dtype} M={m}"


@pytest.mark.parametrize("quantize", ["gptq", "awq", "fp8", "nf4"])
def test_random_model_through_the_kernels_matches_the_torch_path(quantize: str,
                                                                 quant_registry: PluginRegistry) -> None:
    loaded = load_model(resolve_model_dir("random:tiny-llama"), DTYPE, CUDA, quant_registry, quantize)
    layers = [m for m in loaded.model.modules() if "w4a16" in m.__dict__ or "fp8_gpu" in m.__dict__]
    assert len(layers) == 8  # every decoder linear was prepared for a kernel
    harness = ModelHarness(loaded.model, loaded.hf_config, dtype=DTYPE, device="cuda")
    prompt = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300]
    with torch.no_grad():
        fast = harness.prefill(prompt).float()
        with kernel_switches.fused_kernels_off():
            slow = ModelHarness(loaded.model, loaded.hf_config, dtype=DTYPE, device="cuda").prefill(prompt).float()
    rel = float((fast - slow).norm() / slow.norm())
    # bf16 roundings in a different order, through two layers. FP8 quantizes each activation to
    # 3 mantissa bits from inputs that differ by those roundings: where one crosses a code
    # boundary it moves by a whole e4m3 step (1/16 to 1/8), so its paths differ more
    # (0.0202 on the H200, 2026-12-02).
    assert rel < (4e-2 if quantize == "fp8" else 2e-2), rel
    assert float((fast.argmax(-1) == slow.argmax(-1)).float().mean()) >= 0.9


def test_gptq_head_of_llama_8b_through_the_kernels_matches_the_cpu_reference() -> None:
    """A quantized head (GPTQ's ``lm_head: true``) is one more GPTQ layer, 128,256 x 4096 for
    llama-8b: the GEMV at one token, the transposed GEMM and both paths beyond, under the same
    bound as the body's layers."""
    _, gpu, w_ref = _layers(SCHEMES["gptq-g128"], 4096, [128256], seed=11)
    g = torch.Generator(device=CUDA).manual_seed(1)
    for m in (1, 4, 64, 300):
        x = torch.randn(m, 4096, device=CUDA, generator=g).to(DTYPE)
        check_close(gpu, w_ref, x, _kernel(gpu, x), f"lm_head M={m}")


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_gptq_checkpoint_with_a_quantized_head_on_the_gpu_matches_the_cpu(
        model: str, tiny_model_dir: Any, quant_registry: PluginRegistry, tmp_path: Any) -> None:
    """The head is a :class:`ParallelLMHead` (qwen3's was tied): repacked at load like the body's
    layers and served by the kernels, in a CUDA graph-free prefill against the CPU's float32."""
    from helpers.quant_checkpoints import gptq_checkpoint

    path, _ = gptq_checkpoint(tiny_model_dir(model), tmp_path / "gptq", group=32, lm_head=True)
    gpu = load_model(path, DTYPE, CUDA, quant_registry)
    assert "w4a16" in gpu.model.lm_head.__dict__  # served by the kernels
    cpu = load_model(path, torch.float32, "cpu", quant_registry)
    prompt = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300]
    with torch.no_grad():
        fast = ModelHarness(gpu.model, gpu.hf_config, dtype=DTYPE, device="cuda").prefill(prompt).float().cpu()
        ref = ModelHarness(cpu.model, cpu.hf_config).prefill(prompt)
    rel = float((fast - ref).norm() / ref.norm())
    assert rel < 3e-2, rel  # bf16 against float32 through two layers and the head (0.011 on the CPU)
    assert float((fast.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_fp8_inputs_quantized_by_the_norms_and_silu_give_the_same_logits(quant_registry: PluginRegistry) -> None:
    """``loom.layers.quantized_input`` on CUDA: at W8A8 sizes the RMSNorms and SiLU-and-mul hand
    their FP8 layers e4m3 rows from their own kernels (only o_proj quantizes its input), at 1-4
    rows (the weight-only GEMV) they hand dense rows; the logits are the same bits as with every
    layer quantizing its own input (``LOOM_FUSED_INPUT_QUANT=0``), eagerly and in a CUDA graph."""
    from loom.layers import fused_ops

    loaded = load_model(resolve_model_dir("random:tiny-llama"), DTYPE, CUDA, quant_registry, "fp8")
    layers = loaded.hf_config.num_hidden_layers
    calls = {"fused_add_rms_norm_quant": 0, "silu_and_mul_quant": 0, "quantize_rows": 0}
    originals = {"fused_add_rms_norm_quant": fused_ops.fused_add_rms_norm_quant,
                 "silu_and_mul_quant": fused_ops.silu_and_mul_quant, "quantize_rows": fp8_triton.quantize_rows}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    prompt = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300]
    try:
        fused_ops.fused_add_rms_norm_quant = counting("fused_add_rms_norm_quant")
        fused_ops.silu_and_mul_quant = counting("silu_and_mul_quant")
        fp8_triton.quantize_rows = counting("quantize_rows")
        with torch.no_grad():
            got = ModelHarness(loaded.model, loaded.hf_config, dtype=DTYPE, device="cuda").prefill(prompt)
            assert calls == {"fused_add_rms_norm_quant": 2 * layers, "silu_and_mul_quant": layers,
                             "quantize_rows": layers}, calls
            kernel_switches.fused_input_quant = False
            try:
                want = ModelHarness(loaded.model, loaded.hf_config, dtype=DTYPE, device="cuda").prefill(prompt)
            finally:
                kernel_switches.fused_input_quant = True
            assert calls["quantize_rows"] == layers + 4 * layers
        assert torch.equal(got, want)
        short = prompt[:3]  # 1-4 rows: the GEMV takes dense rows, nothing is quantized
        for name in calls:
            calls[name] = 0
        with torch.no_grad():
            ModelHarness(loaded.model, loaded.hf_config, dtype=DTYPE, device="cuda").prefill(short)
        assert sum(calls.values()) == 0 or not kernel_switches.fp8_gemv, calls
    finally:
        fused_ops.fused_add_rms_norm_quant = originals["fused_add_rms_norm_quant"]
        fused_ops.silu_and_mul_quant = originals["silu_and_mul_quant"]
        fp8_triton.quantize_rows = originals["quantize_rows"]


def test_fp8_inputs_quantized_by_the_norm_and_silu_replay_in_a_cuda_graph() -> None:
    """The norm-and-quantize and SiLU-and-quantize kernels captured once and replayed on new
    inputs: the same codes and scales as eager calls."""
    from loom.layers import fused_ops

    T, H, inter = 64, 4096, 14336
    x = torch.empty(T, H, device=CUDA, dtype=DTYPE)
    res = torch.empty(T, H, device=CUDA, dtype=DTYPE)
    gate_up = torch.empty(T, 2 * inter, device=CUDA, dtype=DTYPE)
    weight = torch.randn(H, device=CUDA, dtype=DTYPE)
    g = torch.Generator(device=CUDA).manual_seed(11)

    def fill() -> None:
        for t in (x, res, gate_up):
            t.copy_(torch.randn(t.shape, device=CUDA, generator=g))

    def step() -> list[torch.Tensor]:
        return [*fused_ops.fused_add_rms_norm_quant(x, res, weight, 1e-6, None),
                *fused_ops.silu_and_mul_quant(gate_up, None)]

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        fill()
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, step(), strict=True):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
