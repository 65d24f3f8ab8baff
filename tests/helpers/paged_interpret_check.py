"""The ``paged`` backend's Triton kernels on the CPU, through Triton's interpreter.

Run as a script in its own process (``TRITON_INTERPRET`` must be set before the kernels are
defined, and must not leak into a process that compiles them for a GPU). Compares the backend
with the float32 test reference on small random steps and exits non-zero on a mismatch.
``tests/unit/test_paged_triton_interpreter.py`` runs it; so can a developer:
``python tests/helpers/paged_interpret_check.py``.

bf16 dots are not covered here: the interpreter of triton 3.6 computes them wrongly (numpy has
no bf16), so fp16 and fp32 stand in; the GPU tests cover bf16. The FP8 kernel runs its dots in
fp16 whatever the activations, so its bf16 path is checked here too.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()


# (sequences as (context_len, query_len), Hq, Hkv, D, dtype name, window, forced splits, page)
CASES: list[tuple[list[tuple[int, int]], int, int, int, str, int | None, int | None, int]] = [
    ([(0, 1), (5, 1), (20, 1)], 4, 1, 16, "float32", None, None, 16),  # decode, GQA 4
    ([(0, 7), (10, 5)], 4, 2, 32, "float32", None, None, 16),  # prompts and a suffix on context
    ([(3, 1), (0, 9), (17, 1), (30, 20)], 8, 2, 32, "float16", None, None, 16),  # mixed step
    ([(40, 1), (70, 1), (0, 1)], 4, 2, 32, "float32", None, 4, 16),  # split-K, empty splits
    ([(40, 1), (70, 1)], 4, 2, 32, "float32", 9, 2, 16),  # split-K with a window
    ([(3, 1), (0, 30), (17, 1), (30, 20)], 4, 4, 32, "float32", 7, None, 16),  # MHA + window
    ([(3, 1), (0, 30), (17, 1), (30, 20)], 6, 2, 24, "float32", None, None, 4),  # G=3, D=24, page 4
    ([(100, 1), (0, 70)], 2, 2, 16, "float16", None, None, 8),  # prefill spanning query tiles
    ([(10, 3), (0, 3), (37, 3), (64, 3)], 4, 2, 32, "float32", None, None, 16),  # uniform q = 3 on context
    ([(10, 3), (33, 3), (5, 3)], 6, 2, 24, "float16", 6, None, 4),  # the same with a window, G=3, page 4
]


# Gemma 2's soft-capped scores: (sequences, Hq, Hkv, D, dtype, window, forced splits, page, cap)
SOFT_CAP_CASES: list[tuple[list[tuple[int, int]], int, int, int, str, int | None, int | None, int, float]] = [
    ([(3, 1), (0, 30), (17, 1), (30, 20)], 4, 2, 32, "float32", None, None, 16, 2.0),  # mixed step
    ([(3, 1), (0, 30), (17, 1), (30, 20)], 4, 2, 32, "float32", 7, None, 16, 2.0),  # with a window
    ([(40, 1), (70, 1)], 4, 2, 32, "float32", 9, 2, 16, 1.5),  # split-K decode
    ([(10, 3), (0, 3), (37, 3)], 8, 2, 32, "float16", None, None, 16, 3.0),  # uniform q = 3, fp16
    ([(5, 1), (0, 40), (33, 9)], 4, 2, 256, "float32", 6, None, 16, 5.0),  # Gemma 2's heads of 256
]


def run_case(seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, dtype_name: str,
             window: int | None, splits: int | None, page: int, cap: float | None = None) -> tuple[float, float]:
    import torch

    from helpers.paged_cases import make_step
    from helpers.reference_attention import ReferenceAttentionBackend
    from loom_plugins.attention.paged_triton import PagedAttentionBackend

    dtype = getattr(torch, dtype_name)
    step = make_step(seqs, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=page, dtype=dtype,
                     seed=len(seqs) * 31 + d)
    if cap is not None:
        step.q.mul_(3.0)  # scores of several units, where the cap bites
    extra = {} if cap is None else {"logits_soft_cap": cap}
    cpu = torch.device("cpu")
    ref_cache, cache = step.kv_cache.clone(), step.kv_cache.clone()
    ref = ReferenceAttentionBackend(hq, hkv, d, dtype, cpu).forward(
        step.q, step.k, step.v, ref_cache, step.meta, None, d**-0.5, window, **extra)
    backend = PagedAttentionBackend(hq, hkv, d, dtype, cpu)
    plan = backend.prepare(step.meta)
    if splits is not None:
        plan = dataclasses.replace(plan, num_splits=splits)
    out = backend.forward(step.q, step.k, step.v, cache, step.meta, plan, d**-0.5, window, **extra)
    return (out.float() - ref.float()).abs().max().item(), (cache.float() - ref_cache.float()).abs().max().item()


# FP8 KV cache: (sequences, Hq, Hkv, D, dtype, window, forced splits, page, soft cap). Each runs through
# the FP8 kernel (triton_fp8_attention.py) and, but for bf16 (the interpreter's bf16 dots are
# wrong), through the generic kernel's FP8 path (LOOM_FP8_KV_KERNEL=0).
FP8_CASES: list[tuple[list[tuple[int, int]], int, int, int, str, int | None, int | None, int, float | None]] = [
    ([(0, 1), (5, 1), (20, 1)], 4, 1, 16, "float32", None, None, 16, None),  # decode, GQA 4
    ([(3, 1), (0, 9), (17, 1), (30, 20)], 8, 2, 32, "float32", 7, None, 16, None),  # mixed, window
    ([(40, 1), (70, 1), (0, 1)], 4, 2, 32, "float32", None, 4, 16, None),  # split-K, empty splits
    ([(10, 3), (0, 3), (37, 3)], 6, 2, 24, "float16", None, None, 4, None),  # uniform q = 3, fp16, G=3
    ([(150, 1), (70, 1), (0, 1)], 8, 2, 64, "bfloat16", None, None, 16, None),  # bf16 decode, tiles of 4 pages
    ([(90, 1), (0, 40), (130, 6)], 8, 2, 32, "bfloat16", 50, None, 16, None),  # bf16 mixed, window mid-tile
    ([(200, 1), (90, 1)], 16, 1, 32, "float16", 70, 2, 128, None),  # pages longer than a tile, G=16
    ([(3, 1), (0, 30), (17, 1), (30, 20)], 4, 2, 32, "float32", 7, None, 16, 2.0),  # soft cap and window
    ([(70, 1), (0, 40), (33, 9)], 4, 2, 256, "float32", 6, None, 16, 5.0),  # Gemma 2's heads of 256
]


# Values spread over seven decades, some blocks zero: several key tiles per sequence.
FP8_SPREAD_CASES: list[tuple[list[tuple[int, int]], int, int, int, str, int | None, int | None, int, float | None]] = [
    ([(300, 1), (0, 1), (130, 6)], 8, 2, 32, "float32", None, None, 16, None),
    ([(250, 1), (170, 9)], 4, 2, 32, "float16", 150, 2, 8, None),
]


def run_fp8_case(seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, dtype_name: str,
                 window: int | None, splits: int | None, page: int, cap: float | None,
                 generic: bool = False, spread: bool = False) -> tuple[float, bool]:
    """The packed FP8 pool: (output error against the float32 reference over what the pool
    holds, whether the pool's bytes after the write equal ``kv_fp8.write``'s). ``spread``
    scales the values of each block by its own power of ten (10**-4 .. 10**3, some blocks
    zero), so that the kernel's value unit changes from tile to tile and some tiles have none."""
    import torch

    from helpers.fp8_kv_cases import pack, reference
    from helpers.paged_cases import make_step
    from loom import kernel_switches
    from loom_plugins.attention.paged_triton import PagedAttentionBackend

    dtype = getattr(torch, dtype_name)
    step = make_step(seqs, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=page, dtype=dtype,
                     seed=len(seqs) * 17 + d)
    if cap is not None:
        step.q.mul_(3.0)  # scores of several units, where the cap bites
    if spread:
        gen = torch.Generator().manual_seed(d)
        nb = step.kv_cache.shape[1]
        factor = 10.0 ** torch.randint(-4, 4, (nb,), generator=gen).float()
        factor[torch.randperm(nb, generator=gen)[: nb // 4]] = 0.0
        step.kv_cache[1].mul_(factor.to(dtype)[:, None, None, None])
    extra = {} if cap is None else {"logits_soft_cap": cap}
    expected, expected_pool = reference(step, d**-0.5, window, **extra)
    backend = PagedAttentionBackend(hq, hkv, d, dtype, torch.device("cpu"))
    backend.use_fp8_kv_cache()
    pool = pack(step.kv_cache.float())
    plan = backend.prepare(step.meta)
    if splits is not None:
        plan = dataclasses.replace(plan, num_splits=splits)
    before, kernel_switches.fp8_kv_kernel = kernel_switches.fp8_kv_kernel, not generic
    try:
        out = backend.forward(step.q, step.k, step.v, pool, step.meta, plan, d**-0.5, window, **extra)
    finally:
        kernel_switches.fp8_kv_kernel = before
    err = (out.float() - expected).abs()
    if spread:  # relative to each row's largest expected magnitude
        err = err / expected.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return err.max().item(), torch.equal(pool, expected_pool)


def run_fp8_unrounded_case() -> float:
    """The FP8 kernel's fp16 arithmetic under bf16 queries, before the output's rounding: the
    launcher writes a float32 output. Its error against the float32 reference is the fp16
    rounding of the probabilities (the query and the codes convert exactly)."""
    import torch

    from helpers.fp8_kv_cases import pack, reference
    from helpers.paged_cases import make_step
    from loom_plugins.attention.paged_triton import PagedAttentionBackend
    from loom_plugins.attention.triton_fp8_attention import paged_attention_fp8
    from loom_plugins.attention.triton_kernels import store_kv

    step = make_step([(150, 1), (0, 1), (40, 30), (77, 1)], num_heads=8, num_kv_heads=2, head_dim=64,
                     dtype=torch.bfloat16, seed=5)
    expected, _ = reference(step, 0.125, 20)
    pool = pack(step.kv_cache.float())
    store_kv(step.k, step.v, pool, step.meta.slot_mapping)
    plan = PagedAttentionBackend(8, 2, 64, torch.bfloat16, torch.device("cpu")).prepare(step.meta)
    out = torch.zeros(step.q.shape, dtype=torch.float32)
    m = step.meta
    for n, ids, qlen in ((plan.num_decode, plan.decode_ids, 1), (plan.num_prefill, plan.prefill_ids,
                                                                 plan.max_prefill_query_len)):
        paged_attention_fp8(step.q, pool, out, m.query_start_loc, m.seq_lens, m.block_tables, num_seqs=n,
                            seq_ids=ids, max_query_len=qlen, scale=0.125, sliding_window=20)
    return (out - expected).abs().max().item()


# The FP8 kernel's decode plans (fp8_decode_plans: the split count, key tile, warps and stages a
# measured table may choose; the interpreter runs warps and stages as one): (sequences, Hq, Hkv,
# D, dtype, window, page, (num_splits, block_n, num_warps, num_stages, max_registers, prefetch_table)).
FP8_PLAN_CASES: list[tuple[list[tuple[int, int]], int, int, int, str, int | None, int,
                           tuple[int, int | None, int | None, int | None, int | None, bool]]] = [
    ([(150, 1), (70, 1), (0, 1), (300, 1)], 16, 4, 32, "float16", None, 16, (1, 128, 2, 2, None, False)),  # 8 pages a tile
    ([(150, 1), (70, 1), (0, 1), (300, 1)], 32, 4, 32, "float16", None, 16, (2, 256, 4, 3, None, True)),  # 16 pages, G 8
    ([(300, 1), (33, 1)], 8, 2, 32, "float32", None, 16, (4, 128, 4, 2, None, False)),  # float32: the launcher's warps
    ([(260, 1), (90, 1), (5, 1)], 16, 4, 32, "float16", 100, 16, (2, 32, 1, 2, 128, True)),  # window mid-tile, split, 32-key tiles
    ([(200, 1), (90, 1)], 16, 4, 32, "float16", None, 32, (1, 128, 1, 2, None, True)),  # pages of 32: 4 a tile
    ([(200, 1), (90, 1)], 8, 2, 32, "float16", None, 8, (1, 32, 1, 3, 128, False)),  # pages of 8: 4 a tile, registers capped
]


def run_fp8_plan_case(seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, dtype_name: str,
                      window: int | None, page: int,
                      plan_args: tuple[int, int | None, int | None, int | None, int | None, bool]) -> list[str]:
    """An FP8 decode plan through the backend against the reference, and against today's plan
    (the rule) at the same split count: a tile changes where partial sums are taken, not the
    kernel's numerics, so the two agree to a few ulps of the output."""
    import torch

    from helpers.fp8_kv_cases import pack, reference
    from helpers.paged_cases import make_step
    from loom_plugins.attention.paged_triton import PagedAttentionBackend

    dtype = getattr(torch, dtype_name)
    splits, block_n, warps, stages, max_registers, prefetch = plan_args
    step = make_step(seqs, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=page, dtype=dtype,
                     seed=len(seqs) * 13 + d + splits)
    expected, _ = reference(step, d**-0.5, window)
    backend = PagedAttentionBackend(hq, hkv, d, dtype, torch.device("cpu"))
    backend.use_fp8_kv_cache()
    base = dataclasses.replace(backend.prepare(step.meta), num_splits=splits)
    outs = []
    for plan in (dataclasses.replace(base, block_n=block_n, num_warps=warps, num_stages=stages,
                                     max_registers=max_registers, prefetch_table=prefetch), base):
        pool = pack(step.kv_cache.float())
        outs.append(backend.forward(step.q, step.k, step.v, pool, step.meta, plan, d**-0.5, window).float())
    tol = {"float32": 1e-5, "float16": 5e-3}[dtype_name]
    errors = []
    err = (outs[0] - expected).abs().max().item()
    if err > tol:
        errors.append(f"out err {err:.2e}")
    diff = (outs[0] - outs[1]).abs().max().item()
    if diff > tol:
        errors.append(f"differs from the rule's tile by {diff:.2e}")
    return errors


def run_fp8_table_case() -> list[str]:
    """A measured FP8 plan picked from its table by ``prepare`` (and capped at the pieces the
    longest sequence fills), served by the FP8 kernel, equal to the reference; under
    ``LOOM_FP8_KV_KERNEL=0`` (the generic kernel's FP8 path) the table is not read."""
    import torch

    from helpers.fp8_kv_cases import pack, reference
    from helpers.paged_cases import make_step
    from loom import kernel_switches
    from loom_plugins.attention import fp8_decode_plan_table
    from loom_plugins.attention.paged_triton import PagedAttentionBackend

    seqs = [(300, 1), (40, 1), (0, 1), (170, 1)]
    key = (132, 4, 4, 32, 4)  # 16 / 4 heads of 32 at 4 sequences
    fp8_decode_plan_table.PLANS[key] = (4, 128, 2, 3, 128, True)
    errors = []
    try:
        step = make_step(seqs, num_heads=16, num_kv_heads=4, head_dim=32, block_size=16, dtype=torch.float16,
                         seed=11)
        expected, _ = reference(step, 32**-0.5, None)
        backend = PagedAttentionBackend(16, 4, 32, torch.float16, torch.device("cpu"))
        backend.use_fp8_kv_cache()
        plan = backend.prepare(step.meta)
        # 301 keys at most: 3 tiles of 128, so the table's 4 splits are capped at 4 (a power of two)
        got = (plan.num_splits, plan.block_n, plan.num_warps, plan.num_stages, plan.max_registers, plan.prefetch_table)
        if got != (4, 128, 2, 3, 128, True):
            errors.append(f"the table's plan was not used: {plan}")
        out = backend.forward(step.q, step.k, step.v, pack(step.kv_cache.float()), step.meta, plan, 32**-0.5, None)
        err = (out.float() - expected).abs().max().item()
        if err > 5e-3:
            errors.append(f"out err {err:.2e}")
        before, kernel_switches.fp8_kv_kernel = kernel_switches.fp8_kv_kernel, False
        try:
            generic = backend.prepare(step.meta)
        finally:
            kernel_switches.fp8_kv_kernel = before
        if generic.block_n is not None or generic.num_warps is not None:
            errors.append(f"the generic kernel's FP8 path read the FP8 table: {generic}")
    finally:
        del fp8_decode_plan_table.PLANS[key]
    return errors


# Decode plans (decode_plans.DecodePlan) on the head layouts the table is measured for, shrunk:
# (sequences, Hq, Hkv, D, dtype, window, (num_splits, min_keys, block_n, fused_combine)).
PLAN_CASES: list[tuple[list[tuple[int, int]], int, int, int, str, int | None, tuple[int, int, int, bool]]] = [
    ([(40, 1), (200, 1), (0, 1)], 8, 2, 32, "float32", None, (8, 0, 16, True)),  # (2, 4): merged by the last split
    ([(40, 1), (200, 1), (0, 1)], 8, 2, 32, "float32", None, (8, 64, 16, False)),  # min_keys: 1-4 splits, second launch
    ([(15, 1), (130, 1), (70, 1)], 8, 1, 16, "float32", None, (4, 32, 16, True)),  # (1, 8), a 16-key split in one
    ([(90, 1), (33, 1)], 9, 3, 24, "float16", None, (16, 0, 16, True)),  # (3, 3), head size 24, fp16
    ([(90, 1), (160, 1)], 4, 4, 16, "float32", 50, (4, 16, 16, True)),  # (4, 1) with a window
    ([(300, 1), (7, 1)], 8, 2, 32, "float32", None, (2, 128, 32, True)),  # two splits at most, 32-key tiles
]


def run_plan_case(seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, dtype_name: str, window: int | None,
                  plan_args: tuple[int, int, int, bool]) -> list[str]:
    """A decode plan against the reference; the fused merge's counters back at zero after it; and
    the same plan merged by the second launch gives the same output."""
    import torch

    from helpers.paged_cases import make_step
    from helpers.reference_attention import ReferenceAttentionBackend
    from loom.layers.split_k import counters
    from loom_plugins.attention.paged_triton import PagedAttentionBackend

    dtype = getattr(torch, dtype_name)
    splits, min_keys, block_n, fused = plan_args
    step = make_step(seqs, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16, dtype=dtype,
                     seed=len(seqs) * 7 + d + splits)
    cpu = torch.device("cpu")
    ref_cache = step.kv_cache.clone()
    ref = ReferenceAttentionBackend(hq, hkv, d, dtype, cpu).forward(
        step.q, step.k, step.v, ref_cache, step.meta, None, d**-0.5, window)
    backend = PagedAttentionBackend(hq, hkv, d, dtype, cpu)
    plan = dataclasses.replace(backend.prepare(step.meta), num_splits=splits, min_keys=min_keys, block_n=block_n,
                               fused_combine=fused)
    outs = []
    for p in (plan, dataclasses.replace(plan, fused_combine=not fused)):
        cache = step.kv_cache.clone()
        outs.append(backend.forward(step.q, step.k, step.v, cache, step.meta, p, d**-0.5, window))
    errors = []
    err = (outs[0].float() - ref.float()).abs().max().item()
    if err > (5e-3 if dtype_name == "float16" else 1e-5):
        errors.append(f"out err {err:.2e}")
    if not torch.allclose(outs[0], outs[1], rtol=0, atol=1e-6 if dtype_name == "float32" else 1e-3):
        errors.append("the fused merge and the second launch differ")
    ctr = counters(cpu)
    if ctr is None or int(ctr.abs().sum()) != 0:
        errors.append("the merge's counters are not back at zero")
    return errors


def run_table_graph_case() -> list[str]:
    """A measured plan (fused merge, min_keys) picked from the table at "capture" and replayed
    through the graph metadata: the table entry is used, and the graph case's checks hold."""
    from loom_plugins.attention import decode_plan_table

    key = (132, 2, 4, 32, 4)  # the graph case's layout (8 / 2 heads of 32) at 4 sequences
    decode_plan_table.PLANS[key] = (8, 32, 16, 4, 2, True)
    try:
        return run_graph_case(1, "float32", expect_fused=True)
    finally:
        del decode_plan_table.PLANS[key]


def run_padding_case() -> float:
    """CUDA-graph padding rows: slot -1 writes nothing, seq_len 0 attends nothing (output 0)."""
    import torch

    from helpers.paged_cases import make_step
    from loom_plugins.attention.paged_triton import PagedAttentionBackend

    step = make_step([(10, 1), (3, 1), (0, 1)], num_heads=4, num_kv_heads=2, head_dim=16)
    meta = step.meta
    meta.slot_mapping[2] = -1
    meta.seq_lens[2] = 0
    cache = step.kv_cache.clone()
    backend = PagedAttentionBackend(4, 2, 16, torch.float32, torch.device("cpu"))
    out = backend.forward(step.q, step.k, step.v, cache, meta, backend.prepare(meta), 0.25, None)
    written = (cache != step.kv_cache).any(dim=(0, 3, 4)).nonzero().tolist()  # [block, offset] pairs
    assert len(written) == 2, f"expected 2 written slots, got {written}"
    return out[2].abs().max().item()


def run_graph_case(query_len: int, dtype_name: str, expect_fused: bool = False) -> list[str]:
    """The CUDA-graph path without a GPU: the backend's static metadata and the plan made once
    from the capture metadata, replayed for two different steps of ``query_len`` tokens per
    sequence. Real rows must equal the reference, padding rows give 0 and write nothing."""
    import torch

    from helpers.paged_cases import make_step
    from helpers.reference_attention import ReferenceAttentionBackend
    from loom_plugins.attention.paged_triton import PagedAttentionBackend

    dtype = getattr(torch, dtype_name)
    cpu, hq, hkv, d, page, graph_seqs = torch.device("cpu"), 8, 2, 32, 16, 4
    backend = PagedAttentionBackend(hq, hkv, d, dtype, cpu)
    backend.init_cuda_graph_state(6, 64, page, query_len)  # bound 1024 keys: decode gets split-K
    capture_meta = backend.capture_metadata(graph_seqs, query_len)
    plan = backend.prepare(capture_meta)  # fixed at "capture": host values are placeholders
    errors: list[str] = []
    if expect_fused and not (plan.fused_combine and plan.num_splits == 8 and plan.min_keys == 32):
        errors.append(f"the table's plan was not used: {plan}")
    for seed, contexts in ((1, [40, 3, 77]), (2, [0, 100])):
        seqs = [(c, query_len) for c in contexts]
        step = make_step(seqs, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=page, dtype=dtype,
                         seed=seed, extra_table_columns=1)
        n, t, pad_t = len(seqs), len(seqs) * query_len, graph_seqs * query_len
        ref_cache, cache = step.kv_cache.clone(), step.kv_cache.clone()
        ref = ReferenceAttentionBackend(hq, hkv, d, dtype, cpu).forward(
            step.q, step.k, step.v, ref_cache, step.meta, None, d**-0.5, None)
        backend.prepare_replay(step.meta, graph_seqs, query_len)
        gen = torch.Generator().manual_seed(seed)
        # padding rows carry stale (here random) inputs
        q, k, v = (torch.cat([x, torch.randn((pad_t - t, *x.shape[1:]), generator=gen).to(dtype)])
                   for x in (step.q, step.k, step.v))
        out = backend.forward(q, k, v, cache, capture_meta, plan, d**-0.5, None)
        out_err = (out[:t].float() - ref.float()).abs().max().item()
        tol = 5e-3 if dtype_name == "float16" else 1e-5
        if out_err > tol:
            errors.append(f"q={query_len} step {seed}: out err {out_err:.2e}")
        if out[t:].abs().max().item() != 0.0:
            errors.append(f"q={query_len} step {seed}: padding rows attended")
        if not torch.equal(cache, ref_cache):
            errors.append(f"q={query_len} step {seed}: the pool differs from the reference's (padding wrote?)")
        if n < graph_seqs and capture_meta.seq_lens[n:].abs().sum().item() != 0:
            errors.append(f"q={query_len} step {seed}: padding rows kept a sequence length")
    return errors


def main() -> int:
    _setup()
    failures = 0
    for case in [*CASES, *SOFT_CAP_CASES]:
        out_err, cache_err = run_case(*case)
        tol = 5e-3 if case[4] == "float16" else 1e-5  # a few fp16 ulps of outputs ~1
        ok = out_err <= tol and cache_err == 0.0
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {case}: out err {out_err:.2e}, cache err {cache_err:.2e}")
    for fp8_case in FP8_CASES:
        dtype_name = fp8_case[4]
        tol = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 2e-2}[dtype_name]  # a few ulps of outputs ~1
        for generic in (False, True) if dtype_name != "bfloat16" else (False,):
            out_err, same_bytes = run_fp8_case(*fp8_case, generic=generic)
            ok = out_err <= tol and same_bytes
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} fp8 kv ({'generic kernel' if generic else 'fp8 kernel'}) {fp8_case}: "
                  f"out err {out_err:.2e}, pool bytes {'equal' if same_bytes else 'DIFFER'} to kv_fp8.write's")
    for spread_case in FP8_SPREAD_CASES:
        out_err, same_bytes = run_fp8_case(*spread_case, spread=True)
        ok = out_err <= {"float32": 1e-5, "float16": 5e-3}[spread_case[4]] and same_bytes
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} fp8 kv, values spread over 7 decades and zero blocks {spread_case}: "
              f"relative err {out_err:.2e}")
    unrounded = run_fp8_unrounded_case()
    failures += unrounded > 2e-3
    print(f"{'ok  ' if unrounded <= 2e-3 else 'FAIL'} fp8 kernel, bf16 queries, float32 output: err {unrounded:.2e}")
    for fp8_plan_case in FP8_PLAN_CASES:
        errors = run_fp8_plan_case(*fp8_plan_case)
        failures += bool(errors)
        print(f"{'FAIL' if errors else 'ok  '} fp8 decode plan {fp8_plan_case}: "
              f"{'; '.join(errors) or 'equal to the reference and the rule'}")
    errors = run_fp8_table_case()
    failures += bool(errors)
    print(f"{'FAIL' if errors else 'ok  '} fp8 decode plan from the measured table: "
          f"{'; '.join(errors) or 'used, equal to the reference'}")
    for plan_case in PLAN_CASES:
        errors = run_plan_case(*plan_case)
        failures += bool(errors)
        print(f"{'FAIL' if errors else 'ok  '} decode plan {plan_case}: {'; '.join(errors) or 'equal to the reference'}")
    errors = run_table_graph_case()
    failures += bool(errors)
    print(f"{'FAIL' if errors else 'ok  '} graph metadata with a measured plan: {'; '.join(errors) or 'equal to the reference'}")
    pad = run_padding_case()
    failures += pad != 0.0
    print(f"{'ok  ' if pad == 0.0 else 'FAIL'} padding rows: output max {pad}")
    for query_len, dtype_name in ((1, "float32"), (3, "float32"), (3, "float16")):
        errors = run_graph_case(query_len, dtype_name)
        failures += bool(errors)
        print(f"{'FAIL' if errors else 'ok  '} graph metadata, query length {query_len}, {dtype_name}: "
              f"{'; '.join(errors) or 'equal to the reference'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
