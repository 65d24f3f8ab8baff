"""The fused MoE layer's Triton kernels on a CUDA GPU against the torch path, and inside a CUDA graph.

Tolerances (stated per dtype): both paths are compared with a float32 computation of the same
routing on the same (rounded) weights. float32: the kernels run IEEE dots, so the outputs agree
to float32 rounding (``atol = rtol = 1e-4``; the gate/up/down chain sums a few hundred products).
bf16 / fp16: the relative error of the whole output (norm of the difference / norm of the
reference) stays under ``1.5e-2`` (bf16) / ``4e-3`` (fp16): a few half-precision roundings of
each intermediate (about 0.4% for bf16), as the torch path has too, which is checked against
the same bound.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from helpers.call_counter import CallCounter, require_router_merge_plan
from helpers.moe_interpret_check import expected_layout

from loom.layers import moe_routing_triton
from loom.layers.fused_moe import SparseMoeBlock, fused_experts_torch, select_experts
from loom.layers.fused_moe_triton import MoeBlockConfig, block_config, fused_experts_triton
from loom.layers.moe_routing_triton import (
    align_rows_by_expert,
    fused_route_supported,
    num_blocks_bound,
    route,
    route_and_sort,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
REL_NORM = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3}

# (name, hidden, intermediate, experts, top-k)
SHAPES = [
    ("qwen3-30b-a3b", 2048, 768, 128, 8),
    ("mixtral-like", 1024, 1792, 8, 2),
    ("ragged", 320, 200, 12, 3),  # no dimension a multiple of the tiles
]


def _inputs(t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype,
            seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(t, h, device=CUDA, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, device=CUDA, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, device=CUDA, generator=gen) / inter**0.5).to(dtype)
    weights, ids = select_experts(torch.randn(t, e, device=CUDA, generator=gen), k, renormalize=True)
    return x, w13, w2, weights, ids


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(("name", "h", "inter", "e", "k"), SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("t", [1, 7, 64, 513])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_triton_experts_match_the_torch_path(name: str, h: int, inter: int, e: int, k: int, t: int,
                                              dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids = _inputs(t, h, inter, e, k, dtype, seed=t * 7 + e)
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids)  # float32 on the same weights
    got = fused_experts_triton(x, w13, w2, weights, ids)
    torch_path = fused_experts_torch(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    assert got.shape == x.shape and got.dtype == dtype and torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        return
    assert _rel(got, ref) < REL_NORM[dtype], f"Triton: {_rel(got, ref):.2e}"
    assert _rel(torch_path, ref) < REL_NORM[dtype], f"torch: {_rel(torch_path, ref):.2e}"


@pytest.mark.parametrize(("t", "k", "e", "block_m"), [(1, 8, 128, 16), (37, 2, 8, 16), (300, 8, 128, 64),
                                                      (4096, 8, 128, 64)])
def test_sort_by_expert_on_the_gpu(t: int, k: int, e: int, block_m: int) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(t)
    ids = torch.rand(t, e, device=CUDA, generator=gen).topk(k, dim=-1).indices
    sorted_ids, block_expert, num_padded = align_rows_by_expert(ids, e, block_m)
    want_ids, want_blocks = expected_layout(ids.tolist(), e, block_m)
    total = int(num_padded.item())
    assert total == len(want_ids) and block_expert.shape[0] == num_blocks_bound(t * k, e, block_m)
    assert sorted_ids[:total].tolist() == want_ids
    assert block_expert[: total // block_m].tolist() == want_blocks


@pytest.mark.parametrize(("t", "e", "k", "renormalize", "dtype"), [
    (1, 128, 8, True, torch.bfloat16), (300, 128, 8, True, torch.bfloat16), (33, 8, 2, True, torch.float32),
    (9, 60, 4, False, torch.float16)])
def test_routing_kernel_chooses_the_torch_paths_experts(t: int, e: int, k: int, renormalize: bool,
                                                          dtype: torch.dtype) -> None:
    """``select_experts`` on CUDA (one Triton launch) against its torch path on the CPU: distinct
    logits, so the same experts in the same order; the weights within the exp's rounding."""
    gen = torch.Generator().manual_seed(t)
    logits = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).float().mul(2.0**-4).to(dtype)
    wdtype = None if dtype == torch.float32 else dtype
    want_w, want_ids = select_experts(logits, k, renormalize, wdtype)
    got_w, got_ids = select_experts(logits.to(CUDA), k, renormalize, wdtype)
    assert got_ids.dtype == torch.int32 and torch.equal(got_ids.cpu().long(), want_ids)
    tol = 1e-6 if wdtype is None else 2.0**-7
    torch.testing.assert_close(got_w.cpu().float(), want_w.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("e", "k", "dtype", "wdtype"), [(128, 8, torch.bfloat16, torch.bfloat16),
                                                       (8, 2, torch.float32, None), (60, 4, torch.float16, torch.float16)])
