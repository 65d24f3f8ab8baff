"""The quantizers' Triton kernels on the CPU, through Triton's interpreter.

Run as a script in its own process (``TRITON_INTERPRET`` must be set before the kernels are
defined, and must not leak into a process that compiles them for a GPU); prints one line per
case and exits non-zero on a failure. ``tests/unit/test_quant_triton_interpreter.py`` runs it.

- W4A16 (``w4a16_triton``): the GEMV (one token), the tiled GEMM with split-K, and the
  dequantize-then-matmul path, on small layouts of integer codes (GPTQ / AWQ) and NF4 tables,
  with act-order permutations, fused segments, 2-, 4- and 8-bit codes, a bias, and group sizes
  inside / across / not aligned with the K tiles; against the layout's torch dequantization,
  within the bound ``|y - ref| <= (2u + K 2^-24) (|x| @ |W|^T) + u |ref|`` (u: the unit roundoff
  of the activations' dtype: the dequantized weight is rounded once, its bf16 scale once, the
  output once; float32 accumulation).
- FP8 (``fp8_triton.quantize_rows``): codes and scales bit for bit equal to the CPU emulation.

bf16 GEMM cases are left to the GPU tests: the interpreter of triton 3.6 computes bf16 dots
wrongly (numpy has no bf16); the bf16 GEMV and dequantizing kernels are covered here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()


def int_layout(k: int, n: int, group: int, bits: int, parts: list[int], act_order: bool, dtype: Any,
               seed: int) -> Any:
    import torch

    from loom_plugins.quant import w4a16_layout as wl

    g = torch.Generator().manual_seed(seed)
    gs = k if group == -1 else group
    maxq = (1 << bits) - 1
    codes = torch.randint(0, maxq + 1, (k, n), generator=g, dtype=torch.int32)
    groups = -(-k // gs)  # a ragged last group when gs does not divide k (as GPTQ's g_idx allows)
    zeros = torch.randint(0, maxq + 1, (groups, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=g) * 0.01 + 0.001).half()
    g_idx = None
    if act_order:  # one order per part (distinct): one segment each
        g_idx = torch.stack([torch.randperm(k, generator=g) // gs for _ in parts]).to(torch.int32)
    return wl.from_int_codes(codes, zeros, scales, bits, group, parts, g_idx, dtype)


def nf4_layout(k: int, parts: list[int], distinct_tables: bool, dtype: Any, seed: int) -> Any:
    import torch

    from loom_plugins.quant import w4a16_layout as wl
    from loom_plugins.quant.nf4 import nf4_table, quantize_nf4

    g = torch.Generator().manual_seed(seed)
    made = []
    for i, rows in enumerate(parts):
        packed, absmax = quantize_nf4(torch.randn(rows, k, generator=g))
        table = nf4_table() * (1.0 + 0.25 * i if distinct_tables else 1.0)
        made.append((packed, absmax, table, 64, (rows, k)))
    return wl.from_nf4_parts(made, dtype)


def check_w4a16(label: str, layout: Any, m: int, dtype: Any, bias: bool, dense: bool, seed: int,
                dense_from: int | None = None) -> bool:
    """``dense``: the dequantize-then-matmul path at any M; else the fused kernels up to
    ``dense_from`` tokens (``DENSE_FROM_TOKENS`` when None)."""
    import torch

    from loom_plugins.quant import w4a16_triton as wt

    g = torch.Generator().manual_seed(seed)
    k, n = layout.in_features, layout.out_features
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    until = 1 if dense else wt.DENSE_FROM_TOKENS if dense_from is None else dense_from
    p = wt.plan(m, n, k, layout.group_size, wt.sm_count(x.device), until, wt.uses_table(layout), dtype != torch.float32)
    y = wt.w4a16_linear(x, layout, b, dense_from=until)
    w = layout.dequantize(torch.float32).double()  # [N, K], the torch path of the same layout
    ref = x.double() @ w.t() + (b.double() if b is not None else 0.0)
    s = x.double().abs() @ w.abs().t()
    u = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    bound = (2 * u + k * 2.0**-24) * s + u * ref.abs() + 1e-30
    err = (y.double() - ref).abs()
    ok = y.shape == (m, n) and y.dtype == dtype and bool((err <= bound).all())
    kind = "gemv-int" if p.kind == "gemv" and all(wt._int_gemv(layout, seg, p) for seg in layout.segments) else p.kind
    print(f"{'ok  ' if ok else 'FAIL'} {label}: {kind} split {p.split} segments {len(layout.segments)}, "
          f"max err / bound {float((err / bound).max()):.3f}", flush=True)
    return ok


def check_fp8_rows(dtype: Any, m: int, k: int, static: bool, seed: int) -> bool:
    import torch

    from loom_plugins.quant.fp8 import fake_quantize_activations, quantize_fp8
    from loom_plugins.quant.fp8_triton import quantize_rows

    g = torch.Generator().manual_seed(seed)
    # rows from tiny to large magnitudes, one all-zero row, values in e4m3's subnormal range
    x = (torch.randn(m, k, generator=g) * torch.logspace(-4, 3, m).unsqueeze(1)).to(dtype)
    x[m // 2] = 0
    scale_in = torch.tensor([0.0173], dtype=torch.float32) if static else None
    q, scales = quantize_rows(x, scale_in)
    xf = x.float()
    expected_scale = scale_in.expand(m, 1) if scale_in is not None else \
        (xf.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    expected = quantize_fp8(xf, expected_scale)
    ok = (torch.equal(scales, expected_scale) and torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
          and torch.equal((q.float() * scales).to(dtype), fake_quantize_activations(x, scale_in)))
    print(f"{'ok  ' if ok else 'FAIL'} fp8 rows {dtype} {m}x{k} {'static' if static else 'dynamic'}", flush=True)
    return ok


def main() -> int:
    _setup()
    import torch

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    results = [
        check_w4a16("gptq g32 fp32 M=1", int_layout(128, 64, 32, 4, [64], False, f32, 0), 1, f32, False, False, 0),
        check_w4a16("gptq g64 bf16 M=1 bias", int_layout(256, 96, 64, 4, [96], False, bf16, 1), 1, bf16, True,
                    False, 1),
        check_w4a16("gptq g32 fp16 M=3", int_layout(128, 64, 32, 4, [64], False, f16, 2), 3, f16, False, False, 2),
        check_w4a16("act-order 2 parts fp32 M=5 bias", int_layout(256, 96, 128, 4, [64, 32], True, f32, 3), 5, f32,
                    True, False, 3),
        check_w4a16("act-order fp16 M=1", int_layout(256, 64, 64, 4, [32, 32], True, f16, 4), 1, f16, False, False,
                    4),
        check_w4a16("8-bit g64 fp16 M=1 bias", int_layout(256, 96, 64, 8, [96], False, f16, 5), 1, f16, True, False,
                    5),
        check_w4a16("2-bit g32 fp32 M=20", int_layout(256, 64, 32, 2, [64], False, f32, 6), 20, f32, False, False, 6),
        # a large decode batch with the dense path moved up (LOOM_W4A16_DENSE_FROM): the transposed
        # GEMM's 256-token tiles, with act-order and a bias (fp16: the interpreter computes bf16
        # GEMM tiles wrongly, for every plan, so no GEMM check is bf16)
        check_w4a16("gemm_t 256-token tiles act-order fp16 M=130 bias",
                    int_layout(256, 128, 64, 4, [64, 64], True, f16, 20), 130, f16, True, False, 20, dense_from=1024),
        check_w4a16("dense from 129 act-order fp16 M=130 bias", int_layout(256, 128, 64, 4, [64, 64], True, f16, 20),
                    130, f16, True, False, 20, dense_from=129),
        # the transposed GEMM (_gemm_t_kernel, 16-bit activations from 2 tokens): integer codes
        # (the magic-number tiles) with split K, 8 bits, per channel, a ragged last group; NF4's
        # table and groups across the K tile (the general tile)
        check_w4a16("wide tiles fp32 M=130", int_layout(128, 64, 64, 4, [64], False, f32, 28), 130, f32, False,
                    False, 28, dense_from=1024),
        check_w4a16("gemm_t g64 fp16 M=2 split bias", int_layout(512, 64, 64, 4, [64], False, f16, 22), 2, f16, True,
                    False, 22),
        check_w4a16("gemm_t g128 act-order fp16 M=33 split bias",
                    int_layout(1024, 64, 128, 4, [32, 32], True, f16, 29), 33, f16, True, False, 29),
        check_w4a16("gemm_t 8-bit g64 fp16 M=40", int_layout(256, 96, 64, 8, [64, 32], False, f16, 23), 40, f16,
                    False, False, 23),
        check_w4a16("gemm_t per channel fp16 M=17", int_layout(192, 64, -1, 4, [64], False, f16, 24), 17, f16,
                    False, False, 24),
        check_w4a16("gemm_t ragged last group g64 fp16 M=5", int_layout(200, 64, 64, 4, [64], False, f16, 25), 5,
                    f16, True, False, 25),
        check_w4a16("gemm_t nf4 fp16 M=9", nf4_layout(128, [32, 32], True, f16, 26), 9, f16, False, False, 26),
        check_w4a16("gemm_t group 24 fp16 M=3", int_layout(120, 64, 24, 4, [64], False, f16, 27), 3, f16, False,
                    False, 27),
        check_w4a16("per channel fp32 M=2", int_layout(192, 64, -1, 4, [64], False, f32, 7), 2, f32, True, False, 7),
        check_w4a16("group 24 (not a tile) fp32 M=2", int_layout(120, 64, 24, 4, [64], False, f32, 8), 2, f32, False,
                    False, 8),
        check_w4a16("group 24 (not a tile) bf16 M=1", int_layout(120, 64, 24, 4, [64], False, bf16, 9), 1, bf16,
                    False, False, 9),
        # the integer-code GEMV (_gemv_int_kernel): per channel, 2 bits, a ragged last group (K not a
        # multiple of the K tile: masked rows), bf16 pairs with and without act-order, split K
        check_w4a16("per channel fp32 M=1", int_layout(192, 64, -1, 4, [64], False, f32, 15), 1, f32, False, False,
                    15),
        check_w4a16("per channel bf16 M=1 bias", int_layout(256, 80, -1, 4, [80], False, bf16, 16), 1, bf16, True,
                    False, 16),
        check_w4a16("2-bit g32 bf16 M=1", int_layout(256, 64, 32, 2, [64], False, bf16, 17), 1, bf16, False, False,
                    17),
        check_w4a16("ragged last group g64 bf16 M=1", int_layout(200, 64, 64, 4, [64], False, bf16, 18), 1, bf16,
                    True, False, 18),
        check_w4a16("ragged last group g64 fp16 M=1", int_layout(200, 64, 64, 8, [64], False, f16, 19), 1, f16,
                    False, False, 19),
        check_w4a16("act-order bf16 M=1", int_layout(256, 64, 64, 4, [32, 32], True, bf16, 20), 1, bf16, True, False,
                    20),
        check_w4a16("8-bit g128 bf16 M=1 long K", int_layout(1024, 48, 128, 8, [48], False, bf16, 21), 1, bf16,
                    False, False, 21),
        check_w4a16("nf4 2 tables fp32 M=17", nf4_layout(128, [32, 32], True, f32, 10), 17, f32, False, False, 10),
        check_w4a16("nf4 fp16 M=1", nf4_layout(128, [64], False, f16, 11), 1, f16, False, False, 11),
        check_w4a16("nf4 bf16 M=1 bias", nf4_layout(192, [32, 32], False, bf16, 12), 1, bf16, True, False, 12),
        check_w4a16("dense path act-order fp16 M=4", int_layout(128, 64, 32, 4, [32, 32], True, f16, 13), 4, f16,
                    True, True, 13),
        check_w4a16("dense path nf4 bf16 M=3", nf4_layout(128, [32, 32], True, bf16, 14), 3, bf16, False, True, 14),
        check_fp8_rows(f32, 6, 300, False, 0),
        check_fp8_rows(bf16, 5, 5000, False, 1),  # two BLOCK-long passes per row
        check_fp8_rows(f16, 4, 64, False, 2),
        check_fp8_rows(bf16, 3, 96, True, 3),
    ]
    print(f"{sum(results)} of {len(results)} cases passed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
