"""The KV block manager: a pool of fixed-size blocks with refcounts and per-sequence tables.

GPU-free, so it is unit-tested on CPU. Blocks are handed out from the front of a free list and
returned to its back. A block may be shared (refcount > 1) between the completions of one
request (n > 1 shares the prompt's blocks); writing into a shared block first copies it
(copy-on-write): the caller gets the (src, dst) pairs to copy in the KV pool.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


class BlockAllocator:
    """Free list and refcounts of block ids ``0..num_blocks-1``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.refcounts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("KV pool exhausted")
        block = self._free.popleft()
        assert self.refcounts[block] == 0
        self.refcounts[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self.refcounts[block] > 0, f"incref of free block {block}"
        self.refcounts[block] += 1

    def decref(self, block: int) -> None:
        assert self.refcounts[block] > 0, f"double free of block {block}"
        self.refcounts[block] -= 1
        if self.refcounts[block] == 0:
            self._free.append(block)


class BlockManager:
    """Maps sequences to blocks. ``blocks_to_copy`` collects copy-on-write work for the runner."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.blocks_to_copy: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add (incl. a copy-on-write copy) so ``num_new_tokens`` more tokens fit."""
        total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        extra = max(0, total - len(seq.block_table))
        if self._needs_cow(seq, num_new_tokens):
            extra += 1
        return extra

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def _needs_cow(self, seq: Sequence, num_new_tokens: int) -> bool:
        # The first new token lands in the last block when it is partially filled.
        if num_new_tokens == 0 or seq.num_computed_tokens % self.block_size == 0:
            return False
        last = seq.block_table[seq.num_computed_tokens // self.block_size]
        return self.allocator.refcounts[last] > 1

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (caller checked can_append)."""
        if self._needs_cow(seq, num_new_tokens):
            pos = seq.num_computed_tokens // self.block_size
            old = seq.block_table[pos]
            new = self.allocator.allocate()
            self.allocator.decref(old)
            seq.block_table[pos] = new
            self.blocks_to_copy.append((old, new))
        total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < total:
            seq.block_table.append(self.allocator.allocate())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (n > 1 completions of one prompt)."""
        assert not child.block_table
        for block in parent.block_table:
            self.allocator.incref(block)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        # Free in reverse so the blocks most likely to be reused soon (the prompt's) go last.
        for block in reversed(seq.block_table):
            self.allocator.decref(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies
