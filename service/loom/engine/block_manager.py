"""The KV block manager: a pool of fixed-size blocks, refcounts, per-sequence block tables and
the prefix cache.

GPU-free, so it is unit-tested on CPU.

* Blocks come from the front of a free queue and go back to its end, so the queue is also the
  LRU order of eviction.
* A *full* block whose KV is computed is indexed by a chained hash of its tokens (the previous
  block's hash, its ``block_size`` token ids, and the adapter id, so different LoRA adapters
  never share). A new prompt reuses the longest run of indexed blocks that match, by refcount,
  and computes only the rest. The tokens are stored with the hash and compared on every hit, so
  a hash collision can never hand out the wrong KV.
* A block is indexed as soon as a step is scheduled to fill it, so prompts admitted in the same
  step already share it: every attention backend writes a layer's K/V for all rows before any
  row reads the pool. Until that step has run, such an entry is *pending*: freeing its sequence
  (preemption, abort) or a failed step removes it, so nothing can hit KV that was never written.
* A freed block keeps its hash and content: it can still be hit until it is handed out again,
  which is when it is evicted (removed from the index). Only unreferenced blocks are evicted.
* A partially filled block may be shared by the completions of one request (n > 1); writing
  into a shared block first copies it (copy-on-write): the runner gets the (src, dst) pairs.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from .sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


def block_hash(parent: int, tokens: tuple[int, ...], adapter_id: str = "") -> int:
    """Chained hash of one full block: depends on every token before it through ``parent``."""
    h = xxhash.xxh64(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if adapter_id:
        h.update(adapter_id.encode())
    return h.intdigest()


class BlockAllocator:
    """Free queue (LRU order) and refcounts of block ids ``0..num_blocks-1``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.refcounts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("KV pool exhausted")
        block, _ = self._free.popitem(last=False)
        assert self.refcounts[block] == 0
        self.refcounts[block] = 1
        return block

    def take(self, block: int) -> None:
        """Reference a block: a free one (a prefix-cache hit) leaves the free queue."""
        if self.refcounts[block] == 0:
            del self._free[block]
        self.refcounts[block] += 1

    def incref(self, block: int) -> None:
        assert self.refcounts[block] > 0, f"incref of free block {block}"
        self.refcounts[block] += 1

    def decref(self, block: int) -> None:
        assert self.refcounts[block] > 0, f"double free of block {block}"
        self.refcounts[block] -= 1
        if self.refcounts[block] == 0:
            self._free[block] = None

    def is_free(self, block: int) -> bool:
        return block in self._free


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens whose KV came from the cache
    evictions: int = 0  # cached blocks handed out for new content


