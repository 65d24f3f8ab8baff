"""The paged backend's decode plans on CUDA (``decode_plans.DecodePlan``): every split count, min_keys,
key tile, warps, stages and merge the sweep (scripts/bench_decode_plans.py) may put in the table,
on the four head layouts it measures, against a float32 reference within the bounds of
tests/gpu/test_paged_attention.py; the last-split merge run to run bit for bit, its counters back
at zero, and inside a CUDA graph captured for a long bound, replayed for short and long contexts,
bit for bit the eager launch of the same plan.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytest.importorskip("triton")

from helpers.paged_cases import make_step
from helpers.reference_attention import ReferenceAttentionBackend

from loom.layers.attention import AttentionMetadata
from loom.layers.split_k import counters
from loom_plugins.attention import decode_plan_table
from loom_plugins.attention.decode_plans import DecodePlan
from loom_plugins.attention.paged_triton import PagedAttentionBackend, PagedPlan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
LAYOUTS = [(4, 8, 128), (8, 4, 128), (3, 3, 64), (8, 1, 128)]  # KV heads, query heads each, head size
PLANS = [
    DecodePlan(32, 128, 32, 2, 2, True),
    DecodePlan(16, 0, 64, 4, None, True),
    DecodePlan(8, 256, 16, 1, 1, False),
    DecodePlan(4, 0, 128, 8, 2, True),
    DecodePlan(2, 128, 64, 4, 1, False),
    DecodePlan(1, 0, 32, 2, 2, False),
]


def _plan(backend: PagedAttentionBackend, meta: AttentionMetadata, p: DecodePlan) -> PagedPlan:
    return dataclasses.replace(backend.prepare(meta), num_splits=p.num_splits, min_keys=p.min_keys,
                               block_n=p.block_n, num_warps=p.num_warps, num_stages=p.num_stages,
                               fused_combine=p.fused_combine)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"s{p.num_splits}-mk{p.min_keys}-n{p.block_n}-w{p.num_warps}"
                         f"-st{p.num_stages}-{'fused' if p.fused_combine else 'launch'}")
@pytest.mark.parametrize(("hkv", "group", "d"), LAYOUTS, ids=lambda v: str(v))
def test_plan_matches_reference(plan: DecodePlan, hkv: int, group: int, d: int) -> None:
    rng = random.Random(f"{plan}{hkv}{group}")
    seqs = [(rng.choice([0, 5, 70, 127, 511, 1000, 2047, 4095]), 1) for _ in range(rng.choice([1, 3, 16]))]
    hq = hkv * group
    step = make_step(seqs, num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, device=CUDA,
                     seed=rng.randrange(1 << 30))
    ref_cache, cache = step.kv_cache.float(), step.kv_cache.clone()
    ref = ReferenceAttentionBackend(hq, hkv, d, torch.float32, CUDA).forward(
        step.q.float(), step.k.float(), step.v.float(), ref_cache, step.meta, None, d**-0.5, None)
    backend = PagedAttentionBackend(hq, hkv, d, torch.bfloat16, CUDA)
    p = _plan(backend, step.meta, plan)
    outs = [backend.forward(step.q, step.k, step.v, cache, step.meta, p, d**-0.5, None) for _ in range(3)]
    torch.cuda.synchronize()
    torch.testing.assert_close(outs[0].float(), ref, atol=2e-2, rtol=2e-2)
    rel = ((outs[0].float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.2e} against the float32 reference"
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "the merge is not deterministic run to run"
    ctr = counters(CUDA)
    assert ctr is not None and int(ctr.abs().sum()) == 0, "counters left non-zero"


def _shorter(meta: AttentionMetadata, lens: list[int]) -> AttentionMetadata:
    """The same sequences and block tables with shorter contexts: each new token at its last position."""
    page = meta.block_size
    tables = meta.block_tables.tolist()
    slots = [tables[i][(ln - 1) // page] * page + (ln - 1) % page for i, ln in enumerate(lens)]
    return AttentionMetadata(
        query_start_loc=meta.query_start_loc, seq_lens=torch.tensor(lens, dtype=torch.int32, device=CUDA),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=CUDA), block_tables=meta.block_tables,
        query_lens_cpu=[1] * len(lens), seq_lens_cpu=list(lens), max_query_len=1, max_seq_len=max(lens),
        block_size=page)


def test_fused_merge_inside_a_cuda_graph_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A measured plan picked from the table at capture (bound 4096), replayed for a long and a
    short step over one pool: bit for bit the eager launch of the same plan, padding rows zero,
    the counters back at zero."""
    hq, hkv, d, page, graph_seqs = 32, 4, 128, 16, 4
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    monkeypatch.setattr(decode_plan_table, "PLANS", {(sms, hkv, 8, d, 4): (32, 128, 32, 2, 2, True)})
    backend = PagedAttentionBackend(hq, hkv, d, torch.bfloat16, CUDA)
    backend.init_cuda_graph_state(8, 4096 // page, page, 1)
    meta = backend.capture_metadata(graph_seqs, 1)
    plan = backend.prepare(meta)
    assert plan.fused_combine and plan.num_splits == 32 and plan.min_keys == 128
    counters(CUDA)  # allocated before capture, as the engine's warm-up does
    # tables as wide as the graph's (256 blocks): the eager launches then compile the graph's variant
    step = make_step([(4000, 1), (3, 1), (700, 1)], num_heads=hq, num_kv_heads=hkv, head_dim=d,
                     dtype=torch.bfloat16, device=CUDA, seed=7, extra_table_columns=5)
    pristine = step.kv_cache.clone()
    cache = step.kv_cache.clone()
    q, k, v = (torch.zeros((graph_seqs, *x.shape[1:]), dtype=x.dtype, device=CUDA) for x in (step.q, step.k, step.v))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.forward(q, k, v, cache, meta, plan, d**-0.5, None)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta, plan, d**-0.5, None)
    for lens in ([4001, 4, 701], [10, 2, 129], [17, 300]):
        n = len(lens)
        step_meta = _shorter(step.meta, lens) if n == 3 else _shorter(
            AttentionMetadata(step.meta.query_start_loc[: n + 1], step.meta.seq_lens[:n], step.meta.slot_mapping[:n],
                              step.meta.block_tables[:n], [1] * n, step.meta.seq_lens_cpu[:n], 1, 4001, page), lens)
        new = [torch.randn((n, *x.shape[1:]), device=CUDA).to(x.dtype) for x in (step.q, step.k, step.v)]
        eager_cache = pristine.clone()
        eager_plan = dataclasses.replace(backend.prepare(step_meta), num_splits=32, min_keys=128, block_n=32,
                                         num_warps=2, num_stages=2, fused_combine=True)
        eager = backend.forward(*new, eager_cache, step_meta, eager_plan, d**-0.5, None)
        cache.copy_(pristine)
        for x, src in zip((q, k, v), new, strict=True):
            x.zero_()
            x[:n].copy_(src)
        backend.prepare_replay(step_meta, graph_seqs, 1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:n], eager), f"contexts {lens}: the graph's output is not the eager launch's"
        assert out[n:].abs().max().item() == 0.0, f"contexts {lens}: padding rows attended"
        assert torch.equal(cache, eager_cache), f"contexts {lens}: the graph wrote other K/V"
        ctr = counters(CUDA)
        assert ctr is not None and int(ctr.abs().sum()) == 0
