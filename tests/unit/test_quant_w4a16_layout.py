"""The GPU kernels' packed layout (``loom_plugins.quant.w4a16_layout``) and its launch plans, on the
CPU: GPTQ (v1, act-order, 8-bit, per channel), AWQ and NF4 layers repack into it exactly (its
dequantization equals the checkpoint's, bit for bit), act-order becomes one permutation of the
inputs, and the plans depend on shapes only. The kernels themselves run in Triton's interpreter
(test_quant_triton_interpreter.py) and on a GPU (tests/gpu/test_quant_kernels_gpu.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import quant_layers as ql

from loom_plugins.quant import w4a16_layout as wl
from loom_plugins.quant.int_packing import pack_rows
from loom_plugins.quant.w4a16_triton import block_k_for, plan

K, PARTS = 256, [64, 32, 32]


def _layout(layer: Any, dtype: torch.dtype) -> wl.W4A16Layout:
    if hasattr(layer, "nf4_parts"):  # NF4: what process_weights_after_loading repacks on CUDA
        parts = [(getattr(layer, f"nf4_codes_{i}"), getattr(layer, f"nf4_absmax_{i}"), getattr(layer, f"nf4_table_{i}"),
                  bs, shape) for i, (bs, shape) in sorted(layer.nf4_parts.items())]
        return wl.from_nf4_parts(parts, dtype)
    layer.w4a16_dtype = dtype
    return layer.quant_method.to_layout(layer)


@pytest.mark.parametrize("scheme", [
    ql.gptq_scheme(32), ql.gptq_scheme(64, act_order=True), ql.gptq_scheme(-1, sym=False), ql.gptq_scheme(32, bits=8),
    ql.gptq_scheme(64, bits=2), ql.awq_scheme(32), ql.awq_scheme(64), ql.nf4_scheme(), ql.while_loading_scheme("nf4"),
    ql.while_loading_scheme("gptq"), ql.while_loading_scheme("awq"),
], ids=lambda s: s.name)
def test_repacked_layout_dequantizes_exactly_like_the_checkpoint(scheme: ql.Scheme) -> None:
    layer = ql.build_layer(scheme, K, PARTS, ql.dense_parts(K, PARTS, seed=1), "cpu", torch.float32)
    reference = layer.quant_method.dequantize(layer, torch.float32)  # the checkpoint's own path
    nf4 = scheme.name.startswith("nf4")
    # GPTQ / AWQ scales are fp16 and survive fp16 exactly; NF4's absmax is float32
    for dtype in (torch.float32,) if nf4 else (torch.float32, torch.float16):
        layout = _layout(layer, dtype)
        assert layout.dtype == dtype and layout.qweight.dtype == torch.int32
        assert layout.qweight.shape == (K * layout.bits // 32, sum(PARTS))
        assert torch.equal(layout.dequantize(torch.float32), reference)
    for dtype, unit in ((torch.bfloat16, 2**-8), *(((torch.float16, 2**-11),) if nf4 else ())):
        rounded = _layout(layer, dtype).dequantize(torch.float32)
        # a scale rounded to the activations' dtype moves each weight by at most its unit roundoff
        assert bool(((rounded - reference).abs() <= reference.abs() * unit).all())
        assert not torch.equal(rounded, reference)


def test_act_order_becomes_one_permutation_per_distinct_part() -> None:
    """Parts with the same g_idx share a segment (one launch); a part with its own order gets its own."""
    layer = ql.build_layer(ql.gptq_scheme(32, act_order=True), K, PARTS, ql.dense_parts(K, PARTS, seed=2), "cpu",
                           torch.float32)
    layout = _layout(layer, torch.float32)
    # quant_layers draws one order per part size: q (64 rows) has its own, k and v (32 rows) share one
    assert [(s.start, s.end) for s in layout.segments] == [(0, 64), (64, 128)]
    for seg in layout.segments:
        assert seg.perm is not None and sorted(seg.perm.tolist()) == list(range(K))
        part = 0 if seg.start == 0 else 1
        g_idx = layer.g_idx[part].long()
        assert torch.equal(g_idx[seg.perm.long()], torch.arange(K) // 32)  # groups contiguous in kernel order


def test_group_permutation() -> None:
    assert wl.group_permutation(torch.arange(12) // 4, 4, 3) is None  # already in order: nothing to gather
    g = torch.tensor([2, 0, 1, 0, 2, 1, 1, 0, 2, 2, 0, 1])
    perm = wl.group_permutation(g, 4, 3)
    assert perm is not None and torch.equal(g[perm.long()], torch.arange(12) // 4)
    with pytest.raises(wl.NotRepackable, match="do not each hold 4 inputs"):
        wl.group_permutation(torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]), 4, 3)


def test_nf4_blocks_that_straddle_rows_are_not_repacked() -> None:
    from loom_plugins.quant.nf4 import nf4_table, quantize_nf4

    packed, absmax = quantize_nf4(torch.randn(4, 96))  # 96 inputs: blocks of 64 cross rows
    with pytest.raises(wl.NotRepackable, match="do not tile each row"):
        wl.from_nf4_parts([(packed, absmax, nf4_table(), 64, (4, 96))], torch.float32)


def test_int32_packing_matches_the_checkpoint_packer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wl, "_SHIFT_CHUNK", 64)  # several chunks
    g = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        values = torch.randint(0, 1 << bits, (256, 40), generator=g)
        assert torch.equal(wl.pack_rows_int32(values, bits), pack_rows(values, bits))


@pytest.mark.parametrize(("n", "k", "group"), [(6144, 4096, 128), (4096, 14336, 128), (28672, 4096, 64),
                                               (576, 1536, 32), (192, 576, -1)])
def test_plans_depend_on_shapes_and_cover_k(n: int, k: int, group: int) -> None:
    gs = k if group == -1 else group
    sms = 132
    for m in (1, 2, 7, 16, 32, 33, 64, 300, 1023):
        # NF4's codes: the general GEMV at one token; float32 activations: the plain tiled GEMM
        p = plan(m, n, k, gs, sms, 1024, table=True, act16=False)
        assert p.kind == ("gemv" if m == 1 else "gemm")
        wide = m > 128  # 256-row tiles, 64 deep, about two programs an SM (_wide_gemm_plan)
        assert p.block_k == (min(64, block_k_for(gs)) if m == 1 or wide else block_k_for(gs))
        assert p.k_split % p.block_k == 0
        assert (p.split - 1) * p.k_split < k <= p.split * p.k_split  # every split has inputs, all are covered
        tiles = -(-n // p.block_n) * (1 if m == 1 else -(-m // p.block_m))
        # enough programs for the GPU, unless K ran out of blocks to split
        target = (15 * sms) // 8 if wide else 4 * sms
        assert tiles * p.split >= target or p.split * 2 > min(16, -(-k // p.block_k))
        if wide:  # the fewest splits that reach it
            assert p.split == 1 or tiles * (p.split // 2) < target
        assert plan(m, n, k, gs, sms, 1024, table=True, act16=False) is p  # cached: no work per call
        if m > 1:
            assert plan(m, n, k, gs, sms, 1024, act16=False) == p  # integer codes: the same GEMM plans
    assert plan(1024, n, k, gs, sms, 1024).kind == "dense"
    assert gs % block_k_for(gs) == 0 or block_k_for(gs) == 64
    p = plan(1, n, k, gs, sms, 1024)  # integer codes: the integer-code GEMV's plan
    assert (p.kind, p.block_n, p.block_k) == ("gemv", 64, min(128, block_k_for(gs)))
    assert (p.split - 1) * p.k_split < k <= p.split * p.k_split and p.k_split % p.block_k == 0
    # splits of 512 inputs, shorter only while the grid is small, down to one tile, up to 32 splits
    assert p.split <= 32
    assert (p.k_split >= 512 or -(-n // 64) * p.split >= 4 * sms or p.k_split == p.block_k
            or -(-k // (p.k_split // 2)) > 32)


@pytest.mark.parametrize(("n", "k", "group"), [(6144, 4096, 128), (4096, 14336, 128), (28672, 4096, 64),
                                               (576, 1536, 32), (192, 576, -1)])
def test_transposed_gemm_plans_of_16_bit_activations(n: int, k: int, group: int) -> None:
    """From 2 tokens, 16-bit activations take the transposed GEMM (_gemm_t_kernel), NF4 or
    integer codes alike: 64 weight rows by the smallest power of two from 16 tokens that holds
    the batch, 64 deep, K in pieces of about 1,024 inputs (a power of two of them, at most 16;
    down to ~512 at 16 tokens or fewer while the grid is under 3 programs an SM), fewer where the
    float32 partial sums would pass 36 MB, and for integer codes (the packed tile) from 128 tokens
    fewer where the grid would pass 4 programs an SM counted in 128-row tiles; from 129 tokens
    (DENSE_FROM_TOKENS' default) the dense path."""
    gs = k if group == -1 else group
    sms = 132
    for m in (2, 7, 16, 17, 64, 65, 128, 129, 256, 300, 1023):
        for table in (False, True):
            p = plan(m, n, k, gs, sms, 1024, table=table)
            assert (p.kind, p.block_n, p.num_warps) == ("gemm_t", 64, 4)
            assert p.block_m == min(256, max(16, 1 << (m - 1).bit_length())) and p.block_m >= min(m, 256)
            assert p.num_stages == (4 if p.block_m <= 64 else 3)
            assert p.block_k == min(64, block_k_for(gs)) and p.k_split % p.block_k == 0
            assert (p.split - 1) * p.k_split < k <= p.split * p.k_split
            assert p.split == 1 or p.split * m * n * 4 <= 36 << 20  # the partial sums stay in L2
            if not table and p.block_m >= 128:  # the packed tile: at most ~4 programs an SM of 128 rows
                assert p.split == 1 or p.split * -(-n // 64) * (p.block_m // 128) <= 4 * sms
            assert p.split == 1 or k / p.split >= (384 / 2 if m <= 16 else 768 / 2)  # pieces ~1,024 (~512)
            if m <= 16 and p.split > 1 and k / p.split < 768:  # shorter pieces only for a small grid
                assert -(-n // 64) * p.split // 2 < 3 * sms
            assert plan(m, n, k, gs, sms, 129, table=table).kind == ("dense" if m >= 129 else "gemm_t")
    assert plan(1024, n, k, gs, sms, 1024).kind == "dense"


def test_the_transposed_gemm_plans_on_llama_8b() -> None:
    """The K splits the rule gives llama-8b's four layer shapes (qkv, o, gate_up, down; group 128)
    from 2 to 256 tokens: those of the fastest 64-deep plans of the session-31 sweep at 16 and 64
    tokens (bench/results/gpu-w4a16-plans-gemm-t-h100-s31.json) and, with the packed tile, of the
    sweeps of sessions 42 and 45 at 128 and 256 (bench/results/gpu-w4a16-plans-packed-h100-s4{2,5}.json).
    NF4's codes (a table: the float32 tile) keep the splits the session-31 sweep chose at 128."""
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    expected = {2: [8, 8, 4, 16], 16: [8, 8, 4, 16], 64: [4, 4, 4, 16], 128: [4, 4, 1, 8], 256: [2, 4, 1, 4]}
    for m, splits in expected.items():
        assert [plan(m, n, k, 128, 132, 1024).split for n, k in shapes] == splits, m
    assert [plan(128, n, k, 128, 132, 1024, table=True).split for n, k in shapes] == [4, 4, 2, 16]


@pytest.mark.parametrize(("n", "k", "split"), [(6144, 4096, 4), (4096, 4096, 4), (28672, 4096, 1), (4096, 14336, 4)])
def test_the_wide_gemm_plans_are_the_ones_measured_fastest_on_llama_8b(n: int, k: int, split: int) -> None:
    """bench/results/gpu-w4a16-plans-m16-256.json (H200, 2026-12-03): at 256 tokens (group 128)
    256 x 64 tiles, 64 deep, 4 warps, 3 stages with these splits measured within 1% of each
    shape's fastest plan, 1.5-2.4x faster than the 128 x 128 plan before."""
    for m in (129, 192, 256):
        p = plan(m, n, k, 128, 132, 1024, act16=False)  # the plain GEMM's (float32 activations since)
        assert (p.kind, p.block_m, p.block_n, p.block_k, p.num_warps, p.num_stages) == ("gemm", 256, 64, 64, 4, 3)
        assert p.split == split


@pytest.mark.parametrize(("n", "k", "split"), [(6144, 4096, 8), (4096, 4096, 16), (28672, 4096, 8), (4096, 14336, 28)])
def test_the_integer_code_gemv_plans_are_the_fastest_measured_on_llama_8b(n: int, k: int, split: int) -> None:
    """bench/results/gpu-w4a16-plans-m1-int.json (H200, 2026-12-03): the fastest plan of each of
    llama-8b's layer shapes at one token (group 128) was 64 x 128 tiles with these splits."""
    p = plan(1, n, k, 128, 132, 1024)
    assert (p.block_n, p.block_k, p.split, p.k_split) == (64, 128, split, -(-k // split // 128) * 128)


def test_a_rank_slice_of_act_order_inputs_repacks_when_it_holds_whole_groups() -> None:
    """A row-parallel rank's act-order slice: its g_idx names global groups and it keeps every
    group's scales. Whole groups (here 4 to 7, shuffled within the rank) repack with those groups'
    scales; groups scattered over ranks (parts of groups) keep the dequantizing path."""
    g = torch.Generator().manual_seed(3)
    k_all, n, gs, bits = 256, 48, 32, 4
    groups = k_all // gs
    codes = torch.randint(0, 16, (k_all, n), generator=g)
    zeros = torch.randint(0, 16, (groups, n))
    scales = (torch.rand(groups, n, generator=g) + 0.5).half()
    order = torch.cat([torch.randperm(128, generator=g), 128 + torch.randperm(128, generator=g)])
    g_idx = (order // gs).to(torch.int32)  # every group within one half of the inputs
    rank = slice(128, 256)  # rank 1 of 2
    reference = ((codes[rank] - zeros[g_idx[rank].long()]).float()
                 * scales[g_idx[rank].long()].float()).t()  # W [N, K / 2]
    layout = wl.from_int_codes(codes[rank], zeros, scales, bits, gs, [n], g_idx[rank].unsqueeze(0), torch.float32)
    assert layout.in_features == 128 and layout.scales.shape == (4, n)  # groups 4..7 only
    assert torch.equal(layout.dequantize(torch.float32), reference)
    scattered = (torch.randperm(k_all, generator=g) // gs).to(torch.int32)  # groups across both halves
    with pytest.raises(wl.NotRepackable, match="hold parts of act-order groups"):
        wl.from_int_codes(codes[rank], zeros, scales, bits, gs, [n], scattered[rank].unsqueeze(0), torch.float32)
