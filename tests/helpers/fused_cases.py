"""Checks of ``loom.layers.fused_ops`` against the torch path of the layers it serves.

Shared by the CPU run through Triton's interpreter (``helpers/fused_interpret_check.py``, driven by
``tests/unit/test_fused_layers.py``) and the GPU tests (``tests/gpu/test_fused_layers_gpu.py``).
Each check calls a kernel's launcher directly and the layer with ``LOOM_FUSED_KERNELS=0`` for the
reference, on the same device, and raises AssertionError on a mismatch.

What is compared, and how closely (distances in units in the last place, ulps, of the dtype):

* rotary, the residual sum ``h``, and silu_and_mul on a GPU: bit-identical. The kernels round
  every intermediate as torch's separate ops do, and on a GPU silu uses the same expf and IEEE
  division as torch's CUDA kernel.
* RMSNorm in half precision: within 1 ulp of the normalised value. The float32 sum of squares
  is reduced in another order than torch's (and rsqrt may differ in its last bit), so the
  float32 value just before the cast can differ in its last bits and, near a rounding midpoint,
  round the other way. With a weight, whose product is rounded again, that 1 ulp of the
  normalised value can become 2 ulps of the output. Such flips are rare: at most 1% of the
  elements, where a rounding bug (e.g. a truncating cast) moves about half of them.
* RMSNorm in float32: rstd differs by a few ulps (sum order, and on a GPU Triton's approximate
  division and rsqrt) and scales the whole row, so most elements differ: up to 4 float32 ulps
  seen on an H200, 3 in the interpreter; 8 allowed (a relative 1e-6).
* silu_and_mul on the CPU: the interpreter's exp is numpy's and torch's CPU silu uses its own
  vectorised expf; they disagree in the last float32 bit now and then, which can move a rounded
  half-precision output by 1 ulp (rarely: share bounded as for the norm), float32 ones by a few.
* fused_combine_add_rms_norm (an MoE layer's weighted sum folded into the next add + norm):
  bit-identical to the combine kernel followed by fused_add_rms_norm (the same float32 sum in the
  same order, each term rounded, no FMA), and its residual sum to torch's combine and add.
* fused_add_rms_norm_quant and silu_and_mul_quant (an FP8 layer's input quantized by the kernel
  that makes it, ``loom.layers.quantized_input``): codes and scales bit-identical to quantizing
  the dense kernel's output (``quantized_input.quantize``, what ``fp8_triton.quantize_rows``
  computes), and the norm's residual sum to the dense kernel's; static and per-row scales, rows
  wider than one block (the two-pass SiLU), in the interpreter and on a GPU.
* qk_norm_rotary (Qwen3's q/k norms and RoPE in one kernel) against the two kernels it replaces
  (``fused_add_rms_norm`` per head, then ``rotary``): bit-identical, in the interpreter and on a
  GPU (the same sum of squares in the same layout: ``helpers/layout_compile_check.py`` compares
  them for sm_90). Against the torch path (and for Gemma's norm, which has no other kernel),
  the norm's rare flips pass through the rotation: each output within a few ulps of its head's
  largest value (one ulp of a normalised value moves a product by about an ulp of the head's
  scale, and the difference of two products can cancel to far smaller values), at most 2% of
  the elements differing in half precision (a rounding bug moves about half of them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from loom.layers import fused_ops, quantized_input
from loom.layers.activation import SiluAndMul
from loom.layers.norm import RMSNorm
from loom.layers.rotary import RotaryEmbedding, _default_inv_freq
from loom.plugin_api.quantization import RowQuantization

# (T, Hq, Hkv, D) of the rotary checks: GQA 4, GQA 6, MHA; D = 96 has a half (48) that is no
# power of two, so the kernel's masked lanes are exercised.
ROPE_HEADS = [(8, 2), (6, 1), (4, 4)]
NORM_SIZES = [64, 576, 2048]
SILU_SIZES = [64, 576, 2816]  # 2816: not a multiple of the kernel's column tile
TOKENS = [1, 7, 64]
MAX_POSITIONS = 4096


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Run the layers' torch code even on CUDA (the reference of every check)."""
    from loom.kernel_switches import fused_kernels_off

    with fused_kernels_off():
        yield


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise number of representable values between ``a`` and ``b`` (same float dtype)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    int_type, magnitude = {
        torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF),
        torch.float16: (torch.int16, 0x7FFF),
    }[a.dtype]

    def ordered(x: torch.Tensor) -> torch.Tensor:  # monotonic in the value; +0 and -0 both 0
        bits = x.contiguous().view(int_type).to(torch.int64)
        return torch.where(bits < 0, -(bits & magnitude), bits)

    return (ordered(a) - ordered(b)).abs()


