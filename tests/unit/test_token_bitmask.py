"""The grammar bitmask as a logits processor: equal to a bit-by-bit reference on random rows, for
xgrammar's CPU kernel and the torch fallback; other rows untouched (it masks in place); and
through the sampler, a masked token is never drawn, never listed, and the reported logprobs are
the constrained ones."""

from __future__ import annotations

import math

import pytest
import torch

from loom.sample import processors as P
from loom.sample.batch import SamplingBatch
from loom.sample.processors import TokenBitmask, bitmask_inplace, unpack_bitmask
from loom.sample.sampler import Sampler


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Bit by bit, the way xgrammar documents the layout: bit j of word w is token 32w + j."""
    out = logits.clone()
    words = bitmask.tolist()
    for g, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (words[g][t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def random_case(seed: int, n: int, vocab: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int64).to(torch.int32)
    return logits, bitmask


@pytest.mark.parametrize("backend", ["kernel", "torch"])
@pytest.mark.parametrize(("n", "vocab", "rows"), [
    (5, 77, [0, 2, 3]),  # vocab not a multiple of 32: the last word's spare bits are ignored
    (4, 64, [0, 1, 2, 3]),  # every row, in order: no scatter
    (6, 1000, [5]),
    (3, 33, [1]),
])
def test_processor_equals_the_reference_on_random_rows(backend: str, n: int, vocab: int, rows: list[int],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "torch":
        monkeypatch.setitem(P._KERNELS, "cpu", P._torch_kernel)
    else:
        assert P.bitmask_kernel("cpu") is not P._torch_kernel, "xgrammar's CPU kernel did not load"
    for seed in range(3):
        logits, bitmask = random_case(seed, n, vocab, rows)
        before = logits.clone()
        out = TokenBitmask(bitmask, torch.tensor(rows), rows)(logits)
        assert out is logits  # in place: no copy of the step's logits
        assert torch.equal(out, reference_mask(before, bitmask, rows))
        untouched = [r for r in range(n) if r not in rows]
        assert torch.equal(out[untouched], before[untouched])  # rows without a grammar: bit-identical


def test_unpack_matches_bits_including_the_sign_bit() -> None:
    bitmask = torch.tensor([[-(2**31), 1, -1]], dtype=torch.int32)  # bit 31 only; bit 0 only; all
    allowed = unpack_bitmask(bitmask, 96)[0]
    assert allowed.nonzero().flatten().tolist() == [31, 32, *range(64, 96)]


def test_kernel_and_fallback_agree_with_minus_infinity_only_where_masked() -> None:
    logits, bitmask = random_case(7, 2, 200, [0, 1])
    a, b = logits.clone(), logits.clone()
    bitmask_inplace(a, bitmask)
    P._torch_kernel(b, bitmask, None, None)
    assert torch.equal(a, b)
    kept = unpack_bitmask(bitmask, 200)
    assert torch.equal(torch.isinf(a), ~kept) and torch.equal(a[kept], logits[kept])


def _batch(seeds: list[int], do_sample: bool, max_top_n: int, processors: list[P.LogitsProcessor]) -> SamplingBatch:
    n = len(seeds)
    return SamplingBatch(do_sample=torch.full((n,), do_sample), seeds=torch.tensor(seeds, dtype=torch.int64),
                         steps=torch.zeros(n, dtype=torch.int64), any_sample=do_sample, max_top_n=max_top_n,
                         processors=processors)


@pytest.mark.parametrize("do_sample", [False, True])
def test_sampler_draws_reports_and_lists_only_allowed_tokens(do_sample: bool) -> None:
    vocab, n = 50, 3
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(n, vocab, generator=g) * 3
    allowed = [[3, 7, 40], list(range(vocab)), [49]]  # row 1: no grammar; row 2: one token left
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    for g_row, tokens in ((0, allowed[0]), (1, allowed[2])):
        for t in tokens:
            bitmask[g_row, t // 32] |= 1 << (t % 32)
    mask = TokenBitmask(bitmask, torch.tensor([0, 2]), [0, 2])
    out = Sampler()(logits.clone(), _batch([11, 12, 13], do_sample, 5, [mask]))
    ids = out.token_ids.tolist()
    assert ids[0] in allowed[0] and ids[2] == 49
    plain = Sampler()(logits[1:2], _batch([12], do_sample, 5, []))
    assert ids[1] == plain.token_ids.item()  # the unconstrained row is as without the mask
    # logprobs of the constrained distribution: renormalised over the allowed tokens
    row0 = logits[0, allowed[0]].log_softmax(-1)
    assert out.logprobs[0].item() == pytest.approx(row0[allowed[0].index(ids[0])].item(), abs=1e-5)
    assert out.logprobs[2].item() == pytest.approx(0.0, abs=1e-6)  # the only token left: probability 1
    assert out.logprobs[1].item() == pytest.approx(plain.logprobs.item(), abs=1e-6)
    assert out.top_ids is not None and out.top_logprobs is not None
    listed = [[t for t, lp in zip(i, lps, strict=True) if lp != -math.inf]
              for i, lps in zip(out.top_ids.tolist(), out.top_logprobs.tolist(), strict=True)]
    assert sorted(listed[0]) == sorted(allowed[0]) and listed[2] == [49]  # alternatives: allowed ones only
    assert len(listed[1]) == 5
    assert bool(out.finite.all())
