"""The fused layer kernels (``loom.layers.fused_ops``) on a CUDA GPU, against the layers' torch
code on the same GPU (``LOOM_FUSED_KERNELS=0``): the checks and tolerances of
``helpers/fused_cases.py``, with every case size at every token count. Also: the layers dispatch
to the kernels on CUDA (and not when switched off), a tiny model gives the same logits either
way, and the kernels replay correctly inside a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from helpers import fused_cases as fc

from loom.layers import fused_ops
from loom.layers.activation import SiluAndMul
from loom.layers.norm import RMSNorm
from loom.layers.rotary import RotaryEmbedding, _default_inv_freq
from loom.plugin_api import PluginRegistry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(("dtype", "tokens", "hidden", "with_residual"), [
    *fc.norm_cases(full=True), (torch.bfloat16, 300, 4096, True), (torch.float16, 64, 8192, False)])
def test_norm(dtype: torch.dtype, tokens: int, hidden: int, with_residual: bool) -> None:
    fc.check_norm("cuda", dtype, tokens, hidden, with_residual)


@pytest.mark.parametrize(("dtype", "tokens", "hidden", "top_k", "weights_dtype"), [
    *fc.combine_norm_cases(), (torch.bfloat16, 1, 2048, 8, torch.bfloat16),  # Qwen3-30B-A3B's decode row
    (torch.bfloat16, 300, 2048, 8, torch.bfloat16), (torch.bfloat16, 64, 4096, 2, torch.float32)])  # Mixtral-like
def test_combine_norm(dtype: torch.dtype, tokens: int, hidden: int, top_k: int, weights_dtype: torch.dtype) -> None:
    fc.check_combine_norm("cuda", dtype, tokens, hidden, top_k, weights_dtype)


@pytest.mark.parametrize(("dtype", "tokens", "heads", "head_dim"), [*fc.head_norm_cases(), (torch.bfloat16, 64, 32, 128)])
def test_head_norm(dtype: torch.dtype, tokens: int, heads: int, head_dim: int) -> None:
    fc.check_head_norm("cuda", dtype, tokens, heads, head_dim)


@pytest.mark.parametrize(("dtype", "tokens", "hq", "hkv", "head_dim"), [
    *fc.rotary_cases(full=True), (torch.bfloat16, 300, 32, 8, 128), (torch.bfloat16, 64, 64, 8, 128),
    (torch.bfloat16, 9, 16, 4, 256)])
def test_rotary(dtype: torch.dtype, tokens: int, hq: int, hkv: int, head_dim: int) -> None:
    fc.check_rotary("cuda", dtype, tokens, hq, hkv, head_dim)


@pytest.mark.parametrize(("dtype", "tokens", "hq", "hkv", "head_dim", "gemma"), [
    *fc.qk_norm_rotary_cases(full=True), (torch.bfloat16, 300, 32, 4, 128, False),  # Qwen3-30B-A3B's heads
    (torch.bfloat16, 64, 8, 4, 256, True), (torch.float16, 9, 16, 8, 128, False)])
def test_qk_norm_rotary(dtype: torch.dtype, tokens: int, hq: int, hkv: int, head_dim: int, gemma: bool) -> None:
    fc.check_qk_norm_rotary("cuda", dtype, tokens, hq, hkv, head_dim, gemma)


@pytest.mark.parametrize(("dtype", "shape"), [*fc.silu_cases(), (torch.bfloat16, (300, 2 * 14336))])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    fc.check_silu_and_mul("cuda", dtype, shape)


@pytest.mark.parametrize(("dtype", "tokens", "width", "kind", "static"), fc.quantized_input_cases(full=True))
def test_quantized_input(dtype: torch.dtype, tokens: int, width: int, kind: str, static: bool) -> None:
    fc.check_quantized_input("cuda", dtype, tokens, width, kind, static)


def test_layers_use_the_kernels_on_cuda_unless_switched_off() -> None:
    x = torch.randn(3, 4, 64, device="cuda", dtype=torch.bfloat16)
    flat = x.view(3, 256)
    norm, head_norm = RMSNorm(256).cuda().bfloat16(), RMSNorm(64).cuda().bfloat16()
    rope = RotaryEmbedding(64, 32, _default_inv_freq(10000.0, 64)).cuda()
    positions = torch.arange(3, device="cuda")

    def run() -> None:
        norm(flat)
        norm.forward_with_residual(flat, flat)
        head_norm(x)
        rope(positions, x, x[:, :2])
        rope.forward_with_qk_norm(positions, x, x[:, :2], head_norm, head_norm)
        SiluAndMul()(flat)

    with fc.count_launches() as counts:
        run()
    assert counts == {"fused_add_rms_norm": 3, "fused_combine_add_rms_norm": 0, "rotary": 1, "qk_norm_rotary": 1,
                      "silu_and_mul": 1}
    with fc.torch_path(), fc.count_launches() as counts:
        run()
    assert sum(counts.values()) == 0


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_tiny_model_matches_torch_path(variant: str, tiny_model_dir: Callable[[str], Path],
                                       models_registry: PluginRegistry) -> None:
    fc.check_model("cuda", tiny_model_dir(variant), models_registry)


def test_kernels_replay_in_a_cuda_graph() -> None:
    """norm (+ residual), rotary and q/k norm + rotary on qkv views and silu_and_mul captured
    once, replayed on new inputs written into the captured buffers: the same bits as running
    them eagerly."""
    T, H, hq, hkv, d, inter = 8, 512, 8, 2, 64, 1024
    dev, dt = "cuda", torch.bfloat16
    weight = torch.randn(H, device=dev, dtype=dt)
    head_weight = torch.randn(d, device=dev, dtype=dt)
    rope = RotaryEmbedding(d, 4096, _default_inv_freq(10000.0, d)).to(dev)
    x, res = torch.empty(T, H, device=dev, dtype=dt), torch.empty(T, H, device=dev, dtype=dt)
    qkv = torch.empty(T, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    gate_up = torch.empty(T, 2 * inter, device=dev, dtype=dt)
    positions = torch.empty(T, device=dev, dtype=torch.int64)

    def fill(seed: int) -> None:
        g = torch.Generator(device=dev).manual_seed(seed)
        for t in (x, res, qkv, gate_up):
            t.copy_(torch.randn(t.shape, generator=g, device=dev))
        positions.copy_(torch.randint(0, 4096, (T,), generator=g, device=dev))

    def step() -> list[torch.Tensor]:
        q = qkv[:, : hq * d].view(T, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
        out, h = fused_ops.fused_add_rms_norm(x, res, weight, 1e-6)
        rq, rk = fused_ops.rotary(positions, q, k, rope.cos_cached, rope.sin_cached)
        nq, nk = fused_ops.qk_norm_rotary(positions, q, k, head_weight, head_weight, 1e-6, 1e-6,
                                          rope.cos_cached, rope.sin_cached)
        return [out, h, rq, rk, nq, nk, fused_ops.silu_and_mul(gate_up)]

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (1, 2):
        fill(seed)
        graph.replay()
        expected = step()
        torch.cuda.synchronize()
        for got, want in zip(captured, expected, strict=True):
            assert torch.equal(got, want)
