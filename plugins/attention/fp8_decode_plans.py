"""How the ``paged`` backend launches a pure decode step over an FP8 pool (the kernel of
``triton_fp8_attention.py``): split count, key tile, warps and stages from a measured table.

Today's launch (the rule) gives a decode program one warp, 8 query rows (the ``G`` heads of one
KV head, padded), 64-key tiles read a page at a time and Triton's default stages, with the split
count of ``decode_plans.choose_num_splits``. At batch 256 that is 2048 one-warp programs, and on
the H200 the kernel reads its K/V at ~61% of the copy rate (issue #20). The measured table
(:mod:`loom_plugins.attention.fp8_decode_plan_table`, filled by
``scripts/bench_fp8_decode_plans.py --fill-table``) replaces the rule per (GPU's SM count, head
layout, batch size) where a sweep found a faster launch; ``LOOM_PAGED_DECODE_TABLE=0`` keeps the
rule here too. The kernel's numerics do not depend on the plan (a tile's keys and the split cut
change only where partial sums are taken, as the split-K path always did).
"""

from __future__ import annotations

from . import fp8_decode_plan_table

TABLE_BATCHES = (1, 4, 16, 64, 128, 256)  # the batch sizes the table is measured at


def table_batch(num_seqs: int) -> int | None:
    """The table's batch size that serves ``num_seqs`` sequences: the largest not above it (the
    last one past it: every larger batch is bound by bytes, as the last is)."""
    if num_seqs < 1:
        return None
    return max(b for b in TABLE_BATCHES if b <= num_seqs)


def measured_fp8_plan(num_sms: int, num_kv_heads: int, group: int, head_dim: int,
                      num_seqs: int) -> tuple[int, int | None, int | None, int | None, int | None, bool] | None:
    """The table's (num_splits, block_n, num_warps, num_stages, max_registers, prefetch_table) for
    this GPU, layout and batch, or None."""
    batch = table_batch(num_seqs)
    if batch is None:
        return None
    return fp8_decode_plan_table.PLANS.get((num_sms, num_kv_heads, group, head_dim, batch))
