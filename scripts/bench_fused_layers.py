"""Per-layer time of a decode layer's elementwise work, torch path against the fused kernels.

One layer's worth is what ``LlamaDecoderLayer`` does besides the matmuls and attention: two
residual add + RMSNorm, RoPE of q and k (views of a qkv buffer) and SiLU-and-mul, in bf16. Timed
as decode runs it: 16 layers captured in a CUDA graph and replayed, so launch overhead on the
host does not count, only the kernels and the gaps between them.

    PYTHONPATH=service python scripts/bench_fused_layers.py

See docs/gpu-kernels.md for results.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from loom import kernel_switches
from loom.layers.activation import SiluAndMul
from loom.layers.norm import RMSNorm
from loom.layers.rotary import RotaryEmbedding, _default_inv_freq

# name: (hidden, query heads, KV heads, head_dim, intermediate)
SHAPES = {"llama-3.2-1b": (2048, 32, 8, 64, 8192), "llama-3-8b": (4096, 32, 8, 128, 14336)}
LAYERS = 16
REPLAYS = 100


def us_per_layer(shape: str, tokens: int, fused: bool) -> float:
    kernel_switches.fused_kernels = fused
    hidden, hq, hkv, d, inter = SHAPES[shape]
    dev, dt = torch.device("cuda"), torch.bfloat16
    norm1, norm2 = RMSNorm(hidden).to(dev, dt), RMSNorm(hidden).to(dev, dt)
    rope = RotaryEmbedding(d, 8192, _default_inv_freq(500000.0, d)).to(dev)
    act = SiluAndMul()

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt)

    residual, attn_out, mlp_out = rand(tokens, hidden), rand(tokens, hidden), rand(tokens, hidden)
    qkv, gate_up = rand(tokens, (hq + 2 * hkv) * d), rand(tokens, 2 * inter)
    positions = torch.arange(tokens, device=dev) + 100
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)

    def layers() -> None:
        for _ in range(LAYERS):
            _, res = norm1.forward_with_residual(mlp_out, residual)
            rope(positions, q, k)
            norm2.forward_with_residual(attn_out, res)
            act(gate_up)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        layers()
        layers()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / REPLAYS / LAYERS


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, bf16, {LAYERS} layers per CUDA graph")
    for shape in SHAPES:
        for tokens in (1, 32, 256):
            unfused, fused = us_per_layer(shape, tokens, False), us_per_layer(shape, tokens, True)
            print(f"{shape:13s} T={tokens:4d}: torch {unfused:6.1f} us/layer, fused {fused:6.1f} us/layer "
                  f"({unfused / fused:.1f}x)")


if __name__ == "__main__":
    main()
