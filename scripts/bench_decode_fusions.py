"""Device time of the small launches a Qwen3-30B-A3B decode layer fuses, before and after (#22).

Each pair does the same work at the model's shapes (hidden 2048, 32 query / 4 KV heads of 128, 128
experts, 8 a token, bf16) for a batch of ``T`` tokens, 48 layers' worth captured in one CUDA graph
and replayed, so a figure is a layer's device time including the gaps between its launches (what a
decode step pays), not host launch overhead:

* ``routing``: ``route`` + ``align_rows_by_expert`` (three launches) against ``route_and_sort``
  (one; decode sizes only, T <= 8);
* ``qk_norm_rotary``: the q and k per-head norms + ``rotary`` (three) against ``qk_norm_rotary`` (one);
* ``combine_norm``: the MoE ``combine_rows`` + the next ``fused_add_rms_norm`` (two) against
  ``fused_combine_add_rms_norm`` (one).

Predicted from the 2026-12-03 decode profile (bench/results/profile-random-qwen3-30b-a3b-b1.txt) at
T = 1: routing 6.3 -> ~3.3 us, q/k norms + rotary 5.3 -> ~2.3 us, combine + norm 3.5 -> ~2 us.

    PYTHONPATH=service python scripts/bench_decode_fusions.py [--tokens 1 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from loom.layers import fused_ops
from loom.layers.fused_moe_triton import combine_rows
from loom.layers.moe_routing_triton import align_rows_by_expert, route, route_and_sort
from loom.layers.rotary import RotaryEmbedding, _default_inv_freq

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, LAYERS = 2048, 32, 4, 128, 128, 8, 48
REPLAYS = 50
EPS = 1e-6


def per_layer_us(step: Callable[[], Any]) -> float:
    """Device time of ``step`` a layer: LAYERS calls in one graph, replayed REPLAYS times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / REPLAYS / LAYERS


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
