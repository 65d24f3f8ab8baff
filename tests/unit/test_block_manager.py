"""Block allocator and block manager: exact block ids, refcounts and copy-on-write."""

from __future__ import annotations

import pytest

from loom.engine.block_manager import BlockAllocator, BlockManager, NoFreeBlocksError
from loom.engine.sequence import Sequence
from loom.engine.types import EngineRequest


def seq(n_prompt: int, rid: str = "r") -> Sequence:
    return Sequence(EngineRequest(rid, tuple(range(1, n_prompt + 1))), 0, None)


def test_allocator_hands_out_in_order_and_recycles_at_the_back() -> None:
    a = BlockAllocator(4)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    a.decref(1)
    assert a.allocate() == 3
    assert a.allocate() == 1
    with pytest.raises(NoFreeBlocksError):
        a.allocate()


def test_allocator_refcounts() -> None:
    a = BlockAllocator(2)
    b = a.allocate()
    a.incref(b)
    assert a.refcounts[b] == 2
    a.decref(b)
    assert a.num_free == 1
    a.decref(b)
    assert a.num_free == 2
    with pytest.raises(AssertionError):
        a.decref(b)


def test_prompt_then_decode_allocates_on_block_boundaries() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(6)
    assert bm.num_new_blocks_needed(s, 6) == 2
    bm.append_slots(s, 6)
    assert s.block_table == [0, 1]
    s.num_computed_tokens = 6
    s.token_ids.append(99)
    bm.append_slots(s, 1)  # position 6 fits block 1
    assert s.block_table == [0, 1]
    s.num_computed_tokens = 7
    s.token_ids.append(99)
    bm.append_slots(s, 1)  # position 7 is the last slot of block 1
    s.num_computed_tokens = 8
    assert bm.num_new_blocks_needed(s, 1) == 1
    bm.append_slots(s, 1)
    assert s.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5


def test_free_returns_blocks_in_reverse() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(12)
    bm.append_slots(s, 12)
    assert s.block_table == [0, 1, 2]
    bm.free(s)
    assert s.block_table == [] and s.num_computed_tokens == 0
    # block 3 was never used; then 2, 1, 0 come back in that order
    assert [bm.allocator.allocate() for _ in range(4)] == [3, 2, 1, 0]


def test_fork_shares_blocks_and_copy_on_write() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = seq(6), seq(6)
    bm.append_slots(parent, 6)
    parent.num_computed_tokens = 6
    bm.fork(parent, child)
    assert child.block_table == [0, 1]
    assert bm.allocator.refcounts[:2] == [2, 2]
    # the child writes position 6, inside shared block 1: it gets a private copy
    assert bm.num_new_blocks_needed(child, 1) == 1
    bm.append_slots(child, 1)
    assert child.block_table == [0, 2]
    assert bm.take_blocks_to_copy() == [(1, 2)]
    assert bm.allocator.refcounts[:3] == [2, 1, 1]
    # the parent is now the only owner of block 1: it writes in place
    assert bm.num_new_blocks_needed(parent, 1) == 0
    bm.append_slots(parent, 1)
    assert parent.block_table == [0, 1]
    assert bm.take_blocks_to_copy() == []
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8
    assert bm.allocator.refcounts == [0] * 8


def test_full_shared_block_needs_no_copy() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = seq(8), seq(8)
    bm.append_slots(parent, 8)
    parent.num_computed_tokens = 8
    bm.fork(parent, child)
    assert bm.num_new_blocks_needed(child, 1) == 1  # a fresh block, no copy
    bm.append_slots(child, 1)
    assert child.block_table == [0, 1, 2]
    assert bm.take_blocks_to_copy() == []


def test_decode_fits_agrees_with_num_new_blocks_needed() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    parent, child = seq(6), seq(6)
    bm.append_slots(parent, 6)
    parent.num_computed_tokens = 6
    bm.fork(parent, child)  # block 1 is shared and partly filled: a write there copies it
    lone = seq(8)
    bm.append_slots(lone, 8)
    lone.num_computed_tokens = 8  # its blocks are full: the next token needs a new block
    grown = seq(5)
    bm.append_slots(grown, 5)
    grown.num_computed_tokens = 4  # the next token lands at the start of a block it already has
    for s in (parent, child, lone, grown):
        assert bm.decode_fits(s) == (bm.num_new_blocks_needed(s, 1) == 0), s
    assert [bm.decode_fits(s) for s in (parent, child, lone, grown)] == [False, False, False, True]
    bm.append_slots(child, 1)  # the child's private copy: now the parent owns block 1 alone
    assert bm.decode_fits(parent) and bm.num_new_blocks_needed(parent, 1) == 0