def assert_ulps(got: torch.Tensor, ref: torch.Tensor, max_ulps: int, max_share: float, what: str) -> None:
    """``got`` within ``max_ulps`` of ``ref`` everywhere, and differing at most in ``max_share``
    of the elements (0: bit-identical)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{what}: {got.shape}/{got.dtype} vs {ref.shape}/{ref.dtype}"
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    dist = ulp_distance(got.cpu(), ref.cpu())
    worst, share = int(dist.max()), float((dist > 0).float().mean())
    assert worst <= max_ulps and share <= max_share, (
        f"{what}: max {worst} ulps (allowed {max_ulps}), {share:.2e} of elements differ (allowed {max_share})")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    # Drawn on the CPU so every device sees the same values.
    return (torch.randn(shape, generator=_gen(seed)) * scale).to(dtype).to(device)


def check_norm(device: str, dtype: torch.dtype, tokens: int, hidden: int, with_residual: bool) -> None:
    """``fused_add_rms_norm`` on ``[T, H]`` rows, with and without the residual add."""
    seed = tokens * 100_003 + hidden * 7 + with_residual
    x = _randn((tokens, hidden), seed, dtype, device)
    residual = _randn((tokens, hidden), seed + 1, dtype, device, scale=4.0) if with_residual else None
    for unit_weight in (True, False):  # the normalised value alone, then through the weight
        norm = RMSNorm(hidden, eps=1e-6).to(device=device, dtype=dtype)
        if not unit_weight:
            norm.weight.data = 1 + _randn((hidden,), seed + 2, dtype, device, scale=0.5)
        out, h = fused_ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        with torch_path():
            ref_h = x if residual is None else residual + x
            ref = norm(ref_h)
        assert_ulps(h, ref_h, 0, 0.0, "residual sum")
        assert_ulps(out, ref, *_norm_tolerance(dtype, unit_weight), f"norm (unit weight: {unit_weight})")


def _norm_tolerance(dtype: torch.dtype, unit_weight: bool) -> tuple[int, float]:
    """(max ulps, max share of differing elements) of an RMSNorm output: see the module docstring."""
    if dtype == torch.float32:
        return 8, 1.0
    return (1 if unit_weight else 2), 0.01


def check_head_norm(device: str, dtype: torch.dtype, tokens: int, heads: int, head_dim: int) -> None:
    """The per-head norm of Qwen3 (q_norm): ``[T, heads, D]`` over a strided view of a qkv row."""
    seed = tokens * 31 + heads * 5 + head_dim
    qkv = _randn((tokens, (heads + 2) * head_dim), seed, dtype, device)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # row stride (heads + 2) * D
    norm = RMSNorm(head_dim, eps=1e-6).to(device=device, dtype=dtype)
    norm.weight.data = 1 + _randn((head_dim,), seed + 1, dtype, device, scale=0.5)
    out, _ = fused_ops.fused_add_rms_norm(q, None, norm.weight, norm.eps)
    with torch_path():
        ref = norm(q)
    assert_ulps(out, ref, *_norm_tolerance(dtype, unit_weight=False), "per-head norm")


def check_rotary(device: str, dtype: torch.dtype, tokens: int, hq: int, hkv: int, head_dim: int) -> None:
    """RoPE of q and k taken as views of one fused qkv projection output, as the model does."""
    seed = tokens * 1009 + hq * 17 + hkv * 3 + head_dim
    rope = RotaryEmbedding(head_dim, MAX_POSITIONS, _default_inv_freq(500000.0, head_dim)).to(device)
    q_size, kv_size = hq * head_dim, hkv * head_dim
    qkv = _randn((tokens, q_size + 2 * kv_size), seed, dtype, device, scale=2.0)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(tokens, hq, head_dim), k.view(tokens, hkv, head_dim)  # non-contiguous along T
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=_gen(seed))
    positions[0] = MAX_POSITIONS - 1  # the table's last row
    positions = positions.to(device)
    before = qkv.clone()
    got_q, got_k = fused_ops.rotary(positions, q, k, rope.cos_cached, rope.sin_cached)
    with torch_path():
        ref_q, ref_k = rope(positions, q, k)
    assert torch.equal(qkv, before), "rotary wrote into its inputs"
    assert_ulps(got_q, ref_q.contiguous(), 0, 0.0, "rotated q")
    assert_ulps(got_k, ref_k.contiguous(), 0, 0.0, "rotated k")


def _assert_head_scale_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``got`` within a few ulps of each head's largest ``ref`` value (see the module docstring)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{what}: {got.shape}/{got.dtype} vs {ref.shape}/{ref.dtype}"
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    g, r = got.detach().float().cpu(), ref.detach().float().cpu()
    mantissa, ulps, max_share = {torch.float32: (23, 16, 1.0), torch.bfloat16: (7, 3, 0.02),
                                 torch.float16: (10, 3, 0.02)}[got.dtype]
    scale = r.abs().amax(-1, keepdim=True).clamp_min(2.0**-20)  # [T, H, 1]
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - mantissa)
    diff = (g - r).abs()
    worst, share = float((diff / ulp).max()), float((diff > 0).float().mean())
    assert worst <= ulps and share <= max_share, (
        f"{what}: max {worst:.1f} ulps of the head's scale (allowed {ulps}), {share:.2e} of elements differ "
        f"(allowed {max_share})")


def check_qk_norm_rotary(device: str, dtype: torch.dtype, tokens: int, hq: int, hkv: int, head_dim: int,
                         gemma: bool) -> None:
    """The per-head norms of q and k and RoPE in one launch, on views of one qkv row as the model
    has them: equal to the norm and rotary kernels bit for bit (Llama's norm), and to the torch
    path within the norm's flips (both norms)."""
    from loom.layers.norm import GemmaRMSNorm

    seed = tokens * 7919 + hq * 13 + hkv * 5 + head_dim + gemma
    rope = RotaryEmbedding(head_dim, MAX_POSITIONS, _default_inv_freq(1000000.0, head_dim)).to(device)
    q_size, kv_size = hq * head_dim, hkv * head_dim
    qkv = _randn((tokens, q_size + 2 * kv_size), seed, dtype, device, scale=3.0)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(tokens, hq, head_dim), k.view(tokens, hkv, head_dim)  # non-contiguous along T
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=_gen(seed))
    positions[0] = MAX_POSITIONS - 1
    positions = positions.to(device)
    norms = []
    for i in range(2):
        norm = (GemmaRMSNorm if gemma else RMSNorm)(head_dim, eps=1e-6 * (i + 1)).to(device=device, dtype=dtype)
        norm.weight.data = (0.0 if gemma else 1.0) + _randn((head_dim,), seed + 1 + i, dtype, device, scale=0.5)
        norms.append(norm)
    q_norm, k_norm = norms
    before = qkv.clone()
    got_q, got_k = fused_ops.qk_norm_rotary(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps,
                                            rope.cos_cached, rope.sin_cached, gemma)
    assert torch.equal(qkv, before), "qk_norm_rotary wrote into its inputs"
    if not gemma:  # the two kernels it replaces
        nq = fused_ops.fused_add_rms_norm(q, None, q_norm.weight, q_norm.eps)[0]
        nk = fused_ops.fused_add_rms_norm(k, None, k_norm.weight, k_norm.eps)[0]
        want_q, want_k = fused_ops.rotary(positions, nq, nk, rope.cos_cached, rope.sin_cached)
        assert_ulps(got_q, want_q, 0, 0.0, "q against the norm and rotary kernels")
        assert_ulps(got_k, want_k, 0, 0.0, "k against the norm and rotary kernels")
    with torch_path():
        ref_q, ref_k = rope(positions, q_norm(q), k_norm(k))
        layer_q, layer_k = rope.forward_with_qk_norm(positions, q, k, q_norm, k_norm)
    assert torch.equal(layer_q, ref_q) and torch.equal(layer_k, ref_k), "the layer's unfused path changed"
    _assert_head_scale_close(got_q, ref_q.contiguous(), "q against the torch path")
    _assert_head_scale_close(got_k, ref_k.contiguous(), "k against the torch path")


