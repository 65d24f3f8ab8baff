"""Loom's CPU bitmask kernel (loom/sample/csrc/cpu_bitmask.cpp): the same logits as the torch
path for masks of whole-ones, whole-zeros and mixed words, on every row or a subset, for a
vocabulary that does and does not fill its last word; bad shapes are refused."""

from __future__ import annotations

import pytest
import torch

from loom.sample import cpu_bitmask
from loom.sample.processors import _torch_kernel, bitmask_kernel

pytestmark = pytest.mark.skipif(not cpu_bitmask.available(), reason="no C++ compiler for the CPU kernels")


def _mask(n: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 3, (n, words), generator=g)  # 0: all zeros, 1: all ones, 2: mixed bits
    mixed = torch.randint(-(2**31), 2**31 - 1, (n, words), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.where(kind == 0, torch.zeros_like(mixed), torch.where(kind == 1, torch.full_like(mixed, -1), mixed))


@pytest.mark.parametrize("vocab", [49152, 1000, 33])
@pytest.mark.parametrize("subset", [False, True])
def test_word_wise_kernel_masks_as_the_torch_path(vocab: int, subset: bool) -> None:
    n, words = 9, -(-vocab // 32)
    logits = torch.randn(n, vocab)
    mask = _mask(n, words, seed=vocab)
    rows = torch.tensor([0, 3, 4, 8]) if subset else None
    expected = logits.clone()
    _torch_kernel(expected, mask, rows, rows.tolist() if rows is not None else None)
    got = logits.clone()
    cpu_bitmask.apply_bitmask_(got, mask, rows)
    assert torch.equal(got, expected)
    if subset:  # rows left out are untouched
        assert torch.equal(got[1], logits[1])
    assert bitmask_kernel("cpu") is not _torch_kernel  # the engine's CPU path uses a kernel


def test_bad_shapes_are_refused() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="rows for 2 rows"):
        cpu_bitmask.apply_bitmask_(logits, torch.zeros(3, 2, dtype=torch.int32), None)
    with pytest.raises(RuntimeError, match="words a row for a vocabulary of 64"):
        cpu_bitmask.apply_bitmask_(logits, torch.zeros(2, 3, dtype=torch.int32), None)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_bitmask.apply_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_bitmask.apply_bitmask_(logits.double(), torch.zeros(2, 2, dtype=torch.int32), None)
