"""The FP8 kernel's measured decode plans (:mod:`loom_plugins.attention.fp8_decode_plans`).

Written by ``python scripts/bench_fp8_decode_plans.py --fill-table RESULTS.json`` from a sweep run
on the GPU the numbers are for (``--out RESULTS.json``): for each head layout and batch size, the
launch of ``_paged_attn_fp8_kernel`` with the lowest latency over the swept contexts, kept only
where it beat today's rule by the sweep's margin. Empty until measured: every decode launch over
an FP8 pool then keeps the rule (``decode_plans.choose_num_splits`` with
``triton_fp8_attention.fp8_launch_config``'s tile).

Key: (SMs of the GPU, KV heads, query heads per KV head, head size, batch size).
Value: (num_splits, block_n, num_warps, num_stages); None: the launcher's or Triton's default.
"""

from __future__ import annotations

PLANS: dict[tuple[int, int, int, int, int], tuple[int, int | None, int | None, int | None]] = {}
