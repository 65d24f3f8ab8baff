"""How the ``paged`` backend launches a pure decode step: split-K, key tile, warps, stages, merge.

At batch 1-16 a decode step's attention is bound by latency, not bytes: on the H200 one layer of
Qwen3-30B-A3B (4 KV heads of 8 query heads, head 128) at a 512-token context took 6.5 us in
``_paged_attn_kernel`` plus 1.6-1.9 us merging the splits, for 1-2 MB of K/V that the copy rate
reads in under a microsecond (bench/results/profile-random-*-b1.txt). A plan says:

* ``num_splits``: the most pieces a (sequence, KV head)'s keys are cut into (programs along K);
* ``min_keys``: the fewest keys a piece takes. The kernel counts the pieces on the device from
  each sequence's own length, so one plan serves every context: a CUDA graph is captured for
  the engine's longest sequence (its ``max_seq_len`` is that bound), yet a 128-token context
  still runs as one or two pieces, and a key range that fits one piece is written straight to
  the output with no merge;
* ``block_n``, ``num_warps``, ``num_stages``: the key tile and the launch's shape;
* ``fused_combine``: the last piece of each (sequence, KV head) to finish merges the pieces
  (``loom.layers.split_k.last_to_arrive``: an integer counter, the float sums in one fixed
  order), instead of a second launch.

:func:`plan_decode` looks the plan up in the measured table
(:mod:`loom_plugins.attention.decode_plan_table`, filled by ``scripts/bench_decode_plans.py
--fill-table`` from a sweep on the GPU the numbers are for) by the GPU's SM count, the head
layout and the batch size; without an entry (or with ``LOOM_PAGED_DECODE_TABLE=0``) it keeps the rule written before measurement,
:func:`choose_num_splits`, with the launcher's default tile: today's plan, bit for bit. An FP8
pool served by its own kernel has a table of its own (:mod:`loom_plugins.attention.fp8_decode_plans`:
split count, tile, warps, stages; no ``min_keys`` or fused merge); under
``LOOM_FP8_KV_KERNEL=0`` (the generic kernel's FP8 path) it keeps the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom import kernel_switches

from . import decode_plan_table, fp8_decode_plans

# Split-K only pays when each split keeps at least this many keys to read (the rule's guess).
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 16
TABLE_BATCHES = (1, 2, 4, 8, 16)  # the batch sizes the table is measured at (larger: the rule)


@dataclass(frozen=True)
class DecodePlan:
    num_splits: int  # the most pieces a (sequence, KV head)'s keys are cut into; 1: no split-K
    min_keys: int = 0  # the fewest keys a piece takes (a multiple of 16; 0: one key tile)
    block_n: int | None = None  # key tile (None: the launcher's, 64, or 32 for heads over 128)
    num_warps: int | None = None  # None: Triton's default
    num_stages: int | None = None  # None: Triton's default
    fused_combine: bool = False  # the last piece to finish merges the pieces (no second launch)
    max_registers: int | None = None  # the FP8 kernel's cap on registers a thread (None: ptxas's choice)
    prefetch_table: bool = False  # the FP8 kernel loads a tile's block-table entries one iteration ahead


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per decode sequence: enough programs for about two waves over the SMs, but each
    split keeping ``_MIN_KEYS_PER_SPLIT`` keys; a power of two (each value is a compiled variant)."""
    programs = num_seqs * num_kv_heads
    want = -(-2 * num_sms // max(1, programs))
    cap = max(1, max_seq_len // _MIN_KEYS_PER_SPLIT)
    splits = max(1, min(want, cap, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def table_batch(num_seqs: int) -> int | None:
    """The table's batch size that serves ``num_seqs`` sequences (the largest not above it), or
    None past the last one."""
    if num_seqs < 1 or num_seqs > TABLE_BATCHES[-1]:
        return None
    return max(b for b in TABLE_BATCHES if b <= num_seqs)


def measured_plan(num_sms: int, num_kv_heads: int, group: int, head_dim: int, num_seqs: int) -> DecodePlan | None:
    """The table's plan for this GPU, head layout and batch, or None."""
    batch = table_batch(num_seqs)
    if batch is None:
        return None
    entry = decode_plan_table.PLANS.get((num_sms, num_kv_heads, group, head_dim, batch))
    if entry is None:
        return None
    splits, min_keys, block_n, warps, stages, fused = entry
    return DecodePlan(splits, min_keys, block_n, warps, stages, fused and splits > 1)


def plan_decode(num_seqs: int, num_kv_heads: int, group: int, head_dim: int, max_seq_len: int, num_sms: int,
                fp8_pool: bool = False) -> DecodePlan:
    """The decode launch of ``num_seqs`` sequences whose keys number at most ``max_seq_len`` (a
    CUDA graph's bound when capturing). A measured plan keeps at most the pieces the longest
    sequence can fill (a power of two at or above what it needs, so that an eager step cuts each
    sequence into the same pieces as a graph captured for a longer bound)."""
    plan = None
    if kernel_switches.paged_decode_table and not fp8_pool:
        plan = measured_plan(num_sms, num_kv_heads, group, head_dim, num_seqs)
    elif kernel_switches.paged_decode_table and kernel_switches.fp8_kv_kernel:
        entry = fp8_decode_plans.measured_fp8_plan(num_sms, num_kv_heads, group, head_dim, num_seqs)
        if entry is not None:
            splits, block_n, warps, stages, max_registers, prefetch = entry
            plan = DecodePlan(splits, 0, block_n, warps, stages, False, max_registers, prefetch)
    if plan is None:
        return DecodePlan(choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms))
    tile = plan.block_n or (32 if head_dim > 128 else 64)
    need = max(1, -(-max_seq_len // max(plan.min_keys, tile)))
    cap = 1 << (need - 1).bit_length()
    if cap >= plan.num_splits:
        return plan
    return DecodePlan(cap, plan.min_keys, plan.block_n, plan.num_warps, plan.num_stages,
                      plan.fused_combine and cap > 1, plan.max_registers, plan.prefetch_table)
