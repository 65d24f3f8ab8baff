"""The paged backend's measured decode plans (:mod:`loom_plugins.attention.decode_plans`).

Written by ``python scripts/bench_decode_plans.py --fill-table RESULTS.json`` from a sweep run on
the GPU the numbers are for (``--out RESULTS.json``): for each head layout and batch size, the
plan with the lowest latency over the swept contexts (128-4096 keys), kept only where it beat the
rule written before measurement by the sweep's margin. Empty until measured: every decode launch
then keeps that rule.

Key: (SMs of the GPU, KV heads, query heads per KV head, head size, batch size).
Value: (num_splits, min_keys, block_n, num_warps, num_stages, fused_combine); None: the
launcher's or Triton's default.
"""

from __future__ import annotations

PLANS: dict[tuple[int, int, int, int, int], tuple[int, int, int | None, int | None, int | None, bool]] = {}
