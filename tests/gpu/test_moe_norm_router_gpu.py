"""The residual norm before an MoE block and its router in one launch (``loom.layers.moe_norm_router``)
on a CUDA GPU, against the two launches it replaces (``fused_add_rms_norm``, then the router with
the routing in its epilogue): the normed rows, the new residual, the routing weights and ids bit for
bit, bf16 at the Qwen3-30B-A3B shape, eager and replayed in a CUDA graph, with ``LOOM_PDL`` off and
on; and the decoder's MoE block with the switch on and off."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers.call_counter import CallCounter, require_router_merge_plan

from loom import kernel_switches
from loom.layers import fused_ops, moe_norm_router
from loom.layers.dense_gemv import GemvPlan
from loom.layers.fused_moe import SparseMoeBlock
from loom.layers.moe_router_gemv import route_from_hidden
from loom.layers.norm import RMSNorm
from loom.layers.triton_jit import pdl_enabled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
H, E, K, EPS = 2048, 128, 8, 1e-6
PLANS = (GemvPlan(16, 256, 8, 4, 4, True), GemvPlan(32, 128, 4, 4, 3, True))  # the H200 table's, and another


def _inputs(t: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    # values over many binades, so that another order of the sum of squares would show in the bits
    scale = torch.exp(2 * torch.randn(t, H, device=CUDA, generator=gen))
    x = (torch.randn(t, H, device=CUDA, generator=gen) * scale).to(torch.bfloat16)
    residual = torch.randn(t, H, device=CUDA, generator=gen).to(torch.bfloat16)
    norm_w = (1 + 0.3 * torch.randn(H, device=CUDA, generator=gen)).to(torch.bfloat16)
    router_w = (torch.randn(E, H, device=CUDA, generator=gen) * 0.02).to(torch.bfloat16)
    return x, residual, norm_w, router_w


def _two_launches(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, router_w: torch.Tensor,
                  plan: GemvPlan) -> tuple[torch.Tensor, ...]:
    normed, h = fused_ops.fused_add_rms_norm(x, residual, norm_w, EPS)
    weights, ids = route_from_hidden(normed, router_w, K, True, torch.bfloat16, plan)
    return normed, h, weights, ids


def _one_launch(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, router_w: torch.Tensor,
                plan: GemvPlan) -> tuple[torch.Tensor, ...]:
    return moe_norm_router.norm_route(x, residual, norm_w, EPS, router_w, K, True, torch.bfloat16, plan)


def _equal(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> dict[str, bool]:
    names = ("normed", "residual", "weights", "ids")
    return {n: torch.equal(a, b) for n, a, b in zip(names, got, want, strict=True)}


@pytest.mark.parametrize("pdl", [False, True], ids=["pdl-off", "pdl-on"])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_one_launch_gives_the_two_launches_bits(t: int, pdl: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_switches, "pdl", pdl)
    if pdl and not pdl_enabled(CUDA):
        pytest.skip("PDL needs compute capability 9 or later and a Triton with its API")
    x, residual, norm_w, router_w = _inputs(t, seed=t)
    for plan in PLANS:
        assert moe_norm_router.norm_router_supported(x, residual, norm_w, router_w, K, plan)
        same = _equal(_one_launch(x, residual, norm_w, router_w, plan), _two_launches(x, residual, norm_w, router_w, plan))
        assert all(same.values()), f"{plan}: eager {same}"
        static = [a.clone() for a in (x, residual)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _one_launch(static[0], static[1], norm_w, router_w, plan)
        for seed in (11, 12):
            new_x, new_res, _, _ = _inputs(t, seed)
            static[0].copy_(new_x)
            static[1].copy_(new_res)
            graph.replay()
            torch.cuda.synchronize()
            same = _equal(outs, _two_launches(static[0], static[1], norm_w, router_w, plan))
            assert all(same.values()), f"{plan}: replay {seed} {same}"


def test_the_block_runs_the_norm_in_its_router_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3-30B-A3B-shaped block behind its post-attention norm at one and three tokens takes
    the one launch where the dense GEMV's table names the router (the H200's does), and hands on
    the switch-off path's bits (the norm, then the router with its routing)."""
    require_router_merge_plan(CUDA, E, H)
    fused = CallCounter(monkeypatch, moe_norm_router, "norm_route")
    torch.manual_seed(0)
    with torch.device(CUDA):
        block = SparseMoeBlock(E, K, H, 768, renormalize=True, weights_in_logits_dtype=True).to(torch.bfloat16)
        norm = RMSNorm(H, eps=EPS).to(torch.bfloat16)
    for p in block.parameters():
        p.data.normal_(0, 0.02)
    norm.weight.data.normal_(1, 0.3)
    for t in (1, 3):
        x, residual, _, _ = _inputs(t, seed=100 + t)
        fused.calls = 0
        got, got_h = block.forward_with_norm(x, residual, norm)
        assert fused.calls == 1, f"T={t}: the norm did not run in the router's launch"
        monkeypatch.setattr(kernel_switches, "moe_norm_router", False)
        want, want_h = block.forward_with_norm(x, residual, norm)
        monkeypatch.setattr(kernel_switches, "moe_norm_router", True)
        assert fused.calls == 1
        got_sum = got if isinstance(got, torch.Tensor) else got.combine()
        want_sum = want if isinstance(want, torch.Tensor) else want.combine()
        assert torch.equal(got_h, want_h) and torch.equal(got_sum, want_sum), f"T={t}: not the two launches' bits"
