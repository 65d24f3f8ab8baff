"""Time of the fused MoE experts of one layer at the Qwen3-30B-A3B shape, and the bandwidth it reaches.

One layer's experts (hidden 2048, 128 experts of 768, 8 per token, bf16) for a batch of tokens,
routed by a random router (uniform in expectation, as random:qwen3-30b-a3b routes): the Triton
path (sort by expert, gate/up GEMM with SiLU, down GEMM, weighted sum), 48 layers' worth captured
in one CUDA graph and replayed, so the figure is device time without host launch overhead. The
bytes a layer must read are its chosen experts' weights (each once) plus the activations; their
rate is compared with a device copy's. Times 48 over a W1 decode step's time is the experts'
share of the step (``loom bench --workloads W1 --model-id random:qwen3-30b-a3b`` reports the step).

    PYTHONPATH=service python scripts/bench_fused_moe.py [batch ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from loom.layers.fused_moe import select_experts
from loom.layers.fused_moe_triton import block_config, fused_experts_triton

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 2048, 768, 128, 8, 48
REPLAYS = 20


def copy_bandwidth(dev: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes a second, read plus written, of ``nbytes`` copied on the device (10 copies, timed by events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def layer_time(batch: int, dev: torch.device) -> dict[str, float]:
    dt = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(batch)
    # One weight set per layer, so that 48 layers read 48 layers' experts (no cache reuse).
    w13 = [torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=dt, generator=gen) * 0.02 for _ in range(LAYERS)]
    w2 = [torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=dt, generator=gen) * 0.02 for _ in range(LAYERS)]
    x = torch.randn(batch, HIDDEN, device=dev, dtype=dt, generator=gen)
    router = torch.randn(HIDDEN, EXPERTS, device=dev, dtype=dt, generator=gen) * 0.02
    weights, ids = select_experts(x @ router, TOP_K, renormalize=True)

    def run() -> torch.Tensor:
        h = x
        for layer in range(LAYERS):
            h = fused_experts_triton(h, w13[layer], w2[layer], weights, ids)
        return h

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    per_layer_s = start.elapsed_time(end) / 1e3 / REPLAYS / LAYERS
    chosen = int(torch.unique(ids).numel())
    expert_bytes = chosen * 3 * HIDDEN * INTER * 2
    cfg = block_config(batch * TOP_K, EXPERTS, dt)
    return {"batch": batch, "experts_chosen": chosen, "us_per_layer": per_layer_s * 1e6,
            "expert_bytes_per_layer": expert_bytes, "GBps": expert_bytes / per_layer_s / 1e9,
            "block_m": cfg.block_m, "block_n": cfg.block_n, "block_k": cfg.block_k}


def main() -> None:
    dev = torch.device("cuda")
    batches = [int(b) for b in sys.argv[1:]] or [1, 4, 16, 64, 256]
    bw = copy_bandwidth(dev)
    print(json.dumps({"copy_GBps": bw / 1e9}), flush=True)
    for b in batches:
        row = layer_time(b, dev)
        row["share_of_copy_bandwidth"] = row["GBps"] * 1e9 / bw
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