def check_combine_norm(device: str, dtype: torch.dtype, tokens: int, hidden: int, top_k: int,
                       weights_dtype: torch.dtype) -> None:
    """An MoE layer's expert rows summed with their routing weights inside the next residual add +
    norm (``fused_combine_add_rms_norm``): the same bits as the MoE combine kernel followed by
    ``fused_add_rms_norm``; the residual sum also the same bits as torch's combine and add."""
    from loom.layers.fused_moe_triton import combine_rows

    seed = tokens * 7 + hidden * 3 + top_k
    rows = _randn((tokens * top_k, hidden), seed, dtype, device)
    weights = torch.softmax(_randn((tokens, top_k), seed + 1, torch.float32, "cpu"), -1).to(weights_dtype).to(device)
    residual = _randn((tokens, hidden), seed + 2, dtype, device, scale=4.0)
    norm = RMSNorm(hidden, eps=1e-6).to(device=device, dtype=dtype)
    norm.weight.data = 1 + _randn((hidden,), seed + 3, dtype, device, scale=0.5)
    before = rows.clone()
    out, h = fused_ops.fused_combine_add_rms_norm(rows, weights, residual, norm.weight, norm.eps)
    assert torch.equal(rows, before), "the fused norm wrote into the expert rows"
    want_out, want_h = fused_ops.fused_add_rms_norm(combine_rows(rows, weights), residual, norm.weight, norm.eps)
    assert_ulps(h, want_h, 0, 0.0, "residual sum against combine + add")
    assert_ulps(out, want_out, 0, 0.0, "norm against combine + norm")
    with torch_path():  # torch's combine: each weighted row rounded, summed in float32 in j order
        acc = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
        for j in range(top_k):
            acc += (rows[j::top_k].float() * weights[:, j:j + 1].float()).to(dtype).float()
        ref_h = residual + acc.to(dtype)
        ref = norm(ref_h)
    assert_ulps(h, ref_h, 0, 0.0, "residual sum against torch")
    assert_ulps(out, ref, *_norm_tolerance(dtype, unit_weight=False), "norm against torch")


