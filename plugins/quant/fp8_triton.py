"""FP8 on the GPU: ``torch._scaled_mm`` (cuBLASLt's e4m3 GEMM) with the activations quantized by one
Triton kernel.

Activations: :func:`quantize_rows` reads each row of ``x`` once for its max |x| (dynamic
scales) and once more to write ``x / scale`` rounded to e4m3 (saturating at 448), and writes the
row's scale: one launch where plain torch takes half a dozen (abs, amax, divide, clamp, divide,
cast), which together cost as much as the FP8 GEMM itself at small batch. With a static
(checkpoint) scale the first pass is skipped. The division is IEEE (``div_rn``), so codes and
scales are those of :func:`fp8.fake_quantize_activations` bit for bit.

GEMM forms, probed once per device and dtype at load (:func:`rowwise_supported`):

- row-wise: one scale per token times one per output channel, applied by cuBLASLt's epilogue
  (per-tensor weight scales of a fused layer's parts are one per channel too: no requantizing);
- per tensor: when row-wise scales are not supported, a layer whose weight scale is one number
  and whose activations have a static scale runs ``_scaled_mm`` with both scalars; other layers
  multiply with unit scales into float32 and scale the product (one elementwise pass).

All launches depend on shapes only: capturable in CUDA graphs.
"""

# mypy: disable-error-code="no-untyped-def"
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from loom import kernel_switches
from loom.layers.triton_jit import jit as _jit
from loom.layers.triton_jit import pdl_launch, pdl_prologue
from loom.plugin_api.quantization import QuantizedRows

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

FP8_MAX = 448.0
_TINY = 1e-12
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first GPUs with e4m3 tensor cores



@_jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, K, stride_xm,
                          STATIC: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    # One program per row: its scale (max |x| / 448, or the static one), then the e4m3 codes.
    if USE_PDL:  # x comes from the kernel before
        pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), 1e-12)  # FP8_MAX, _TINY
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]`` contiguous, float32 scales ``[M, 1]``): per row (per token)
    ``scale = max(max|x| / 448, 1e-12)``, or ``static_scale`` (a one-element float32 tensor) for
    every row; codes ``clamp(x / scale, -448, 448)`` rounded to nearest even."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, triton.next_power_of_2(k))
        _quantize_rows_kernel[(m,)](x, q, scales, static_scale if static_scale is not None else scales, k,
                                    x.stride(0), STATIC=static_scale is not None, BLOCK=block,
                                    num_warps=4 if block <= 1024 else 8, **pdl_launch(x.device))
    return q, scales


def capability_reason(device: torch.device | None = None) -> str | None:
    """Why this CUDA device cannot run FP8 matmuls (None when it can)."""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) >= MIN_CAPABILITY:
        return None
    name = torch.cuda.get_device_name(index)
    return (f"FP8 matmul needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper or newer); "
            f"GPU {index} ({name}) is {major}.{minor}")


@functools.cache
def rowwise_supported(device_index: int, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` takes per-row x per-column scales with ``dtype`` output on this
    device (and gets them right): tried once on a small product, per device and dtype."""
    device = torch.device("cuda", device_index)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(32, 64, device=device, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(48, 64, device=device, generator=g).to(torch.float8_e4m3fn)
    sa = torch.rand(32, 1, device=device, generator=g) + 0.5
    sb = torch.rand(1, 48, device=device, generator=g) + 0.5
    try:
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=dtype)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    expected = (a.float() @ b.float().t()) * sa * sb
    return bool(torch.allclose(out.float(), expected, rtol=2e-2, atol=1e-2))


@dataclass
class FP8GpuWeights:
    """What the FP8 GEMM needs of a layer, prepared at load (tensors are the layer's buffers)."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn (its transpose is the column-major operand)
    scale_row: torch.Tensor  # [1, N] float32: each output channel's weight scale
    scale_scalar: torch.Tensor | None  # [] float32 when the whole weight has one scale
    input_scale: torch.Tensor | None  # [1] float32 static activation scale; None: per token
    rowwise: bool
    out_dtype: torch.dtype

    @property
    def scale_vector(self) -> torch.Tensor:
        """``scale_row`` as ``[N]`` (a view): the weight-only GEMV's per-channel scales."""
        return self.scale_row.view(-1)

    @property
    def shapes_ok(self) -> bool:
        n, k = self.weight.shape
        return n % 16 == 0 and k % 16 == 0  # cuBLASLt's FP8 operand alignment


def prepare(layer: Any, weight: torch.Tensor, channel_scale: torch.Tensor, input_scale: torch.Tensor | None,
            dtype: torch.dtype) -> FP8GpuWeights:
    """Build (and attach as ``layer.fp8_gpu``) the GEMM's operands: ``channel_scale`` ``[N]`` the
    weight scale of each output channel, ``input_scale`` a static activation scale or None.
    Reads the scales once on the host (load time) to find a single per-tensor scale."""
    device = weight.device
    row = channel_scale.float().reshape(1, -1).contiguous()
    single = row[0, :1].reshape(()).clone() if bool((row == row[0, 0]).all()) else None
    static = input_scale.float().reshape(1).contiguous() if input_scale is not None else None
    state = FP8GpuWeights(weight=weight.contiguous(), scale_row=row, scale_scalar=single, input_scale=static,
                          rowwise=rowwise_supported(device.index or 0, dtype), out_dtype=dtype)
    layer.register_buffer("fp8_scale_row", row)
    if static is not None:
        layer.register_buffer("fp8_input_scale", static)
    layer.__dict__["fp8_gpu"] = state
    return state


def fp8_linear(x: torch.Tensor, state: FP8GpuWeights, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` with W8A8: the activations quantized per token (or with the
    static scale), the product in e4m3 with float32 accumulation, in ``x``'s dtype."""
    n, k = state.weight.shape
    lead = x.shape[:-1]
    xq, xs = quantize_rows(x.reshape(-1, k), state.input_scale)
    return _scaled_mm_rows(xq, xs, state, x.dtype, bias).view(*lead, n)


def fp8_linear_quantized(x: QuantizedRows, state: FP8GpuWeights, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`fp8_linear` of rows its producer quantized already (as :func:`quantize_rows` does):
    ``[T, N]``."""
    return _scaled_mm_rows(x.codes, x.scales, state, x.dtype, bias)


def _scaled_mm_rows(xq: torch.Tensor, xs: torch.Tensor, state: FP8GpuWeights, dtype: torch.dtype,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``xq [T, K]`` e4m3 with scales ``xs [T, 1]`` times the layer's weight: ``[T, N]`` in ``dtype``."""
    w = state.weight.t()  # [K, N] column-major
    fast = kernel_switches.fp8_fast_accum
    if state.rowwise:
        y = torch._scaled_mm(xq, w, scale_a=xs, scale_b=state.scale_row, out_dtype=dtype, use_fast_accum=fast)
    elif state.scale_scalar is not None and state.input_scale is not None:
        y = torch._scaled_mm(xq, w, scale_a=state.input_scale, scale_b=state.scale_scalar, out_dtype=dtype,
                             use_fast_accum=fast)
    else:
        one = torch.ones((), dtype=torch.float32, device=xq.device)
        y = (torch._scaled_mm(xq, w, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
             * xs * state.scale_row)
        y = y.to(dtype)
    if bias is not None:
        y = y + bias
    return y
