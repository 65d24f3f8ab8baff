"""The ``paged`` Triton backend against the torch reference backend on a CUDA GPU, and CUDA-graph
steps (decode, and three query tokens per sequence on cached context) against eager steps.

Every case draws a fresh random step (pool full of stale finite values, shuffled block tables,
block size 16) and checks: the K/V written into the pool equal the torch backend's exactly; the
output is within half-precision tolerance of the torch backend's and of a float32 reference.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from helpers.paged_cases import PagedStep, make_step
from helpers.reference_attention import ReferenceAttentionBackend

from loom.layers.attention import AttentionMetadata, ForwardContext, forward_context
from loom_plugins.attention.paged_triton import PagedAttentionBackend
from loom_plugins.attention.torch_backend import TorchAttentionBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
# |a - b| <= atol + rtol * |b|: a few ulps of outputs of size ~1.
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=3e-3, rtol=3e-3)}
REL_NORM = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _seqs(mode: str, rng: random.Random) -> list[tuple[int, int]]:
    if mode == "decode":
        return [(rng.randint(0, 800), 1) for _ in range(9)]
    if mode == "prefill":
        return [(0, rng.randint(1, 300)) for _ in range(5)]
    if mode == "cached":  # a suffix on top of cached context (chunked prefill, prefix cache hits)
        return [(rng.randint(1, 600), rng.randint(2, 200)) for _ in range(5)]
    if mode == "verify":  # k + 1 = 4 tokens per sequence on cached context (draft verification)
        return [(rng.randint(1, 600), 4) for _ in range(7)]
    assert mode == "mixed"
    return [(rng.randint(0, 500), 1), (0, rng.randint(2, 200)), (rng.randint(0, 500), 1),
            (rng.randint(1, 400), rng.randint(2, 100)), (rng.randint(0, 500), 1)]


def _check(step: PagedStep, hq: int, hkv: int, d: int, dtype: torch.dtype, window: int | None = None,
           splits: int | None = None, soft_cap: float | None = None) -> None:
    scale = d**-0.5
    extra = {} if soft_cap is None else {"logits_soft_cap": soft_cap}
    ref_cache, torch_cache, cache = step.kv_cache.clone(), step.kv_cache.clone(), step.kv_cache.clone()
    meta = step.meta
    ref = ReferenceAttentionBackend(hq, hkv, d, torch.float32, CUDA).forward(
        step.q.float(), step.k.float(), step.v.float(), ref_cache.float(), meta, None, scale, window, **extra)
    torch_backend = TorchAttentionBackend(hq, hkv, d, dtype, CUDA)
    expect = torch_backend.forward(step.q, step.k, step.v, torch_cache, meta, torch_backend.prepare(meta), scale,
                                   window, **extra)
    backend = PagedAttentionBackend(hq, hkv, d, dtype, CUDA)
    plan = backend.prepare(meta)
    if splits is not None:
        plan = dataclasses.replace(plan, num_splits=splits)
    out = backend.forward(step.q, step.k, step.v, cache, meta, plan, scale, window, **extra)
    torch.cuda.synchronize()
    assert torch.equal(cache, torch_cache), "K/V written to the pool differ from the torch backend's"
    assert torch.isfinite(out).all()
    if soft_cap is None:
        torch.testing.assert_close(out, expect, **TOL[dtype])  # type: ignore[arg-type]
    else:
        # The torch backend caps scores as transformers' eager Gemma 2 does, in the model's dtype:
        # scores of tens rounded to bf16 are off by up to 0.125 before the softmax. The kernel
        # caps float32 scores, so it is held to the float32 reference instead, element by element
        # (bf16 against float32: 0.04 + 2%), and must be at least as close to it as torch is.
        torch.testing.assert_close(out.float(), ref, atol=4e-2, rtol=2e-2)
        rel_torch = ((expect.float() - ref).norm() / ref.norm()).item()
        rel_paged = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel_paged <= max(rel_torch, REL_NORM[dtype] / 4), (rel_paged, rel_torch)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < REL_NORM[dtype], f"relative error {rel:.2e} against the float32 reference"


@pytest.mark.parametrize("mode", ["decode", "prefill", "cached", "verify", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (4, 4)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("d", [64, 128])
def test_matches_torch_backend(mode: str, dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    rng = random.Random(f"{mode}{dtype}{hq}{d}")
    step = make_step(_seqs(mode, rng), num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                     device=CUDA, seed=rng.randrange(1 << 30))
    _check(step, hq, hkv, d, dtype)


@pytest.mark.parametrize("mode", ["decode", "cached", "verify", "mixed"])
def test_sliding_window(mode: str) -> None:
    rng = random.Random(mode)
    step = make_step(_seqs(mode, rng), num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                     device=CUDA, seed=3)
    _check(step, 8, 2, 128, torch.bfloat16, window=100)


@pytest.mark.parametrize("mode", ["decode", "prefill", "cached", "verify", "mixed"])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_soft_capped_scores(mode: str, window: int | None, dtype: torch.dtype) -> None:
    """Gemma 2: scores capped at 50 * tanh(s / 50) (its attn_logit_softcapping), here with queries
    scaled so that the scores reach the cap's bend; Gemma 2's 8 query heads on 4 KV heads of 256."""
    rng = random.Random(f"cap{mode}{window}{dtype}")
    step = make_step(_seqs(mode, rng), num_heads=8, num_kv_heads=4, head_dim=256, dtype=dtype, device=CUDA,
                     seed=rng.randrange(1 << 30))
    step.q.mul_(8.0)  # scores of tens: the cap changes them
    _check(step, 8, 4, 256, dtype, window=window, soft_cap=50.0)


@pytest.mark.parametrize("splits", [None, 2, 16])
@pytest.mark.parametrize("window", [None, 1000])
def test_split_k_decode_long_context(splits: int | None, window: int | None) -> None:
    # Two sequences, 8 KV heads: 16 programs, so the planner splits each context (None = auto).
    seqs = [(4100, 1), (2999, 1)]
    step = make_step(seqs, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device=CUDA, seed=5)
    if splits is None:
        plan = PagedAttentionBackend(32, 8, 128, torch.bfloat16, CUDA).prepare(step.meta)
        assert plan.num_splits > 1
    _check(step, 32, 8, 128, torch.bfloat16, window=window, splits=splits)


def test_llama8b_shape_decode_batch() -> None:
    rng = random.Random(8)
    seqs = [(rng.randint(500, 700), 1) for _ in range(64)]
    step = make_step(seqs, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device=CUDA, seed=8)
    _check(step, 32, 8, 128, torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# CUDA graphs
# ------------------------------------------------------------------------------------------------


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig

    from loom.model_loader.random_model import RandomWeights, init_random_weights
    from loom_plugins.models.llama import LlamaForCausalLM

    shape: dict[str, Any] = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                 max_position_embeddings=1024, rope_theta=10000.0)
    config = LlamaConfig(**shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with CUDA:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    init_random_weights(model, RandomWeights(seed=0, std=0.05))
    return model.eval()


def _meta(tables: list[list[int]], ctx: list[int], new: list[int], page: int) -> AttentionMetadata:
    slots: list[int] = []
    loc = [0]
    for t, c, n in zip(tables, ctx, new, strict=True):
        slots.extend(t[p // page] * page + p % page for p in range(c, c + n))
        loc.append(loc[-1] + n)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    lens = [c + n for c, n in zip(ctx, new, strict=True)]
    return AttentionMetadata(
        query_start_loc=torch.tensor(loc, dtype=torch.int32, device=CUDA),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=CUDA),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=CUDA),
        block_tables=bt.to(CUDA), query_lens_cpu=list(new), seq_lens_cpu=lens,
        max_query_len=max(new), max_seq_len=max(lens), block_size=page)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("query_len", [1, 3], ids=["decode", "q3"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_cuda_graph_step_equals_eager(n: int, query_len: int, kv_cache_dtype: str) -> None:
    with torch.inference_mode():
        _graph_vs_eager(n, query_len, fp8=kv_cache_dtype == "fp8")


def _graph_vs_eager(n: int, q: int, fp8: bool = False) -> None:
    from loom.worker.cuda_graphs import CudaGraphRunner
    from loom.worker.model_runner import StepInputs

    page, max_blocks = 16, 24
    model = _tiny_llama()
    backend = PagedAttentionBackend(8, 2, 64, torch.bfloat16, CUDA)
    if fp8:
        backend.use_fp8_kv_cache()
    caches = backend.allocate_kv_cache(2, 200, page)
    graphs = CudaGraphRunner([1, 2, 4, 8], page, CUDA, query_lens=(1, 3))
    graphs.capture(model, backend, caches, max_blocks)
    assert graphs.captured_query_lens == [1, 3] and len(graphs.graphs) == 8

    rng = random.Random(n * 10 + q)
    free = list(range(200))
    rng.shuffle(free)
    lens = [rng.randint(2, 300) for _ in range(n)]
    tables = [[free.pop() for _ in range(-(-(ln + 3) // page))] for ln in lens]  # room for 3 more tokens
    prompts = [[rng.randrange(3, 1000) for _ in range(ln)] for ln in lens]
    # Prefill every sequence eagerly, then one step of q tokens per sequence on that context.
    meta = _meta(tables, [0] * n, lens, page)
    ids = torch.tensor([t for p in prompts for t in p], device=CUDA)
    pos = torch.cat([torch.arange(ln, device=CUDA) for ln in lens])
    with forward_context(ForwardContext(backend, caches, meta, backend.prepare(meta))):
        model(ids, pos)
    step_ids = torch.tensor([rng.randrange(3, 1000) for _ in range(n * q)], device=CUDA)
    step_pos = torch.cat([torch.arange(ln, ln + q, device=CUDA) for ln in lens])
    before = [c.clone() for c in caches]

    meta = _meta(tables, lens, [q] * n, page)
    with forward_context(ForwardContext(backend, caches, meta, backend.prepare(meta))):
        eager = model(step_ids, step_pos).clone()
    eager_caches = [c.clone() for c in caches]
    for c, b in zip(caches, before, strict=True):
        c.copy_(b)

    hidden = graphs.try_run(StepInputs(step_ids, step_pos, _meta(tables, lens, [q] * n, page)))
    assert hidden is not None and hidden.shape == eager.shape == (n * q, 512)
    torch.cuda.synchronize()
    assert graphs.num_replays == 1
    # Same attention kernels, but the graph may split decode differently (its max_seq_len is the
    # bound) and its matmuls have bs * q rows.
    torch.testing.assert_close(hidden, eager, atol=2e-2, rtol=2e-2)
    # The graph wrote exactly the eager step's K/V, and the padding rows wrote nothing.
    for c, e in zip(caches, eager_caches, strict=True):
        assert torch.equal(c, e)

    # A prefill step, a step of a query length without graphs, a step mixing query lengths, or
    # more sequences than the largest graph: not replayed.
    assert graphs.try_run(StepInputs(ids, pos, _meta(tables, [0] * n, lens, page))) is None
    any_ids = torch.full((27,), 5, device=CUDA)  # token ids and positions of the right length
    two = _meta(tables, lens, [2] * n, page)
    assert graphs.try_run(StepInputs(any_ids[: 2 * n], any_ids[: 2 * n], two)) is None
    if n > 1:
        mixed = _meta(tables, lens, [3] + [1] * (n - 1), page)
        assert graphs.try_run(StepInputs(any_ids[: n + 2], any_ids[: n + 2], mixed)) is None
    many = _meta([tables[0]] * 9, [lens[0]] * 9, [q] * 9, page)
    assert graphs.try_run(StepInputs(any_ids[: 9 * q], any_ids[: 9 * q], many)) is None
    assert graphs.num_replays == 1


# ------------------------------------------------------------------------------------------------
# FP8 KV cache: the FP8 kernel (triton_fp8_attention.py) and the generic kernel's FP8 path
# (LOOM_FP8_KV_KERNEL=0) over the same pool
# ------------------------------------------------------------------------------------------------

FP8_KERNELS = ["fp8_kernel", "generic"]


def _check_fp8(step: PagedStep, hq: int, hkv: int, d: int, kernel: str, window: int | None = None,
               splits: int | None = None, soft_cap: float | None = None) -> None:
    """The pool's bytes after the write are kv_fp8.write's (both divide correctly rounded and
    convert to nearest even), and the output is within half-precision rounding of the float32
    reference over the dequantized pool: a relative error norm under REL_NORM, and no element
    off by more than 0.04 + 2% (a half-precision kernel against float32, where the other tests
    compare two half-precision backends)."""
    from helpers.fp8_kv_cases import pack, reference

    from loom import kernel_switches

    dtype = step.q.dtype
    extra = {} if soft_cap is None else {"logits_soft_cap": soft_cap}
    expected, expected_pool = reference(step, d**-0.5, window, **extra)
    backend = PagedAttentionBackend(hq, hkv, d, dtype, CUDA)
    backend.use_fp8_kv_cache()
    pool = pack(step.kv_cache.float())
    plan = backend.prepare(step.meta)
    if splits is not None:
        plan = dataclasses.replace(plan, num_splits=splits)
    before, kernel_switches.fp8_kv_kernel = kernel_switches.fp8_kv_kernel, kernel == "fp8_kernel"
    try:
        out = backend.forward(step.q, step.k, step.v, pool, step.meta, plan, d**-0.5, window, **extra)
    finally:
        kernel_switches.fp8_kv_kernel = before
    mismatched = (pool != expected_pool).float().mean().item()
    assert mismatched == 0, f"{mismatched:.3%} of the pool's bytes differ from kv_fp8.write's"
    rel = ((out.float() - expected).norm() / expected.norm()).item()
    assert rel < REL_NORM[dtype], f"relative error {rel:.2e} against the float32 reference"
    torch.testing.assert_close(out.float(), expected, atol=4e-2, rtol=2e-2)


@pytest.mark.parametrize("kernel", FP8_KERNELS)
@pytest.mark.parametrize("mode", ["decode", "prefill", "cached", "verify", "mixed"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 8, 128), (9, 3, 64)])
def test_fp8_kv_cache_matches_the_reference_over_what_the_pool_holds(mode: str, hq: int, hkv: int, d: int,
                                                                    kernel: str) -> None:
    """--kv-cache-dtype fp8 on the GPU, bf16 activations: Llama-8B's and SmolLM2's head shapes."""
    rng = random.Random(f"fp8{mode}{hq}")
    step = make_step(_seqs(mode, rng), num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                     device=CUDA, seed=rng.randint(0, 1000))
    _check_fp8(step, hq, hkv, d, kernel)


@pytest.mark.parametrize("kernel", FP8_KERNELS)
@pytest.mark.parametrize("mode", ["decode", "cached", "mixed"])
def test_fp8_kv_cache_fp16_and_windows(mode: str, kernel: str) -> None:
    rng = random.Random(f"fp8w{mode}")
    step = make_step(_seqs(mode, rng), num_heads=16, num_kv_heads=1, head_dim=128, dtype=torch.float16,
                     device=CUDA, seed=rng.randint(0, 1000))
    _check_fp8(step, 16, 1, 128, kernel, window=100)


@pytest.mark.parametrize("kernel", FP8_KERNELS)
@pytest.mark.parametrize("mode", ["decode", "prefill", "mixed"])
def test_fp8_kv_cache_soft_capped_scores(mode: str, kernel: str) -> None:
    """Gemma 2's shape (8 query heads on 4 KV heads of 256), capped scores and a window."""
    rng = random.Random(f"fp8cap{mode}")
    step = make_step(_seqs(mode, rng), num_heads=8, num_kv_heads=4, head_dim=256, dtype=torch.bfloat16,
                     device=CUDA, seed=rng.randint(0, 1000))
    step.q.mul_(8.0)
    _check_fp8(step, 8, 4, 256, kernel, window=100, soft_cap=50.0)


@pytest.mark.parametrize("kernel", FP8_KERNELS)
@pytest.mark.parametrize(("splits", "window"), [(None, None), (4, 1000), (16, None)])
def test_fp8_kv_cache_split_k_long_context(splits: int | None, window: int | None, kernel: str) -> None:
    step = make_step([(4100, 1), (2999, 1), (17, 1)], num_heads=32, num_kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16, device=CUDA, seed=6)
    _check_fp8(step, 32, 8, 128, kernel, window=window, splits=splits)


def test_fp8_kv_cache_llama8b_decode_batch() -> None:
    """W2's shape: sequences of 128 to 1,280 tokens, Llama-8B's heads."""
    rng = random.Random(256)
    seqs = [(rng.randint(127, 1279), 1) for _ in range(128)]
    step = make_step(seqs, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device=CUDA, seed=9)
    _check_fp8(step, 32, 8, 128, "fp8_kernel")