def check_silu_and_mul(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """``silu(gate) * up`` of a ``[..., 2*I]`` input; gates spread wide enough for both tails."""
    seed = sum(shape) * 13 + len(shape)
    x = _randn(shape, seed, dtype, device, scale=3.0)
    got = fused_ops.silu_and_mul(x)
    with torch_path():
        ref = SiluAndMul()(x)
    if device == "cpu":  # numpy's expf (interpreter) against torch's: see the module docstring
        max_ulps, share = (4, 1.0) if dtype == torch.float32 else (1, 1e-3)
    else:
        max_ulps, share = 0, 0.0
    assert_ulps(got, ref, max_ulps, share, "silu_and_mul")


def _assert_same_rows(codes: torch.Tensor, scales: torch.Tensor, dense: torch.Tensor,
                      how: RowQuantization, what: str) -> None:
    ref = quantized_input.quantize(dense, how)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == ref.codes.shape, what
    assert torch.equal(scales.cpu(), ref.scales.cpu()), f"{what}: scales differ"
    differ = int((codes.view(torch.uint8) != ref.codes.view(torch.uint8)).sum())
    assert differ == 0, f"{what}: {differ} of {codes.numel()} codes differ"


def check_quantized_input(device: str, dtype: torch.dtype, tokens: int, width: int, kind: str, static: bool) -> None:
    """The norm's (``kind`` "norm", with and without a residual) or SiLU-and-mul's (``kind`` "silu")
    output quantized in its own kernel, against the dense kernel's output quantized after it."""
    seed = tokens * 7_919 + width * 3 + static
    how = RowQuantization(torch.tensor([0.0173], device=device) if static else None)
    if kind == "silu":
        x = _randn((tokens, 2 * width), seed, dtype, device, scale=3.0)
        x[tokens // 2] = 0  # an all-zero row: the scale's floor
        codes, scales = fused_ops.silu_and_mul_quant(x, how.static_scale)
        _assert_same_rows(codes, scales, fused_ops.silu_and_mul(x), how, f"silu {tokens}x{width}")
        return
    x = _randn((tokens, width), seed, dtype, device) * torch.logspace(-3, 2, tokens, device=device).to(dtype)[:, None]
    weight = 1 + _randn((width,), seed + 2, dtype, device, scale=0.5)
    for residual in (None, _randn((tokens, width), seed + 1, dtype, device, scale=4.0)):
        codes, scales, h = fused_ops.fused_add_rms_norm_quant(x, residual, weight, 1e-6, how.static_scale)
        dense, ref_h = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
        assert torch.equal(h, ref_h), "residual sum"
        _assert_same_rows(codes, scales, dense, how, f"norm {tokens}x{width} residual {residual is not None}")


def quantized_input_cases(full: bool) -> list[tuple[torch.dtype, int, int, str, bool]]:
    """Norm and SiLU widths of SmolLM2 (its SiLU rows, 1,536, fit one 2,048-column block) and a SiLU
    row of 17,000 (two passes, a ragged last block), per-row and static scales; ``full`` (GPU) adds
    llama-8b's widths."""
    cases = [(dtype, t, w, kind, static) for dtype in (torch.bfloat16, torch.float16) for t in (1, 7)
             for kind, w in (("norm", 576), ("silu", 1536)) for static in (False, True)]
    cases += [(torch.bfloat16, 3, 17_000, "silu", False), (torch.float32, 5, 96, "norm", False)]
    if full:
        cases += [(torch.bfloat16, 300, 4096, "norm", False), (torch.bfloat16, 300, 14336, "silu", False),
                  (torch.bfloat16, 64, 28672, "silu", True)]
    return cases


def norm_cases(full: bool) -> list[tuple[torch.dtype, int, int, bool]]:
    """Every size at T = 1 and 7, and T = 64 at the largest; ``full``: every size at every T (the
    interpreter runs one program per row, sequentially, so it gets the short list)."""
    tokens = TOKENS if full else TOKENS[:2]
    return [(dtype, t, h, res) for dtype in (torch.float32, torch.bfloat16) for t in tokens
            for h in NORM_SIZES for res in (False, True)] + [
        (dtype, TOKENS[-1], NORM_SIZES[-1], True) for dtype in (torch.float32, torch.bfloat16) if not full] + [
        (torch.bfloat16, 3, 8192, True), (torch.float16, 7, 576, True)]


def head_norm_cases() -> list[tuple[torch.dtype, int, int, int]]:
    return [(dtype, t, 8, d) for dtype in (torch.float32, torch.bfloat16) for t in (1, 7) for d in (64, 128)]


def rotary_cases(full: bool) -> list[tuple[torch.dtype, int, int, int, int]]:
    """Every head layout at T = 1 and 7, and T = 64 for one; ``full``: all at every T."""
    tokens = TOKENS if full else TOKENS[:2]
    return [(dtype, t, hq, hkv, d) for dtype in (torch.float32, torch.bfloat16) for t in tokens
            for hq, hkv in ROPE_HEADS for d in (64, 128)] + [
        (dtype, TOKENS[-1], 8, 2, 128) for dtype in (torch.float32, torch.bfloat16) if not full] + [
        (torch.bfloat16, 7, 4, 2, 96), (torch.float16, 7, 8, 2, 128), (torch.bfloat16, 5, 32, 8, 128)]


def qk_norm_rotary_cases(full: bool) -> list[tuple[torch.dtype, int, int, int, int, bool]]:
    """(dtype, T, Hq, Hkv, D, gemma): Llama's norm in both dtypes at T = 1 and 7 for two head
    layouts and sizes, D = 96 (a half no power of two), fp16, Gemma's norm; ``full``: T = 64 too."""
    tokens = TOKENS if full else TOKENS[:2]
    return [(dtype, t, hq, hkv, d, False) for dtype in (torch.float32, torch.bfloat16) for t in tokens
            for hq, hkv in ROPE_HEADS[:2] for d in (64, 128)] + [
        (torch.bfloat16, 7, 4, 2, 96, False), (torch.float16, 7, 8, 2, 128, False),
        (torch.bfloat16, 7, 8, 4, 256, True), (torch.float32, 5, 4, 1, 128, True), (torch.bfloat16, 3, 6, 2, 96, True)]


def combine_norm_cases() -> list[tuple[torch.dtype, int, int, int, torch.dtype]]:
    """(dtype, T, H, k, weights dtype): Qwen3-MoE's bf16 weights and Mixtral's float32 ones."""
    return [(dtype, t, h, k, wd) for dtype in (torch.float32, torch.bfloat16) for t in (1, 7)
            for h, k in ((64, 2), (576, 8)) for wd in dict.fromkeys((dtype, torch.float32))] + [(torch.float16, 3, 2048, 8, torch.float16)]


def silu_cases() -> list[tuple[torch.dtype, tuple[int, ...]]]:
    return [(dtype, (t, 2 * i)) for dtype in (torch.float32, torch.bfloat16) for t in TOKENS
            for i in SILU_SIZES] + [(torch.float16, (7, 2 * 576)), (torch.bfloat16, (2, 3, 2 * 64))]


@contextlib.contextmanager
def count_launches() -> Iterator[dict[str, int]]:
    """Counts the calls the layers make into each fused kernel's launcher while active."""
    counts = {"fused_add_rms_norm": 0, "fused_combine_add_rms_norm": 0, "rotary": 0, "qk_norm_rotary": 0,
              "silu_and_mul": 0}
    originals = {name: getattr(fused_ops, name) for name in counts}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in counts:
        setattr(fused_ops, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(fused_ops, name, fn)


def check_model(device: str, model_dir: Path, registry: Any) -> None:
    """A tiny bf16 model's prefill logits with the fused kernels against the torch path.

    Both runs use the float32 reference attention, so only the fused ops differ; the kernels are
    bit-identical but for rare 1-ulp flips of the norm, which the logits absorb well within the
    tolerance. Also checks the layers really called every kernel.
    """
    from helpers.reference_attention import ModelHarness
    from loom.model_loader import load_model

    prompt = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300, 12]
    loaded = load_model(model_dir, torch.bfloat16, torch.device(device), registry)
    layers = int(loaded.hf_config.num_hidden_layers)

    def logits() -> torch.Tensor:
        return ModelHarness(loaded.model, loaded.hf_config, dtype=torch.bfloat16, device=device).prefill(prompt)

    with count_launches() as counts:
        got = logits()
    qk_norm = getattr(loaded.model.model.layers[0].self_attn, "q_norm", None) is not None
    assert counts == {"fused_add_rms_norm": 2 * layers + 1, "fused_combine_add_rms_norm": 0,
                      "rotary": 0 if qk_norm else layers, "qk_norm_rotary": layers if qk_norm else 0,
                      "silu_and_mul": layers}, counts
    with torch_path(), count_launches() as counts:
        ref = logits()
    assert sum(counts.values()) == 0, counts
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.02)
