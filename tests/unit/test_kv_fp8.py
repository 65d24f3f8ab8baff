"""The FP8 KV cache (``--kv-cache-dtype fp8``, loom/layers/kv_fp8.py): the packed format, the torch
backend over it against the float32 reference of what the pool holds, and the engine end to end
(batching, chunked prefill, the prefix cache and preemption do not change a request's tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.fp8_kv_cases import pack, reference, unpack
from helpers.paged_cases import make_step

from loom.config import ConfigError, EngineConfig
from loom.layers import kv_fp8
from loom_plugins.attention.torch_backend import TorchAttentionBackend


def test_rows_keep_their_largest_value_and_e4m3_precision() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-4, 3, 50)[:, None, None]  # 7 decades of scale
    codes, scales = kv_fp8.quantize(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (50, 3)
    back = kv_fp8.dequantize(codes, scales, torch.float32)
    amax = x.abs().amax(-1)
    assert torch.isfinite(back).all()
    torch.testing.assert_close(back.abs().amax(-1), amax, rtol=1e-6, atol=0)  # the row's max is exact
    # e4m3 keeps 3 mantissa bits: a normal value is within half a unit, 2**-4 of itself; values
    # below e4m3's smallest normal (2**-6 of the scale unit) are within 2**-10 of the row's max.
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, amax[..., None] / kv_fp8.FP8_MAX * 2**-9)
    assert (err <= bound * 1.0001).all()


def test_zero_rows_and_views_share_the_pool() -> None:
    pool = kv_fp8.allocate(3, 4, 2, 8, torch.device("cpu"))
    assert pool.shape == (2, 3, 4, 2, 12) and pool.dtype == torch.uint8
    k = torch.zeros(2, 2, 8)
    k[1, 0] = torch.arange(8.0)
    v = -k
    kv_fp8.write(k, v, pool, torch.tensor([5, 11]))
    views = kv_fp8.views(pool)
    assert views.k_codes.shape == views.v_codes.shape == (3, 4, 2, 8)
    assert views.k_scales.shape == views.v_scales.shape == (3, 4, 2)
    assert views.k_scales[1, 1, 0].item() == 0.0  # slot 5 = block 1, offset 1: an all-zero row
    assert views.k_scales[2, 3, 0].item() == pytest.approx(7 / 448)  # slot 11 = block 2, offset 3
    torch.testing.assert_close(unpack(pool)[1, 2, 3, 0], -torch.arange(8.0), rtol=2**-4, atol=0)
    assert kv_fp8.packed_row_bytes(64) == 68
    # The block's codes first, then its scales; keys token-major [bs, Hkv, D], values [Hkv, D, bs].
    flat = pool.view(2, 3, -1)  # [2, nb, block bytes]
    assert torch.equal(flat[0, 2, : 4 * 2 * 8].view(4, 2, 8), views.k_codes[2].view(torch.uint8))
    assert torch.equal(flat[1, 2, : 4 * 2 * 8].view(2, 8, 4), views.v_codes[2].view(torch.uint8).permute(1, 2, 0))
    assert torch.equal(flat[1, 2, 4 * 2 * 8 :].view(torch.float32).view(4, 2), views.v_scales[2])
    big = kv_fp8.views(kv_fp8.allocate(2, 16, 8, 128, torch.device("cpu")))
    assert big.k_scales.stride() == big.v_scales.stride() == (16 * 8 * 33, 8, 1)  # float32 words
    assert big.k_codes.stride() == (16 * 8 * 132, 8 * 128, 128, 1)  # a key's row contiguous
    assert big.v_codes.stride() == (16 * 8 * 132, 1, 128 * 16, 16)  # a value element's tokens contiguous
    # rows of key codes and runs of 16 tokens of value codes start on 16 bytes
    assert all(st % 16 == 0 for st in (*big.k_codes.stride()[:-1], big.v_codes.stride(0), big.v_codes.stride(2),
                                       big.v_codes.stride(3), big.v_codes.storage_offset()))
    # a selection of blocks (what read_blocks and swapping take) keeps the layout
    some = pool.index_select(1, torch.tensor([2]))
    torch.testing.assert_close(unpack(some)[1, 0], unpack(pool)[1, 2])
    with pytest.raises(ValueError, match="divisible by 4"):
        kv_fp8.packed_row_bytes(30)


CASES = [
    ([(0, 1), (5, 1), (20, 1)], 4, 1, 16, None),  # decode, GQA 4
    ([(0, 7), (10, 5)], 4, 2, 32, None),  # prompts and a suffix on cached context
    ([(3, 1), (0, 9), (17, 1), (30, 20)], 8, 2, 32, 7),  # mixed step with a window
    ([(10, 3), (0, 3), (37, 3)], 6, 2, 24, None),  # uniform q = 3 (verification), G = 3
]


@pytest.mark.parametrize(("seqs", "hq", "hkv", "d", "window"), CASES)
def test_torch_backend_attends_over_what_the_pool_holds(seqs: list[tuple[int, int]], hq: int, hkv: int, d: int,
                                                       window: int | None) -> None:
    step = make_step(seqs, num_heads=hq, num_kv_heads=hkv, head_dim=d, seed=len(seqs) + d)
    expected, expected_pool = reference(step, d**-0.5, window)
    backend = TorchAttentionBackend(hq, hkv, d, torch.float32, torch.device("cpu"))
    backend.use_fp8_kv_cache()
    assert not backend.cpu_kernel  # the in-place kernel reads float32 pools only
    pool = pack(step.kv_cache)
    out = backend.forward(step.q, step.k, step.v, pool, step.meta, backend.prepare(step.meta), d**-0.5, window)
    assert torch.equal(pool, expected_pool)  # the same codes and scales, byte for byte
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_backend_sizes_and_refusals() -> None:
    backend = TorchAttentionBackend(4, 2, 64, torch.bfloat16, torch.device("cpu"))
    dense = backend.kv_bytes_per_token_per_layer
    backend.use_fp8_kv_cache()
    assert (dense, backend.kv_bytes_per_token_per_layer) == (2 * 2 * 64 * 2, 2 * 2 * 68)
    (cache,) = backend.allocate_kv_cache(1, 5, 16)
    assert cache.shape == (2, 5, 16, 2, 68) and cache.dtype == torch.uint8
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, fp8, fp8_e4m3; got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")


# -- the engine --------------------------------------------------------------------------------


def run(model_dir: Path, prompts: list[tuple[int, ...]], new: int = 12, **config: Any) -> dict[str, list[int]]:
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    engine = LLMEngine(EngineConfig(model_id=str(model_dir), warmup=False, kv_cache_dtype="fp8", **config))
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, SamplingParams(),
                                         StoppingParams(max_new_tokens=new, ignore_eos=True)))
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return out


def test_engine_tokens_do_not_depend_on_batching_chunking_or_the_prefix_cache(tiny_llama_dir: Path) -> None:
    shared = tuple(range(100, 160))  # 60 tokens: three whole blocks of 16 shared
    prompts = [(*shared, 7, 8, 9), tuple(range(300, 341)), (*shared, 11, 12)]
    alone = {f"r{i}": run(tiny_llama_dir, [p], max_batch_total_tokens=1024,
                          enable_prefix_caching=False)["r0"] for i, p in enumerate(prompts)}
    batched = run(tiny_llama_dir, prompts, max_batch_total_tokens=1024)  # r2 reads r0's cached blocks
    assert batched == alone
    chunked = run(tiny_llama_dir, prompts, max_batch_total_tokens=1024, max_batch_prefill_tokens=24)
    assert chunked == alone
    # a pool of 8 blocks (128 tokens) for 3 sequences of up to 75: preemption and recompute
    tight = run(tiny_llama_dir, prompts, max_batch_total_tokens=128, max_total_tokens=128)
    assert tight == alone


def test_engine_reports_the_format_and_twice_the_tokens(tiny_llama_dir: Path) -> None:
    from loom.engine.llm_engine import LLMEngine

    dense = LLMEngine(EngineConfig(model_id=str(tiny_llama_dir), warmup=False, max_batch_total_tokens=512))
    fp8 = LLMEngine(EngineConfig(model_id=str(tiny_llama_dir), warmup=False, max_batch_total_tokens=512,
                                 kv_cache_dtype="fp8"))
    assert dense.worker.kv_bytes_per_token > 1.8 * fp8.worker.kv_bytes_per_token  # fp32 model: ~3.8x
    assert any(p.startswith("attention:") and "kv_cache_dtype=fp8_e4m3" in p for p in fp8.info.plugins)
    assert not any("kv_cache_dtype" in p for p in dense.info.plugins)


def test_get_model_info_lists_the_kv_format_on_the_attention_plugin() -> None:
    from loom.engine.types import EngineInfo
    from loom.server.model_info import plugins_in_use

    info = EngineInfo("m", "LlamaForCausalLM", "bfloat16", "cuda", "paged", 16, 100, 1600, 4096, 32000, (2,),
                      plugins=("attention:paged?kv_cache_dtype=fp8_e4m3&kv_cache_scales=per_token_and_head",))
    plugins = plugins_in_use(info)
    attention = [p for p in plugins if p.kind == "attention"]
    assert len(attention) == 1 and attention[0].name == "paged"  # settings only: no second entry
    assert dict(attention[0].settings) == {"kv_cache_dtype": "fp8_e4m3", "kv_cache_scales": "per_token_and_head"}


def test_a_backend_without_fp8_support_is_refused_before_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    from loom.preflight import check_engine_config

    monkeypatch.setattr(TorchAttentionBackend, "supports_fp8_kv_cache", False)
    with pytest.raises(ConfigError, match="--attention-backend torch cannot read an FP8 KV cache"):
        check_engine_config(EngineConfig(device="cpu", attention_backend="torch", kv_cache_dtype="fp8"))
    check_engine_config(EngineConfig(device="cpu", attention_backend="torch"))  # the dtype's cache is fine
