"""FP8 experts (``loom_plugins.quant.fp8_moe``: e4m3 codes, a float32 scale per output channel,
weight-only) on a CUDA GPU: the fused kernels against a float32 computation on the dequantized
weights, the one-token path's bits, CUDA-graph replay, and a served FP8 MoE checkpoint against
transformers on the same dequantized weights.

Tolerances: float32 activations run IEEE dots on the converted codes, so the outputs agree with
the float32 reference to float32 rounding (``atol = rtol = 1e-4``). bf16 activations are dotted in
fp16 after a power-of-two scaling per row (exact for bf16 values near each row's maximum) and the
intermediate activation is rounded to bf16 as the dense experts round it: the relative error of
the whole output stays under ``1.5e-2``, the dense bf16 experts' bound (test_fused_moe_gpu.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from loom.layers.fused_moe import fused_experts_torch, select_experts
from loom.layers.fused_moe_triton import expert_outputs_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
SHAPES = [("qwen3-30b-a3b", 2048, 768, 128, 8), ("ragged", 320, 200, 12, 3)]


def _fp8_inputs(t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype, seed: int) -> tuple[Any, ...]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(t, h, device=CUDA, generator=gen).to(dtype)
    w13 = torch.randn(e, 2 * inter, h, device=CUDA, generator=gen) / h**0.5
    w2 = torch.randn(e, h, inter, device=CUDA, generator=gen) / inter**0.5
    s13, s2 = w13.abs().amax(-1) / 448, w2.abs().amax(-1) / 448
    c13 = (w13 / s13[..., None]).to(torch.float8_e4m3fn)
    c2 = (w2 / s2[..., None]).to(torch.float8_e4m3fn)
    weights, ids = select_experts(torch.randn(t, e, device=CUDA, generator=gen), k, renormalize=True)
    return x, c13, c2, s13.contiguous(), s2.contiguous(), weights, ids


@pytest.mark.parametrize(("name", "h", "inter", "e", "k"), SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("t", [1, 7, 64, 513])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_fp8_experts_match_float32_on_the_dequantized_weights(name: str, h: int, inter: int, e: int, k: int,
                                                               t: int, dtype: torch.dtype) -> None:
    x, c13, c2, s13, s2, weights, ids = _fp8_inputs(t, h, inter, e, k, dtype, seed=t * 5 + e)
    ref = fused_experts_torch(x.float(), c13.float() * s13[..., None], c2.float() * s2[..., None], weights, ids)
    rows = expert_outputs_triton(x, c13, c2, weights, ids, w13_scale=s13, w2_scale=s2)
    got = rows.combine()
    torch_path = fused_experts_torch(x, c13, c2, weights, ids, s13, s2)  # the CPU's path, here on CUDA
    torch.cuda.synchronize()
    assert got.dtype == dtype and torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:
        for label, out in (("Triton", got), ("torch", torch_path)):
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            assert rel < 1.5e-2, f"{label}: {rel:.2e}"
    if t == 1:  # the direct path (no sort) gives the sorted layout's bits
        sorted_rows = expert_outputs_triton(x, c13, c2, weights, ids, direct=False, w13_scale=s13, w2_scale=s2)
        assert torch.equal(rows.rows, sorted_rows.rows)


@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_block_fp8_experts_match_float32_on_the_dequantized_weights(t: int, dtype: torch.dtype) -> None:
    """Block-wise scales (128 x 128, DeepSeek's and Qwen3's FP8 releases) at Qwen3-30B-A3B's shape:
    each K tile's sums scaled by its blocks; the bounds of the per-channel test."""
    from loom.layers.fused_moe import dequantize_expert

    h, inter, e, k, block = 2048, 768, 128, 8, (128, 128)
    gen = torch.Generator(device=CUDA).manual_seed(t)
    x = torch.randn(t, h, device=CUDA, generator=gen).to(dtype)
    codes, grids = [], []
    for rows, cols in ((2 * inter, h), (h, inter)):
        w = torch.randn(e, rows, cols, device=CUDA, generator=gen) / cols**0.5
        grid = w.reshape(e, rows // 128, 128, cols // 128, 128).abs().amax(dim=(2, 4)) / 448
        full = grid.repeat_interleave(128, 1).repeat_interleave(128, 2)
        codes.append((w / full).to(torch.float8_e4m3fn))
        grids.append(grid.contiguous())
    deq = [torch.stack([dequantize_expert(c[i], g[i], torch.float32, block) for i in range(e)])
           for c, g in zip(codes, grids, strict=True)]
    weights, ids = select_experts(torch.randn(t, e, device=CUDA, generator=gen), k, renormalize=True)
    ref = fused_experts_torch(x.float(), deq[0], deq[1], weights, ids)
    got = expert_outputs_triton(x, codes[0], codes[1], weights, ids, w13_scale=grids[0], w2_scale=grids[1],
                                scale_block=block).combine()
    torch.cuda.synchronize()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert rel < 1.5e-2, f"{rel:.2e}"


@pytest.mark.parametrize("t", [1, 16])
def test_fp8_experts_replay_in_a_cuda_graph_with_any_routing(t: int) -> None:
    x, c13, c2, s13, s2, weights, ids = _fp8_inputs(t, 2048, 768, 128, 8, torch.bfloat16, seed=9)
    static = [x.clone(), weights.clone(), ids.clone()]

    def run() -> torch.Tensor:
        return expert_outputs_triton(static[0], c13, c2, static[1], static[2], w13_scale=s13,
                                     w2_scale=s2).combine()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (1, 2):
        fresh = _fp8_inputs(t, 2048, 768, 128, 8, torch.bfloat16, seed=seed)
        for dst, src in zip(static, (fresh[0], fresh[5], fresh[6]), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run()), f"replay {seed} differs from eager"


@pytest.mark.parametrize("block", [None, (16, 16)], ids=["per-channel", "block-wise"])
def test_a_served_fp8_moe_checkpoint_agrees_with_transformers(block: tuple[int, int] | None,
                                                               tiny_model_dir: Callable[[str], Path],
                                                               tmp_path: Path) -> None:
    """A weight-only FP8 checkpoint of the tiny Qwen3-MoE (compressed-tensors' own quantizer), served
    on CUDA in float32 with CUDA-graph decode (the FP8 expert kernels, their rows summed by the next
    norm), against transformers on the dequantized weights: every chosen token an argmax, the
    logprobs within 2e-3 (test_fused_moe_gpu.py's bounds). Per-channel scales, and block-wise
    (``weight_block_size``: its linear layers dequantize per call on CUDA, its experts run the
    kernels' block mode). Written by the helper's torch writer (compressed-tensors' arithmetic;
    the package is not on the GPU machine)."""
    from helpers.graph_engine_runs import check_against_transformers
    from helpers.quant_checkpoints import dense_with, fp8_checkpoint
    from helpers.tiny_models import load_hf_reference

    dense = tiny_model_dir("qwen3-moe")
    path, expected = fp8_checkpoint(dense, tmp_path / "fp8", per_channel=True, static=False, weight_only=True,
                                    torch_writer=True, layout="fp8" if block else "compressed-tensors", block=block)
    check_against_transformers(path, load_hf_reference(dense_with(dense, tmp_path / "hf", expected)),
                               lengths=(33, 4, 17), new_tokens=16, seed=5, cuda_graphs=(1, 2, 4),
                               label="block-wise" if block else "per-channel")
