"""A draft model's catch-ups laid out at CUDA-graph widths (``draft_catch_up``) give the drafts
and the KV of the steps as they are (CPU; the GPU's graphs in tests/gpu/test_draft_catch_up_gpu.py).

On CUDA a catch-up of ``T`` tokens replays the graph of width ``Q >= T``, each sequence starting
``Q - T`` positions early with rows whose KV is not written. Here the same plans run eagerly on
the CPU (the proposer told that graphs of every width exist) beside a proposer that runs every
step as it is, through the same calls (W5 b's pattern: catch-ups of 1 to 64 tokens, rejected
guesses rolled back, several sequences a call):

- through Loom's CPU code as it is, the drafts are the same and the pools equal to float32
  rounding: the CPU's BLAS and SDPA round a row differently with the number of rows beside it
  (measured here: up to 1e-5 for a linear layer, 1e-7 for attention);
- with the model made row-invariant (each linear layer row by row, attention row by row from the
  pool), the pools are equal byte for byte: the laid-out plan computes every real token at its
  position over the same keys, and writes nothing else.
- the paged backend's kernels, which do the work on the GPU, give the real rows the same bits
  and the pool the same bytes in Triton's interpreter (with dots row by row, as a GPU's MMA).
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.triton_interpret import run_interpreted

from loom.plugin_api import DraftRequest, ProposerContext, write_kv
from loom_plugins.attention.torch_backend import TorchAttentionBackend
from loom_plugins.speculative import draft_model as dm
from loom_plugins.speculative.draft_catch_up import CATCH_UP_GRAPH_TOKENS, CatchUpGraphs, step_rows

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (1, 2, 16, 32, 64, 128)  # the decode widths and the catch-up ones
SIZES = (1, 2, 4)  # the graphs' batch sizes for --speculate-max-batch-size 4


def _graph_size(n: int, q: int) -> int | None:
    """As ``CudaGraphRunner.graph_size`` with these sizes, within the catch-up row limit."""
    fits = [bs for bs in SIZES if bs >= n and bs * q <= max(CATCH_UP_GRAPH_TOKENS, 2 * SIZES[-1])]
    return fits[0] if fits else None


GRAPHS = CatchUpGraphs(WIDTHS, _graph_size)


def test_a_step_takes_the_smallest_width_that_every_sequence_fills() -> None:
    w = GRAPHS.width
    assert w([5], [300]) == 16 and w([9], [300]) == 16 and w([17], [300]) == 32  # W5 b's catch-ups
    assert w([33], [300]) == 64 and w([65], [300]) == 128
    assert w([1], [40]) == 1 and w([2], [40]) == 2  # decode steps: the graphs of widths 1 and 2
    assert w([1, 2], [40, 50]) == 2 and w([3, 1, 2], [40, 50, 60]) == 16  # mixed steps become uniform
    assert w([16], [16]) == 16  # a prompt of exactly a width: no padding needed
    assert w([65], [100]) is None  # too short to start 63 tokens early
    assert w([5, 3], [300, 12]) is None  # one sequence too short for any width holding 5
    assert w([129], [300]) is None  # longer than every width: eagerly
    assert w([65] * 4, [300] * 4) == 128  # 512 rows: the largest catch-up graph
    assert w([65] * 3, [300] * 3) == 128  # 3 sequences replay the graph of 4
    assert w([65] * 5, [300] * 5) is None  # past the largest batch size
    assert w([33] * 4, [300] * 4) == 64
    assert CatchUpGraphs((1, 2), _graph_size).width([5], [300]) is None  # catch-up graphs off


def test_step_rows_start_early_with_rows_that_write_nothing() -> None:
    tokens = list(range(100, 140))  # 40 tokens, 35 computed
    blocks = [7, 3, 9]
    ids, pos, slots = step_rows(tokens, 35, None, blocks, 16)
    assert ids == tokens[35:] and pos == list(range(35, 40)) and slots == [9 * 16 + p - 32 for p in range(35, 40)]
    ids, pos, slots = step_rows(tokens, 35, 16, blocks, 16)
    assert ids == tokens[24:] and pos == list(range(24, 40))
    assert slots == [-1] * 11 + [9 * 16 + p - 32 for p in range(35, 40)]
    for bad in (4, 41):  # narrower than the new tokens, or longer than the sequence
        with pytest.raises(ValueError, match="does not fit"):
            step_rows(tokens, 35, bad, blocks, 16)


def test_the_torch_backend_skips_slot_minus_one_on_the_cpu() -> None:
    from helpers.paged_cases import make_step

    step = make_step([(20, 6)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    slots = step.meta.slot_mapping.clone()
    step.meta.slot_mapping[:2] = -1  # the first two rows: recomputed, not written
    expected = step.kv_cache.clone()
    write_kv(step.k[2:], step.v[2:], expected, slots[2:])
    backend = TorchAttentionBackend(4, 2, 16, torch.float32, torch.device("cpu"))
    plan = backend.prepare(step.meta)
    assert plan.written is not None and plan.written.tolist() == [2, 3, 4, 5]
    out = backend.forward(step.q, step.k, step.v, step.kv_cache, step.meta, plan, 0.25, None)
    assert torch.equal(step.kv_cache, expected) and torch.isfinite(out).all()
    step.meta.slot_mapping.copy_(slots)
    assert backend.prepare(step.meta).written is None  # every row written: as before


# -- the proposer: laid out against as it is ------------------------------------------------------
@pytest.fixture
def one_thread() -> Iterator[None]:
    """Thousands of tiny ops: intra-op threads only spin (40x slower on two busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _proposers(quantize: str | None) -> tuple[dm.DraftModelProposer, dm.DraftModelProposer]:
    options = {"model_id": "random:tiny-llama", "kv_tokens": "4096"}
    if quantize:
        options["quantize"] = quantize
    context = ProposerContext(num_speculative_tokens=3, vocab_size=1024, device="cpu", dtype="float32",
                              options=options, max_model_len=1024, max_batch_size=SIZES[-1])
    as_is, laid_out = dm.DraftModelProposer(context), dm.DraftModelProposer(context)
    assert as_is._catch_up is None  # the CPU has no graphs
    laid_out._catch_up = GRAPHS  # as if it had: its steps are laid out as on CUDA, and run eagerly
    return as_is, laid_out


def _drive(as_is: dm.DraftModelProposer, laid_out: dm.DraftModelProposer, calls: int, limit: int = 500) -> list[int]:
    """The same propose calls to both (W5 b's pattern and more: catch-ups of 1 to 64 tokens over
    rejected guesses, 1 to 3 sequences a call, restarts); the drafts must agree. Returns the
    widths ``laid_out`` used for catch-ups (steps of more than 2 new tokens)."""
    widths: list[int] = []
    step = laid_out._step

    def recording(seqs: list[Any]) -> list[int]:
        new = [len(st.tokens) - st.computed for st in seqs]
        width = GRAPHS.width(new, [len(st.tokens) for st in seqs])
        if max(new) > 2 and width is not None:
            widths.append(width)
        return step(seqs)

    laid_out._step = recording  # type: ignore[method-assign]
    rng = random.Random(3)
    tokens: dict[int, list[int]] = {}
    for _ in range(calls):
        live = rng.sample(range(4), rng.randint(1, 3))
        for sid in live:
            seq = tokens.setdefault(sid, [rng.randrange(3, 1000) for _ in range(rng.randint(20, limit // 3))])
            seq += [rng.randrange(3, 1000) for _ in range(rng.choice([1, 2, 3, 5, 9, 17, 33, 65]))]
            if len(seq) > limit:
                as_is.release(sid)
                laid_out.release(sid)
                tokens[sid] = seq[-rng.randint(1, limit // 2):]
        requests = [DraftRequest(sid, tokens[sid], 3) for sid in live]
        assert laid_out.propose(requests) == as_is.propose(requests)
    for sid in tokens:
        as_is.release(sid)
        laid_out.release(sid)
    assert as_is.num_free_blocks == as_is.num_blocks and laid_out.num_free_blocks == laid_out.num_blocks
    return widths


def _pools(p: dm.DraftModelProposer) -> list[torch.Tensor]:
    assert p.worker.runner is not None
    return p.worker.runner.kv_caches


@pytest.mark.usefixtures("one_thread")
def test_laid_out_catch_ups_give_the_drafts_of_the_steps_as_they_are() -> None:
    """Loom's CPU code as it is (the fp32 draft: an int4 one runs the same code on dequantized
    weights here; the W4A16 kernels are the GPU test's)."""
    as_is, laid_out = _proposers(None)
    widths = _drive(as_is, laid_out, 30)
    assert {16, 32, 64, 128} <= set(widths)  # every catch-up width was used
    for a, b in zip(_pools(as_is), _pools(laid_out), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)


class _RowByRowAttention(TorchAttentionBackend):
    """Attention computed for each query row alone, from the keys the pool holds at positions
    0..its own: a row's bits then depend on nothing else in its step."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                plan: Any, scale: float, sliding_window: int | None, logits_soft_cap: float | None = None
                ) -> torch.Tensor:
        w = plan.written
        if w is None:
            write_kv(k, v, kv_cache, meta.slot_mapping)
        else:
            write_kv(k[w], v[w], kv_cache, meta.slot_mapping[w])
        bs, g = meta.block_size, self.group_size
        flat_k = kv_cache[0].reshape(-1, self.num_kv_heads, self.head_dim)
        flat_v = kv_cache[1].reshape(-1, self.num_kv_heads, self.head_dim)
        starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        out = torch.empty_like(q)
        for b, length in enumerate(lens):
            pos = torch.arange(length)
            slots = meta.block_tables[b, pos // bs].long() * bs + pos % bs
            keys = flat_k[slots].repeat_interleave(g, 1)  # [L, Hq, D]
            values = flat_v[slots].repeat_interleave(g, 1)
            first, last = starts[b], starts[b + 1]
            for r in range(first, last):
                p = length - (last - first) + (r - first)
                scores = torch.einsum("hd,lhd->hl", q[r].clone(), keys[: p + 1].clone()) * scale
                out[r] = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), values[: p + 1].clone())
        return out


@pytest.mark.usefixtures("one_thread")
def test_laid_out_catch_ups_write_the_kv_bytes_of_the_steps_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the model made row-invariant (linear layers and attention row by row), the pools are
    equal byte for byte: any difference would be the plan's (a row at the wrong position or
    slot, a key it should not see, a write it should not make)."""
    linear = F.linear

    def row_by_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.stack([linear(r.clone(), weight, bias) for r in rows]) if rows.shape[0] else linear(rows, weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    monkeypatch.setattr(F, "linear", row_by_row)
    as_is, laid_out = _proposers(None)
    for p in (as_is, laid_out):
        runner = p.worker.runner
        assert runner is not None
        runner.backend = _RowByRowAttention(4, 2, 16, torch.float32, torch.device("cpu"))
    widths = _drive(as_is, laid_out, 14, limit=300)
    assert {16, 32, 64, 128} <= set(widths)
    for a, b in zip(_pools(as_is), _pools(laid_out), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_paged_kernels_give_laid_out_rows_the_same_bits_in_the_interpreter() -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "paged_padding_interpret_check.py"))
    assert "FAIL" not in stdout and stdout.count("ok") >= 5
