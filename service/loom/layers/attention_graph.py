"""Static attention metadata for CUDA graphs: buffers at fixed addresses, one set per query length.

A captured graph reads its inputs from the addresses it saw at capture, so the metadata of every
graph of query length ``q`` is a view of one set of buffers sized for the largest graph
(``max_num_seqs`` sequences, ``q`` tokens each):

* ``query_start_loc`` ``[max_num_seqs + 1]`` = ``0, q, 2q, ...``: every sequence has ``q`` query
  tokens, so it never changes after allocation;
* ``seq_lens`` ``[max_num_seqs]``, ``slot_mapping`` ``[max_num_seqs * q]``;
* ``block_tables`` ``[max_num_seqs, max_blocks_per_seq]``, the width fixed by the longest
  sequence the engine admits.

Before a replay the step's own metadata is copied in. Rows past the step's sequences are padding:
``slot_mapping = -1`` (backends skip the K/V write, so the pool is never touched and no dummy
block is needed) and ``seq_lens = 0`` (they attend nothing and read no block-table entry).
Block-table columns past the step's width keep stale ids; kernels read only the
``ceil(seq_len / block_size)`` columns a sequence has.

Host-side fields of the metadata are fixed at capture: ``max_seq_len`` and every entry of
``seq_lens_cpu`` are the upper bound ``max_blocks_per_seq * block_size``; a capturable backend
must not depend on the per-sequence host lists (see ``AttentionBackend.can_capture``).
"""

from __future__ import annotations

import torch

from .attention import AttentionMetadata


class StaticAttentionBuffers:
    """The fixed-address metadata tensors of the CUDA graphs of one query length."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, query_len: int,
                 device: torch.device) -> None:
        if max_num_seqs < 1 or max_blocks_per_seq < 1 or query_len < 1:
            raise ValueError(f"bad CUDA graph buffer shape: {max_num_seqs} sequences, "
                             f"{max_blocks_per_seq} blocks each, query length {query_len}")
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.query_len = query_len
        n, q = max_num_seqs, query_len
        self.query_start_loc = torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=device)  # [n + 1]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [n]
        self.slot_mapping = torch.full((n * q,), -1, dtype=torch.int64, device=device)  # [n * q]
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)

    def metadata(self, num_seqs: int) -> AttentionMetadata:
        """Views for a graph of ``num_seqs`` sequences (``num_seqs * query_len`` tokens)."""
        if not 1 <= num_seqs <= self.max_num_seqs:
            raise ValueError(f"num_seqs {num_seqs} outside 1..{self.max_num_seqs}")
        q = self.query_len
        max_len = self.max_blocks_per_seq * self.block_size
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            slot_mapping=self.slot_mapping[: num_seqs * q],
            block_tables=self.block_tables[:num_seqs],
            query_lens_cpu=[q] * num_seqs,
            seq_lens_cpu=[max_len] * num_seqs,  # upper bounds: placeholders a graph path must not read
            max_query_len=q,
            max_seq_len=max_len,  # the upper bound (the paged backend picks its split count from it)
            block_size=self.block_size,
        )

    def copy_step(self, meta: AttentionMetadata, num_seqs: int) -> None:
        """Copy a step of ``meta.num_seqs <= num_seqs`` sequences, each of ``query_len`` tokens,
        into the buffers of the ``num_seqs`` graph; its remaining rows become padding."""
        n, q = meta.num_seqs, self.query_len
        if n > num_seqs or meta.slot_mapping.shape[0] != n * q:
            raise ValueError(f"a step of {n} sequences and {meta.slot_mapping.shape[0]} tokens does not "
                             f"fit the graph of {num_seqs} sequences of {q} tokens")
        # The runner pads tables to a multiple of 16 columns; columns past the captured width are
        # padding (no sequence is longer than the engine's max_model_len, which the capture covers).
        width = min(meta.block_tables.shape[1], self.max_blocks_per_seq)
        self.slot_mapping[: n * q].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables[:, :width])
        if num_seqs > n:  # a larger step may have left real rows here
            self.slot_mapping[n * q : num_seqs * q].fill_(-1)
            self.seq_lens[n:num_seqs].zero_()
