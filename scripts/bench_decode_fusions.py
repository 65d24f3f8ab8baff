"""Device time of the small launches a Qwen3-30B-A3B decode layer fuses, before and after (#22).

Each pair does the same work at the model's shapes (hidden 2048, 32 query / 4 KV heads of 128, 128
experts, 8 a token, bf16) for a batch of ``T`` tokens, 48 layers' worth captured in one CUDA graph
and replayed, so a figure is a layer's device time including the gaps between its launches (what a
decode step pays), not host launch overhead:

* ``routing``: ``route`` + ``align_rows_by_expert`` (three launches) against ``route_and_sort``
  (one; decode sizes only, T <= 8);
* ``qk_norm_rotary``: the q and k per-head norms + ``rotary`` (three) against ``qk_norm_rotary`` (one);
* ``combine_norm``: the MoE ``combine_rows`` + the next ``fused_add_rms_norm`` (two) against
  ``fused_combine_add_rms_norm`` (one);
* ``router_routing`` (T <= 4): the router on the dense GEMV (its table's plan) then ``route``
  (two launches) against ``moe_router_gemv.route_from_hidden`` (one: the routing in the GEMV's
  last program);
* ``norm_router`` (T <= 4): the residual add + RMSNorm before the MoE block
  (``fused_add_rms_norm``) then the router with the routing in its epilogue (two launches) against
  ``moe_norm_router.norm_route`` (one: every program of the router's grid recomputes the norm);
* ``direct_experts`` (T = 1 only): the experts after the sort by expert (``align_rows_by_expert``'s
  two launches, then gate/up and down on the sorted layout) against the experts indexed straight
  from the routing's ids (``expert_outputs_triton(direct=True)``: two launches; with
  ``moe_plan_table``'s tiles once measured). The 48 calls cycle through 16 disjoint sets of 8
  experts of one layer's weights (1.2 GB), so the expert weights come from memory, not the L2.

Predicted from the 2026-12-03 decode profile (bench/results/profile-random-qwen3-30b-a3b-b1.txt) at
T = 1: routing 6.3 -> ~3.3 us, q/k norms + rotary 5.3 -> ~2.3 us, combine + norm 3.5 -> ~2 us.
Router with the routing in its epilogue (predicted before measurement): 4.2 + 2.5 us -> ~5 us
(one launch and its gap less, plus one program's routing, ~1 us, after the GEMV). Direct
experts (predicted before measurement): the count (1.3 us) and place (2.5 us) launches of
the profile go, the expert kernels do the same work: 27.8 -> ~24 us a layer (-3.8 us, -0.18 ms
a 48-layer step).

Norm in the router's launch (predicted before measurement, T = 1): the norm's ~2.3 us a layer
(its launch and the gap before the router; 8 KB of work) go, and each of the router's 64 programs
adds ~0.5-1 us of latency in front of its GEMV (two 4 KB row loads from L2, a 2048-value sum of
squares, a 512-byte store, a barrier, the x tile read back): 2.3 + 5.8 -> ~6.5 us, -1.3 to -1.8 us
a layer, 0.06-0.09 ms a 48-layer step (about 2-3% of W1's 3.30 ms); with PDL the norm's launch
gap is partly hidden already, so the saving there may be the lower end or less.

    PYTHONPATH=service python scripts/bench_decode_fusions.py [--tokens 1 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from sweep_common import graphed_us_per_call

from loom.layers import dense_gemv, fused_ops
from loom.layers.fused_moe_triton import combine_rows, expert_outputs_triton
from loom.layers.moe_norm_router import norm_route, norm_router_supported
from loom.layers.moe_router_gemv import fused_router_supported, route_from_hidden
from loom.layers.moe_routing_triton import align_rows_by_expert, route, route_and_sort
from loom.layers.rotary import RotaryEmbedding, _default_inv_freq

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, LAYERS = 2048, 32, 4, 128, 128, 8, 48
INTER = 768  # an expert's intermediate size
REPLAYS = 50
EPS = 1e-6


def per_layer_us(step: Callable[[], Any]) -> float:
    """Device time of ``step`` a layer: LAYERS calls in one graph, replayed REPLAYS times."""
    return graphed_us_per_call(lambda _: step(), LAYERS, REPLAYS)


def pairs(tokens: int, dev: torch.device) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    dt = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(tokens)
    logits = torch.randn(tokens, EXPERTS, device=dev, generator=gen).to(dt)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, generator=gen).to(dt)
    q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    q_w, k_w = (1 + 0.1 * torch.randn(HEAD_DIM, device=dev, generator=gen)).to(dt), torch.ones(HEAD_DIM, device=dev, dtype=dt)
    rope = RotaryEmbedding(HEAD_DIM, 40960, _default_inv_freq(1000000.0, HEAD_DIM)).to(dev)
    positions = torch.randint(0, 4096, (tokens,), device=dev, generator=gen)
    rows = torch.randn(tokens * TOP_K, HIDDEN, device=dev, generator=gen).to(dt)
    weights = torch.softmax(torch.randn(tokens, TOP_K, device=dev, generator=gen), -1).to(dt)
    residual = torch.randn(tokens, HIDDEN, device=dev, generator=gen).to(dt)
    norm_w = torch.ones(HIDDEN, device=dev, dtype=dt)

    def routing_before() -> Any:
        _, ids = route(logits, TOP_K, True, dt)
        return align_rows_by_expert(ids, EXPERTS, 16)

    def qk_before() -> Any:
        nq = fused_ops.fused_add_rms_norm(q, None, q_w, EPS)[0]
        nk = fused_ops.fused_add_rms_norm(k, None, k_w, EPS)[0]
        return fused_ops.rotary(positions, nq, nk, rope.cos_cached, rope.sin_cached)

    out: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "qk_norm_rotary": (qk_before, lambda: fused_ops.qk_norm_rotary(positions, q, k, q_w, k_w, EPS, EPS,
                                                                         rope.cos_cached, rope.sin_cached)),
        "combine_norm": (lambda: fused_ops.fused_add_rms_norm(combine_rows(rows, weights), residual, norm_w, EPS),
                         lambda: fused_ops.fused_combine_add_rms_norm(rows, weights, residual, norm_w, EPS)),
    }
    if tokens <= 8:
        out["routing"] = (routing_before, lambda: route_and_sort(logits, TOP_K, True, 16, dt))
    if tokens <= dense_gemv.MAX_M:
        router_w = (torch.randn(EXPERTS, HIDDEN, device=dev, generator=gen) * 0.02).to(dt)
        hidden = torch.randn(tokens, HIDDEN, device=dev, generator=gen).to(dt)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        plan = dense_gemv.table_plan(EXPERTS, HIDDEN, tokens, sms) or dense_gemv.default_plan(EXPERTS, HIDDEN, sms)
        if fused_router_supported(hidden, router_w, TOP_K, plan):
            out["router_routing"] = (
                lambda: route(dense_gemv.dense_gemv(hidden, router_w, None, plan), TOP_K, True, dt),
                lambda: route_from_hidden(hidden, router_w, TOP_K, True, dt, plan))
        post_w = (1 + 0.1 * torch.randn(HIDDEN, device=dev, generator=gen)).to(dt)
        if norm_router_supported(hidden, residual, post_w, router_w, TOP_K, plan):

            def norm_router_before() -> Any:
                normed, _ = fused_ops.fused_add_rms_norm(hidden, residual, post_w, EPS)
                return route_from_hidden(normed, router_w, TOP_K, True, dt, plan)

            out["norm_router"] = (
                norm_router_before,
                lambda: norm_route(hidden, residual, post_w, EPS, router_w, TOP_K, True, dt, plan))
    if tokens == 1:
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=dt, generator=gen) * 0.02
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=dt, generator=gen) * 0.02
        x = torch.randn(1, HIDDEN, device=dev, generator=gen).to(dt)
        perm = torch.randperm(EXPERTS, device=dev, generator=gen).to(torch.int32)
        sets = [perm[s * TOP_K:(s + 1) * TOP_K].view(1, TOP_K).contiguous() for s in range(EXPERTS // TOP_K)]
        expert_w = weights[:1]

        def experts(direct: bool) -> Callable[[], Any]:
            calls = itertools.count()

            def step() -> Any:
                ids = sets[next(calls) % len(sets)]
                return expert_outputs_triton(x, w13, w2, expert_w, ids, direct=direct)
            return step

        out["direct_experts"] = (experts(False), experts(True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    results = []
    for tokens in args.tokens:
        for name, (before, after) in pairs(tokens, dev).items():
            b, a = per_layer_us(before), per_layer_us(after)
            row = {"tokens": tokens, "fusion": name, "before_us": round(b, 2), "after_us": round(a, 2),
                   "saved_us_per_layer": round(b - a, 2), "saved_ms_per_step_48_layers": round((b - a) * 48 / 1e3, 3)}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "layers": LAYERS, "results": results},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
