"""The ``flash`` backend up to the flash-attn call, with a stand-in ``flash_attn`` module.

flash-attn needs CUDA, so these tests check what the backend hands it: tensors, cumulative
lengths, block tables, scale, causality and window, and that K/V land in the pool first.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from helpers.paged_cases import make_step

from loom_plugins.attention import BACKENDS, _check_flash


class FakeFlashAttn(types.ModuleType):
    """Records each call; returns zeros of the shape flash-attn would."""

    def __init__(self) -> None:
        super().__init__("flash_attn")
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def flash_attn_varlen_func(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(("varlen", args, kwargs))
        return torch.zeros_like(args[0])  # [T, Hq, D]

    def flash_attn_with_kvcache(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(("kvcache", args, kwargs))
        return torch.zeros_like(args[0])  # [B, 1, Hq, D]


@pytest.fixture
def fake_flash(monkeypatch: pytest.MonkeyPatch) -> FakeFlashAttn:
    fake = FakeFlashAttn()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    return fake


def _backend(dtype: torch.dtype = torch.bfloat16) -> Any:
    from loom_plugins.attention.flash_attn_backend import FlashAttentionBackend

    return FlashAttentionBackend(8, 2, 64, dtype, torch.device("cpu"))


def test_spec_registered_and_unavailable_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = {s.name: s for s in BACKENDS}
    assert specs["flash"].priority == 20 and specs["flash"].devices == ("cuda",)
    assert specs["paged"].priority == 10 and specs["paged"].devices == ("cuda",)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert _check_flash() == "flash-attn is not installed"
    assert specs["paged"].check() == "triton is not installed"


def test_block_size_must_be_multiple_of_256(fake_flash: FakeFlashAttn) -> None:
    backend = _backend()
    with pytest.raises(ValueError, match="multiple of 256"):
        backend.allocate_kv_cache(1, 4, 16)
    (cache,) = backend.allocate_kv_cache(1, 2, 256)
    assert cache.shape == (2, 2, 256, 2, 64)


def test_rejects_fp32(fake_flash: FakeFlashAttn) -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        _backend(torch.float32)


def test_decode_call(fake_flash: FakeFlashAttn) -> None:
    step = make_step([(300, 1), (5, 1), (511, 1)], num_heads=8, num_kv_heads=2, head_dim=64,
                     block_size=256, dtype=torch.bfloat16)
    backend = _backend()
    cache = step.kv_cache.clone()
    plan = backend.prepare(step.meta)
    assert plan.cu_seqlens_k is None  # decode passes the lengths themselves
    out = backend.forward(step.q, step.k, step.v, cache, step.meta, plan, 0.125, 100)
    assert out.shape == (3, 8, 64)
    ((kind, args, kw),) = fake_flash.calls
    assert kind == "kvcache"
    q, k_cache, v_cache = args
    assert q.shape == (3, 1, 8, 64)
    assert k_cache.data_ptr() == cache[0].data_ptr() and k_cache.shape == cache.shape[1:]
    assert v_cache.data_ptr() == cache[1].data_ptr()
    assert kw["cache_seqlens"] is step.meta.seq_lens
    assert kw["block_table"] is step.meta.block_tables
    assert kw["softmax_scale"] == 0.125 and kw["causal"] is True
    assert kw["window_size"] == (99, 0)
    assert "k" not in kw and "v" not in kw  # the pool already holds the new token
    assert "softcap" not in kw  # only a capping layer passes it (older flash-attn lacks it)
    backend.forward(step.q, step.k, step.v, cache, step.meta, plan, 0.125, 100, logits_soft_cap=50.0)
    assert fake_flash.calls[1][2]["softcap"] == 50.0
    # The new K/V were written before the call.
    flat_k = cache[0].view(-1, 2, 64)
    assert torch.equal(flat_k[step.meta.slot_mapping], step.k)


def test_prefill_call(fake_flash: FakeFlashAttn) -> None:
    step = make_step([(0, 7), (260, 5), (10, 1)], num_heads=8, num_kv_heads=2, head_dim=64,
                     block_size=256, dtype=torch.float16)
    backend = _backend(torch.float16)
    cache = step.kv_cache.clone()
    plan = backend.prepare(step.meta)
    out = backend.forward(step.q, step.k, step.v, cache, step.meta, plan, 0.125, None)
    assert out.shape == (13, 8, 64)
    ((kind, args, kw),) = fake_flash.calls
    assert kind == "varlen"
    q, k_cache, v_cache = args
    assert q.shape == (13, 8, 64)
    assert k_cache.data_ptr() == cache[0].data_ptr() and v_cache.data_ptr() == cache[1].data_ptr()
    assert kw["cu_seqlens_q"].tolist() == [0, 7, 12, 13]
    assert kw["cu_seqlens_k"].tolist() == [0, 7, 272, 283]
    assert kw["cu_seqlens_k"].dtype == torch.int32
    assert kw["max_seqlen_q"] == 7 and kw["max_seqlen_k"] == 265
    assert kw["block_table"] is step.meta.block_tables
    assert kw["causal"] is True and kw["window_size"] == (-1, -1) and kw["softmax_scale"] == 0.125
    flat_v = cache[1].view(-1, 2, 64)
    assert torch.equal(flat_v[step.meta.slot_mapping], step.v)
    # cu_seqlens_k is computed once per step (in prepare) and reused by every layer.
    assert kw["cu_seqlens_k"] is plan.cu_seqlens_k
    backend.forward(step.q, step.k, step.v, cache, step.meta, plan, 0.125, None)
    assert fake_flash.calls[1][2]["cu_seqlens_k"] is kw["cu_seqlens_k"]
