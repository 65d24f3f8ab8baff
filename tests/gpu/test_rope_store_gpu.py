"""The paged backend's RoPE-and-store launch (``rope_store``) on a GPU: the same bits as the two
launches it replaces (``fused_ops.rotary`` / ``qk_norm_rotary`` then ``store_kv``) at the decode
and prefill shapes of llama-8b and Qwen3-30B-A3B, into a bf16 and an FP8 pool; and engines on tiny
random models (CUDA-graph decode, greedy) with ``LOOM_ROPE_STORE`` off and on give the same tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from loom import kernel_switches
from loom.layers import fused_ops, kv_fp8
from loom.layers.rotary import RopeArgs, RotaryEmbedding, _default_inv_freq

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("tokens", [1, 256, 2048])
@pytest.mark.parametrize(("hq", "hkv", "norm"), [(32, 8, False), (32, 4, True)])  # llama-8b, Qwen3-30B-A3B
@pytest.mark.parametrize("fp8", [False, True])
def test_rope_store_gives_the_two_launches_bits(tokens: int, hq: int, hkv: int, norm: bool, fp8: bool) -> None:
    from loom_plugins.attention.triton_kernels import rope_store, store_kv

    dev, dt, d, page = torch.device("cuda"), torch.bfloat16, 128, 16
    gen = torch.Generator(device=dev).manual_seed(tokens + hkv)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=dev, generator=gen).to(dt)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    rope = RotaryEmbedding(d, 8192, _default_inv_freq(1000000.0, d)).to(dev)
    positions = torch.randint(0, 8192, (tokens,), device=dev, generator=gen)
    blocks = tokens // page + 4
    slots = torch.randperm(blocks * page, device=dev, generator=gen)[:tokens]
    slots[0] = -1
    if norm:
        qw, kw = (1 + 0.2 * torch.randn(2, d, device=dev, generator=gen)).to(dt)
        args = RopeArgs(positions, rope.cos_cached, rope.sin_cached, qw, kw, 1e-6, 1e-6)
        want_q, want_k = fused_ops.qk_norm_rotary(positions, q, k, qw, kw, 1e-6, 1e-6, rope.cos_cached, rope.sin_cached)
    else:
        args = RopeArgs(positions, rope.cos_cached, rope.sin_cached)
        want_q, want_k = fused_ops.rotary(positions, q, k, rope.cos_cached, rope.sin_cached)
    pool = kv_fp8.allocate(blocks, page, hkv, d, dev) if fp8 else torch.randn(2, blocks, page, hkv, d, device=dev).to(dt)
    want_pool = pool.clone()
    store_kv(want_k, v, want_pool, slots)
    got_q = rope_store(q, k, v, pool, slots, args)
    assert torch.equal(got_q, want_q)
    assert torch.equal(pool.view(torch.uint8), want_pool.view(torch.uint8))


def _engine_tokens(model_dir: Path, on: bool, monkeypatch: pytest.MonkeyPatch, kv_dtype: str) -> dict[str, list[int]]:
    from helpers.graph_engine_runs import graph_decode_tokens

    monkeypatch.setattr(kernel_switches, "rope_store", on)
    return graph_decode_tokens(model_dir, kv_dtype, seed=5)


@pytest.mark.parametrize(("variant", "kv_dtype"), [("llama", "auto"), ("qwen3", "auto"), ("qwen3-moe", "fp8"),
                                                   ("gemma3", "auto")])
def test_engine_greedy_same_tokens_with_rope_store_off_and_on(variant: str, kv_dtype: str,
                                                              tiny_model_dir: Callable[[str], Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_model_dir(variant)
    off = _engine_tokens(path, False, monkeypatch, kv_dtype)
    on = _engine_tokens(path, True, monkeypatch, kv_dtype)
    assert on == off
    assert all(len(t) == 24 for t in on.values())