class BlockManager:
    """Maps sequences to blocks; optionally shares full blocks through the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks_to_copy: list[tuple[int, int]] = []
        self._index: dict[int, int] = {}  # block hash -> block id
        self._content: dict[int, tuple[int, tuple[int, ...]]] = {}  # block id -> (hash, tokens)
        self._pending: set[int] = set()  # indexed blocks whose step has not run yet
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -----------------------------------------------------------------------------
    def _new_block(self) -> int:
        block = self.allocator.allocate()
        if block in self._content:  # evict: the block gets new content
            self._unindex(block)
            self.stats.evictions += 1
        return block

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add (incl. a copy-on-write copy) so ``num_new_tokens`` more tokens fit."""
        total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        extra = max(0, total - len(seq.block_table))
        if self._needs_cow(seq, num_new_tokens):
            extra += 1
        return extra

    def decode_fits(self, seq: Sequence) -> bool:
        """``num_new_blocks_needed(seq, 1) == 0``, cheaply: the next token has a slot in a block
        ``seq`` owns alone. Runs for every decoding sequence every step."""
        c = seq.num_computed_tokens
        bs = self.block_size
        if c % bs == 0:
            return c < len(seq.block_table) * bs
        return self.allocator.refcounts[seq.block_table[c // bs]] == 1

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
            new = self._new_block()
            self.allocator.decref(old)
            seq.block_table[pos] = new
            self.blocks_to_copy.append((old, new))
        total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < total:
            seq.block_table.append(self._new_block())

    # -- the prefix cache --------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq``'s tokens (at most all but its last token)."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        bs = self.block_size
        # Keep at least one token to compute: its logits choose the next token.
        usable = (seq.num_tokens - 1) // bs
        parent = 0
        hits: list[int] = []
        for i in range(usable):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens, seq.adapter_id)
            block = self._index.get(h)
            if block is None or self._content[block][1] != tokens:  # miss, or a hash collision
                break
            hits.append(block)
            parent = h
        return hits

    def num_blocks_needed_with_prefix(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> int:
        """Blocks a waiting ``seq`` needs to admit ``num_new_tokens`` after ``hits``: new blocks,
        plus hit blocks that are free now (taking them removes them from the free queue)."""
        computed = len(hits) * self.block_size
        fresh = self.blocks_for(computed + num_new_tokens) - len(hits)
        return fresh + sum(1 for b in hits if self.allocator.is_free(b))

    def use_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Start ``seq`` on the cached blocks ``hits`` (from :meth:`match_prefix`)."""
        assert not seq.block_table
        seq.uses_pending_blocks = any(b in self._pending for b in hits)
        for block in hits:
            self.allocator.take(block)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.block_hashes = [self._content[b][0] for b in hits]

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_prompt_tokens
        self.stats.hits += num_hit_tokens

    def register_full_blocks(self, seq: Sequence, num_new_tokens: int = 0) -> None:
        """Index the blocks of ``seq`` that are full once ``num_new_tokens`` more are computed
        (prompt and output alike). With ``num_new_tokens`` > 0 (called when a step is scheduled)
        the new entries stay pending until :meth:`commit_pending`."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # Only blocks whose token ids are all known on the host (a token sampled by a step that
        # has not been read back yet is not).
        known = len(seq.token_ids) - seq.num_pending_tokens
        full = min(seq.num_computed_tokens + num_new_tokens, known) // bs
        hashes = seq.block_hashes
        if len(hashes) >= full:
            return  # the common decode step: no block became full
        while len(hashes) < full:
            i = len(hashes)
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(hashes[-1] if hashes else 0, tokens, seq.adapter_id)
            hashes.append(h)
            block = seq.block_table[i]
            if h not in self._index and block not in self._content:
                self._index[h] = block
                self._content[block] = (h, tokens)
                if i * bs + bs > seq.num_computed_tokens:
                    self._pending.add(block)

    def commit_pending(self) -> None:
        """The scheduled step ran: its pending entries now hold computed KV."""
        self._pending.clear()

    def drop_pending(self) -> None:
        """The scheduled step failed: forget the entries whose KV it was to write."""
        for block in self._pending:
            self._unindex(block)
        self._pending.clear()

    def _unindex(self, block: int) -> None:
        cached = self._content.pop(block, None)
        if cached is not None and self._index.get(cached[0]) == block:
            del self._index[cached[0]]

    # -- sharing and freeing -----------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (n > 1 completions of one prompt)."""
        assert not child.block_table
        for block in parent.block_table:
            self.allocator.incref(block)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        # Free in reverse: the tail of a sequence is the least likely to be shared, so it is
        # evicted first; the prompt's leading blocks stay cached longest.
        for block in reversed(seq.block_table):
            self.allocator.decref(block)
            if block in self._pending and self.allocator.refcounts[block] == 0:
                # scheduled to be filled by a step that will not run for it now
                self._pending.discard(block)
                self._unindex(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Refcounts equal the number of block-table references; free blocks are unreferenced."""
        expected = [0] * self.num_blocks
        for s in seqs:
            for b in s.block_table:
                expected[b] += 1
        assert expected == self.allocator.refcounts, "refcounts differ from the block tables"
        for b in range(self.num_blocks):
            assert self.allocator.is_free(b) == (expected[b] == 0), f"block {b} free/referenced mismatch"
        for h, b in self._index.items():
            assert self._content[b][0] == h, "index and content disagree"
