"""The ``torch`` attention backend against a naive dense per-sequence reference."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from loom.layers.attention import Attention, AttentionMetadata, ForwardContext, forward_context
from loom_plugins.attention import cpu_kernels, loom_attention_backends
from loom_plugins.attention.torch_backend import TorchAttentionBackend


@pytest.fixture(autouse=True, params=["cpu-kernel", "gather"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs twice on the CPU: fp32 decode through the compiled in-place kernel, and
    through the gather + SDPA path it falls back to (LOOM_CPU_KERNELS=0)."""
    if request.param == "gather":
        monkeypatch.setenv("LOOM_CPU_KERNELS", "0")
    elif not cpu_kernels.cpu_decode_kernel_available():
        pytest.skip(f"the CPU kernel could not be built here: {cpu_kernels.unavailable_reason()}")
    return str(request.param)


@dataclass
class Case:
    """A step: the inputs for the backend plus the ground-truth full K/V of every sequence."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata
    full_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    full_v: list[torch.Tensor]


def make_case(
    seqs: list[tuple[int, int]],  # (context_len, query_len) per sequence, in batch order
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int = 0,
    spare_blocks: int = 7,
    device: str = "cpu",
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + q for c, q in seqs]
    query_lens = [q for _, q in seqs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    # Finite garbage everywhere the step does not write: stale K/V of finished sequences.
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # non-contiguous, unordered block tables
    max_blocks = max(blocks_per_seq) + 2  # extra zero-padded columns, as a runner may leave
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    flat_k = kv_cache[0].view(-1, num_kv_heads, head_dim)
    flat_v = kv_cache[1].view(-1, num_kv_heads, head_dim)
    qs, ks, vs, slots, full_k, full_v = [], [], [], [], [], []
    for i, ((ctx, ql), sl) in enumerate(zip(seqs, seq_lens, strict=True)):
        own = [ids.pop() for _ in range(blocks_per_seq[i])]
        tables[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
        pos = torch.arange(sl)
        seq_slots = torch.tensor(own)[pos // block_size] * block_size + pos % block_size
        fk = torch.randn(sl, num_kv_heads, head_dim, generator=gen)
        fv = torch.randn(sl, num_kv_heads, head_dim, generator=gen)
        flat_k[seq_slots[:ctx]] = fk[:ctx]  # the cached context is already in the pool
        flat_v[seq_slots[:ctx]] = fv[:ctx]
        full_k.append(fk)
        full_v.append(fv)
        qs.append(torch.randn(ql, num_heads, head_dim, generator=gen))
        ks.append(fk[ctx:])
        vs.append(fv[ctx:])
        slots.append(seq_slots[ctx:])
    loc = [0]
    for ql in query_lens:
        loc.append(loc[-1] + ql)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.cat(slots).to(torch.int64),
        block_tables=tables,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    case = Case(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, meta, full_k, full_v)
    return case if device == "cpu" else to_device(case, device)


def to_device(case: Case, device: str) -> Case:
    m = case.meta
    meta = AttentionMetadata(
        query_start_loc=m.query_start_loc.to(device),
        seq_lens=m.seq_lens.to(device),
        slot_mapping=m.slot_mapping.to(device),
        block_tables=m.block_tables.to(device),
        query_lens_cpu=m.query_lens_cpu,
        seq_lens_cpu=m.seq_lens_cpu,
        max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len,
        block_size=m.block_size,
    )
    return Case(case.q.to(device), case.k.to(device), case.v.to(device), case.kv_cache.to(device), meta,
                case.full_k, case.full_v)


def reference(case: Case, scale: float, sliding_window: int | None,
              soft_cap: float | None = None) -> torch.Tensor:
    """Dense causal attention per sequence on its full K/V, in float64. [T, Hq, D]."""
    meta = case.meta
    outs = []
    for i, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        lo = sum(meta.query_lens_cpu[:i])
        q = case.q[lo : lo + ql].cpu().double().transpose(0, 1)  # [Hq, Lq, D]
        group = q.shape[0] // case.full_k[i].shape[1]
        k = case.full_k[i].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Lk, D]
        v = case.full_v[i].double().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(sl - ql, sl)[:, None]
        k_pos = torch.arange(sl)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window  # HF: the last `window` positions, self included
        scores = (q @ k.transpose(1, 2)) * scale  # [Hq, Lq, Lk]
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1))  # [Lq, Hq, D]
    return torch.cat(outs)


def run_backend(case: Case, num_heads: int, num_kv_heads: int, head_dim: int,
                sliding_window: int | None, **extra: float) -> torch.Tensor:
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, case.q.dtype, case.q.device)
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, case.meta, backend.prepare(case.meta),
                          head_dim**-0.5, sliding_window, **extra)
    return out.cpu()


# CUDA runs where a GPU is present (the same SDPA code path, other kernels underneath).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ]),
]


# Decode sequences (query_len 1) around a fresh prefill and a prefill of a suffix on top of cached
# context, so the decode rows are not consecutive.
MIXED = [(37, 1), (0, 23), (5, 1), (19, 11), (64, 1), (0, 1), (16, 1)]


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3)])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_matches_reference(block_size: int, head_dim: int, num_heads: int,
                                       num_kv_heads: int, sliding_window: int | None, device: str) -> None:
    case = make_case(MIXED, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, seed=block_size + head_dim + num_heads, device=device)
    before = case.kv_cache.cpu()
    out = run_backend(case, num_heads, num_kv_heads, head_dim, sliding_window)
    assert out.shape == case.q.shape and out.dtype == torch.float32
    expected = reference(case, head_dim**-0.5, sliding_window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)

    # The new K/V landed in their slots, and nothing else in the pool changed.
    flat = case.kv_cache.cpu().view(2, -1, num_kv_heads, head_dim)
    slots = case.meta.slot_mapping.cpu()
    assert torch.equal(flat[0, slots], case.k.cpu())
    assert torch.equal(flat[1, slots], case.v.cpu())
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before.view_as(flat)[:, untouched])


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("sliding_window", [None, 1, 8, 30])
@pytest.mark.parametrize("device", DEVICES)
def test_pure_decode_batch(block_size: int, sliding_window: int | None, device: str) -> None:
    seqs = [(c, 1) for c in (0, 3, 15, 16, 17, 40, 63, 100)]
    case = make_case(seqs, block_size=block_size, num_heads=9, num_kv_heads=3, head_dim=64, seed=3,
                     device=device)
    out = run_backend(case, 9, 3, 64, sliding_window)
    torch.testing.assert_close(out.double(), reference(case, 64**-0.5, sliding_window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("seqs", [[(0, 33)], [(0, 9), (12, 20)], [(40, 17)]])
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_only(seqs: list[tuple[int, int]], sliding_window: int | None, device: str) -> None:
    case = make_case(seqs, block_size=8, num_heads=9, num_kv_heads=3, head_dim=64, seed=5, device=device)
    out = run_backend(case, 9, 3, 64, sliding_window)
    torch.testing.assert_close(out.double(), reference(case, 64**-0.5, sliding_window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("seqs", [MIXED, [(c, 1) for c in (0, 3, 40, 100)], [(0, 33)]],
                         ids=["mixed", "decode", "prefill"])
def test_soft_capped_scores_match_reference(seqs: list[tuple[int, int]], sliding_window: int | None) -> None:
    """Gemma 2's cap * tanh(score / cap), on every path (decode groups, in-place kernel's steps,
    prefills with and without context), 8x8 heads and GQA."""
    for heads, kv_heads in ((4, 4), (9, 3)):
        case = make_case(seqs, block_size=8, num_heads=heads, num_kv_heads=kv_heads, head_dim=32, seed=11)
        case.q.mul_(4.0)  # scores of several units: the cap changes them
        out = run_backend(case, heads, kv_heads, 32, sliding_window, logits_soft_cap=2.0)
        expected = reference(case, 32**-0.5, sliding_window, soft_cap=2.0)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        uncapped = reference(case, 32**-0.5, sliding_window)
        assert (expected - uncapped).abs().max() > 0.05  # the cap matters at these scores


def test_sliding_window_matches_hf_semantic() -> None:
    # Window 4: the query at position 9 sees keys 6..9 only. Give those keys zero values and all
    # others huge values: any off-by-one leaks a huge value into the output.
    case = make_case([(9, 1)], block_size=4, num_heads=2, num_kv_heads=1, head_dim=8, seed=1)
    case.full_v[0][:6] = 1e4
    case.full_v[0][6:] = 0.0
    flat_v = case.kv_cache[1].view(-1, 1, 8)
    table = case.meta.block_tables[0].long()
    pos = torch.arange(9)
    flat_v[table[pos // 4] * 4 + pos % 4] = case.full_v[0][:9]
    case.v.zero_()
    out = run_backend(case, 2, 1, 8, sliding_window=4)
    assert out.abs().max().item() == 0.0
    out_full = run_backend(case, 2, 1, 8, sliding_window=None)
    assert out_full.abs().max().item() > 1.0  # without the window the early keys are seen


def test_sequence_result_does_not_depend_on_batch() -> None:
    """Greedy tokens must not change with batch composition: same sequence, alone vs batched."""
    seqs = [(70, 1), (9, 1), (130, 1), (0, 12), (33, 1)]
    batched = make_case(seqs, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, seed=11)
    out_b = run_backend(batched, 9, 3, 64, None)
    for i in range(len(seqs)):
        # The same sequence (same pool, same block table row) as a batch of one.
        lo, ql = int(batched.meta.query_start_loc[i]), batched.meta.query_lens_cpu[i]
        sl = batched.meta.seq_lens_cpu[i]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, ql], dtype=torch.int32),
            seq_lens=torch.tensor([sl], dtype=torch.int32),
            slot_mapping=batched.meta.slot_mapping[lo : lo + ql],
            block_tables=batched.meta.block_tables[i : i + 1],
            query_lens_cpu=[ql],
            seq_lens_cpu=[sl],
            max_query_len=ql,
            max_seq_len=sl,
            block_size=16,
        )
        backend = TorchAttentionBackend(9, 3, 64, torch.float32, torch.device("cpu"))
        sl_ = slice(lo, lo + ql)
        out_1 = backend.forward(batched.q[sl_], batched.k[sl_], batched.v[sl_], batched.kv_cache, meta,
                                backend.prepare(meta), 64**-0.5, None)
        torch.testing.assert_close(out_1, out_b[sl_], atol=1e-6, rtol=0)


def test_the_cpu_kernel_is_used_for_fp32_decode_only(decode_path: str) -> None:
    fp32 = TorchAttentionBackend(9, 3, 64, torch.float32, torch.device("cpu"))
    assert fp32.cpu_kernel == (decode_path == "cpu-kernel")
    assert not TorchAttentionBackend(9, 3, 64, torch.bfloat16, torch.device("cpu")).cpu_kernel


def test_cpu_kernel_rejects_tables_too_short_and_bad_block_ids(decode_path: str) -> None:
    if decode_path != "cpu-kernel":
        pytest.skip("kernel argument checks")
    q = torch.randn(2, 4, 16)
    cache = torch.randn(2, 6, 4, 2, 16)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        cpu_kernels.paged_decode_attention(q, cache, torch.zeros(2, 2, dtype=torch.int32),
                                           torch.tensor([9, 3], dtype=torch.int32), 0.25, None)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.paged_decode_attention(q, cache, torch.tensor([[0, 6], [1, 2]], dtype=torch.int32),
                                           torch.tensor([8, 3], dtype=torch.int32), 0.25, None)
    k = torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match="slot 24 out of range"):
        cpu_kernels.write_kv(k, k, cache, torch.tensor([3, 24]))
    cpu_kernels.write_kv(k, k + 1, cache, torch.tensor([3, 23]))
    assert torch.equal(cache[0, 0, 3], k[0]) and torch.equal(cache[1, 5, 3], k[1] + 1)


def test_plan_is_built_once_per_step_and_shared_by_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers with their own caches read the one plan of the forward context."""
    seqs = [(20, 1), (0, 6), (3, 1)]
    case = make_case(seqs, block_size=8, num_heads=4, num_kv_heads=2, head_dim=16, seed=2)
    backend = TorchAttentionBackend(4, 2, 16, torch.float32, torch.device("cpu"))
    caches = [case.kv_cache, case.kv_cache.clone()]
    layers = [Attention(i, 4, 2, 16) for i in range(2)]
    t = case.q.shape[0]
    plan = backend.prepare(case.meta)
    assert len(plan.prefills) == 1 and sum(g.num_seqs for g in plan.decodes) == 2
    seen: list[object] = []
    forward = backend.forward
    monkeypatch.setattr(backend, "forward", lambda *a: seen.append(a[5]) or forward(*a))
    with forward_context(ForwardContext(backend, caches, case.meta, plan)):
        out0 = layers[0](case.q.reshape(t, -1), case.k.reshape(t, -1), case.v.reshape(t, -1))
        out1 = layers[1](case.q.reshape(t, -1), case.k.reshape(t, -1), case.v.reshape(t, -1))
    assert len(seen) == 2 and all(p is plan for p in seen)
    expected = reference(case, 16**-0.5, None).reshape(t, -1)
    torch.testing.assert_close(out0.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out1.double(), expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_runs_close_to_reference() -> None:
    case = make_case(MIXED, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, seed=4)
    expected = reference(case, 64**-0.5, None)
    case.q, case.k, case.v = case.q.bfloat16(), case.k.bfloat16(), case.v.bfloat16()
    case.kv_cache = case.kv_cache.bfloat16()
    backend = TorchAttentionBackend(9, 3, 64, torch.bfloat16, torch.device("cpu"))
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, case.meta, backend.prepare(case.meta), 64**-0.5,
                          None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_plugin_spec() -> None:
    specs = {s.name: s for s in loom_attention_backends()}
    spec = specs["torch"]
    assert spec.devices == ("cpu", "cuda") and spec.priority == 0 and spec.check() is None
    assert spec.load() is TorchAttentionBackend


def test_rejects_head_counts_that_do_not_group() -> None:
    with pytest.raises(ValueError, match="multiple"):
        TorchAttentionBackend(9, 4, 64, torch.float32, torch.device("cpu"))


def test_decode_sequences_are_grouped_by_length() -> None:
    from loom_plugins.attention.torch_backend import _length_groups

    lens = [100, 98, 97, 96, 30, 29, 28, 27, 99, 3]
    groups = _length_groups(list(range(10)), lens)
    # longest first; a group closes where a length drops under 0.75 x its longest (once it has 4);
    # the 1-sequence tail joins the group before it; inside a group, step order
    assert groups == [[0, 1, 2, 3, 8], [4, 5, 6, 7, 9]]
    assert _length_groups([0, 1, 2], [500, 3, 40]) == [[0, 1, 2]]  # small batches stay whole