@pytest.mark.parametrize("logits", ["normal", "ties"])
def test_routing_and_sort_in_one_launch_equal_the_three_launches(e: int, k: int, dtype: torch.dtype,
                                                                  wdtype: torch.dtype | None, logits: str) -> None:
    """``route_and_sort`` (decode sizes) against ``route`` + ``align_rows_by_expert`` on the GPU:
    the same weights bit for bit (one routing tile, reduced in the same layouts), ids and layout."""
    for t in range(1, 9):
        gen = torch.Generator(device=CUDA).manual_seed(t * 31 + e)
        if logits == "normal":
            x = torch.randn(t, e, device=CUDA, generator=gen)
        else:
            x = torch.randint(0, 6, (t, e), device=CUDA, generator=gen).float() * 0.5
        x = x.to(dtype)
        assert fused_route_supported(x, k)
        want_w, want_ids = route(x, k, True, wdtype)
        want_sorted, want_blocks, want_total = align_rows_by_expert(want_ids, e, 16)
        got_w, got_ids, layout = route_and_sort(x, k, True, 16, wdtype)
        total = int(want_total.item())
        assert torch.equal(got_w, want_w) and torch.equal(got_ids, want_ids), f"T={t}: routing differs"
        assert int(layout.num_padded.item()) == total
        assert torch.equal(layout.sorted_ids[:total], want_sorted[:total]), f"T={t}: sorted ids differ"
        assert torch.equal(layout.block_expert[: total // 16], want_blocks[: total // 16]), f"T={t}: blocks differ"


@pytest.mark.parametrize("t", [4, 16], ids=["decode-one-launch-routing", "three-launch-routing"])
def test_no_host_sync_and_a_cuda_graph_replays_any_routing(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer (router, top-k, sort, GEMMs) never waits for the device, and a graph captured
    with one routing replays others exactly as eager runs compute them."""
    monkeypatch.setattr(moe_routing_triton, "ONE_LAUNCH_ROUTING", True)  # (off by default)
    h, inter, e, k = 512, 256, 32, 4
    torch.manual_seed(0)
    with torch.device(CUDA):
        block = SparseMoeBlock(e, k, h, inter, renormalize=True).to(torch.bfloat16)
    for p in block.parameters():
        p.data.normal_(0, 0.05)
    x = torch.randn(t, h, device=CUDA).to(torch.bfloat16)
    block(x)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x)
    for seed in (1, 2, 3):
        fresh = torch.randn(t, h, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(seed))
        if seed == 3:
            fresh[:] = fresh[0]  # every token routed the same: one expert group holds all rows
        static_x.copy_(fresh.to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, block(static_x)), f"replay {seed} differs from eager"


# The one-token tilings the plan sweep tries (scripts/bench_moe_plans.py), the default first.
DIRECT_TILES = [(64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (128, 128, 4, 3), (16, 256, 4, 4), (64, 64, 4, 8)]


@pytest.mark.parametrize(("name", "h", "inter", "e", "k"), SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_direct_experts_give_the_sorted_layouts_bits_with_any_plan(name: str, h: int, inter: int, e: int, k: int,
                                                                   dtype: torch.dtype) -> None:
    """One token's experts indexed straight from its ids (no sort) with every tiling the plan
    table may hold: the same rows, bit for bit, as the sorted layout with the default tiles, alone
    and as the first token of a batch of three (batch invariance of the table's plans)."""
    from loom.layers.fused_moe_triton import expert_outputs_triton

    x, w13, w2, weights, ids = _inputs(3, h, inter, e, k, dtype, seed=11 + e)
    want = expert_outputs_triton(x[:1], w13, w2, weights[:1], ids[:1], direct=False).rows
    batched = expert_outputs_triton(x, w13, w2, weights, ids, direct=False).rows[:k]
    assert torch.equal(want, batched), "the sorted layout's first token differs alone and in a batch"
    base = block_config(1, 1, dtype)
    for tiles in DIRECT_TILES:
        cfg = MoeBlockConfig(base.block_m, *tiles)
        if dtype == torch.float32:
            cfg = MoeBlockConfig(base.block_m, min(tiles[0], 64), 32, tiles[2], 2)
        got = expert_outputs_triton(x[:1], w13, w2, weights[:1], ids[:1], cfg, direct=True).rows
        assert torch.equal(got, want), f"{tiles}: the direct rows differ from the sorted layout's"


@pytest.mark.parametrize("t", [1, 16, 64])
def test_the_pipelined_k_loop_gives_the_masked_loops_bits(t: int) -> None:
    """The expert kernels' K loop without a K mask (``EVEN_K``, what lets Triton pipeline the
    loads) against the masked loop, at the Qwen3-30B-A3B shape (K = 2048 and 768, whole tiles):
    the same activations and rows, bit for bit."""
    from loom.layers.fused_moe_triton import launch_down, launch_gate_up

    h, inter, e, k = 2048, 768, 128, 8
    x, w13, w2, _, ids = _inputs(t, h, inter, e, k, torch.bfloat16, seed=t)
    cfg = block_config(t * k, e, torch.bfloat16)
    sorted_ids, block_expert, num_padded = align_rows_by_expert(ids, e, cfg.block_m)
    outs = []
    for even_k in (False, None):
        act = torch.empty(t * k, inter, device=CUDA, dtype=torch.bfloat16)
        y = torch.empty(t * k, h, device=CUDA, dtype=torch.bfloat16)
        launch_gate_up(x, w13, act, sorted_ids, block_expert, num_padded, k, cfg, False, even_k)
        launch_down(act, w2, y, sorted_ids, block_expert, num_padded, cfg, False, even_k)
        outs.append((act, y))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_a_one_token_block_skips_the_sort_and_replays_in_a_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """At one token the layer launches no sort (direct experts), a captured graph replays other
    routings exactly as eager runs compute them, and the output is the sorted path's bits."""
    from loom import kernel_switches
    from loom.layers import fused_moe_triton

    align = CallCounter(monkeypatch, fused_moe_triton, "align_rows_by_expert")
    h, inter, e, k = 512, 256, 32, 4
    torch.manual_seed(0)
    with torch.device(CUDA):
        block = SparseMoeBlock(e, k, h, inter, renormalize=True).to(torch.bfloat16)
    for p in block.parameters():
        p.data.normal_(0, 0.05)
    static_x = torch.randn(1, h, device=CUDA).to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x)
    assert align.calls == 0, "a one-token step sorted its rows"
    for seed in (1, 2):
        static_x.copy_(torch.randn(1, h, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, block(static_x)), f"replay {seed} differs from eager"
        monkeypatch.setattr(kernel_switches, "moe_direct_experts", False)
        sorted_out = block(static_x)
        monkeypatch.setattr(kernel_switches, "moe_direct_experts", True)
        assert align.calls > 0 and torch.equal(static_out, sorted_out), f"replay {seed}: not the sorted path's bits"


@pytest.mark.parametrize("t", [1, 2, 4])
def test_router_with_routing_in_its_epilogue_gives_the_two_launches_bits(t: int) -> None:
    """``moe_router_gemv.route_from_hidden`` (one launch) against the dense GEMV with the same
    plan then ``route`` (two), at the Qwen3-30B-A3B router's shape with the H200 table's plan and
    a plan of four splits: the same weights and ids bit for bit, eager and replayed in a graph."""
    from loom.layers import dense_gemv
    from loom.layers.dense_gemv import GemvPlan
    from loom.layers.moe_router_gemv import fused_router_supported, route_from_hidden

    gen = torch.Generator(device=CUDA).manual_seed(t)
    x = torch.randn(t, 2048, device=CUDA, generator=gen).to(torch.bfloat16)
    w = (torch.randn(128, 2048, device=CUDA, generator=gen) * 0.02).to(torch.bfloat16)
    for plan in (GemvPlan(16, 256, 8, 4, 4, True), GemvPlan(32, 128, 4, 4, 3, True)):
        assert fused_router_supported(x, w, 8, plan)
        want_w, want_ids = route(dense_gemv.dense_gemv(x, w, None, plan), 8, True, torch.bfloat16)
        got_w, got_ids = route_from_hidden(x, w, 8, True, torch.bfloat16, plan)
        assert torch.equal(got_w, want_w) and torch.equal(got_ids, want_ids), f"{plan}: eager differs"
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_w, g_ids = route_from_hidden(static_x, w, 8, True, torch.bfloat16, plan)
        for seed in (1, 2):
            static_x.copy_(torch.randn(t, 2048, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(seed)))
            graph.replay()
            want_w, want_ids = route(dense_gemv.dense_gemv(static_x, w, None, plan), 8, True, torch.bfloat16)
            assert torch.equal(g_w, want_w) and torch.equal(g_ids, want_ids), f"{plan}: replay {seed} differs"


def test_the_block_routes_in_the_routers_epilogue_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3-30B-A3B-shaped block at one and three tokens takes the fused router where the dense
    GEMV's table names the router (the H200's does), and its output is the two launches' bits
    (switch off)."""
    from loom import kernel_switches
    from loom.layers import moe_router_gemv

    require_router_merge_plan(CUDA, 128, 2048)
    fused = CallCounter(monkeypatch, moe_router_gemv, "route_from_hidden")
    torch.manual_seed(0)
    with torch.device(CUDA):
        block = SparseMoeBlock(128, 8, 2048, 768, renormalize=True, weights_in_logits_dtype=True).to(torch.bfloat16)
    for p in block.parameters():
        p.data.normal_(0, 0.02)
    for t in (1, 3):
        x = torch.randn(t, 2048, device=CUDA).to(torch.bfloat16)
        fused.calls = 0
        got = block(x)
        assert fused.calls == 1, f"T={t}: the fused router did not run"
        monkeypatch.setattr(kernel_switches, "moe_router_epilogue", False)
        want = block(x)
        monkeypatch.setattr(kernel_switches, "moe_router_epilogue", True)
        assert fused.calls == 1 and torch.equal(got, want), f"T={t}: not the two launches' bits"


@pytest.mark.parametrize("t", [1, 5, 40])
def test_combine_folded_into_the_next_norm_gives_the_same_bits(t: int) -> None:
    """The layer's experts' rows summed by the next residual add + norm (one launch) against its
    summed output through that norm (two): the same normed rows and residual, bf16 and float32."""
    from loom.layers.fused_moe_triton import ExpertOutputs
    from loom.layers.norm import RMSNorm

    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(t)
        with torch.device(CUDA):
            block = SparseMoeBlock(64, 8, 1024, 384, renormalize=True, weights_in_logits_dtype=True).to(dtype)
            norm = RMSNorm(1024).to(dtype)
        for p in block.parameters():
            p.data.normal_(0, 0.05)
        norm.weight.data.normal_(1, 0.3)
        x, residual = torch.randn(t, 1024, device=CUDA).to(dtype), torch.randn(t, 1024, device=CUDA).to(dtype)
        rows = block.forward_uncombined(x)
        assert isinstance(rows, ExpertOutputs)
        folded = norm.forward_with_residual(rows, residual)
        separate = norm.forward_with_residual(block(x), residual)
        assert all(torch.equal(a, b) for a, b in zip(folded, separate, strict=True)), dtype


def test_block_configs_fit_the_shapes() -> None:
    for n in (1, 8, 64, 512, 4096, 65536):
        for dtype in (torch.bfloat16, torch.float32):
            cfg = block_config(n, 128, dtype)
            assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.block_k >= 16
    x, w13, w2, weights, ids = _inputs(33, 256, 128, 8, 2, torch.bfloat16, seed=5)
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    for cfg in (MoeBlockConfig(16, 32, 64, 4, 2), MoeBlockConfig(64, 64, 32, 4, 3), MoeBlockConfig(128, 128, 64, 8, 3)):
        assert _rel(fused_experts_triton(x, w13, w2, weights, ids, cfg), ref) < REL_NORM[torch.bfloat16], cfg


# -- the models on the GPU --------------------------------------------------------------------------------

# Teacher-forced on the engine's tokens, transformers (float32, CPU) must rank each chosen token
# within TIE_TOL of its best logit, and agree on its log-probability within LOGPROB_TOL. The GPU
# path runs float32 throughout (IEEE dots in the paged and MoE kernels, no TF32 in cuBLAS), so
# it differs from the CPU by float32 reordering only (~1e-5); the bounds leave room for the GPU's
# fast exp2 in attention.
TIE_TOL = 2e-3
LOGPROB_TOL = 2e-3


@pytest.mark.parametrize("variant", ["mixtral", "qwen3-moe", "gemma2", "gemma3", "phi3"])
def test_models_on_cuda_with_graphs_agree_with_transformers(variant: str,
                                                            tiny_model_dir: Callable[[str], Path]) -> None:
    """The paged backend (windows, Gemma 2's soft cap), the MoE kernels and CUDA-graph decode."""
    from helpers.graph_engine_runs import check_against_transformers
    from helpers.tiny_models import load_hf_reference

    path = tiny_model_dir(variant)
    check_against_transformers(path, load_hf_reference(path), lengths=(40, 9, 3, 21), new_tokens=20, seed=3,
                               cuda_graphs=(1, 2, 4, 8), label=variant, tie_tol=TIE_TOL, logprob_tol=LOGPROB_TOL)
