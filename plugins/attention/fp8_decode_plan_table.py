"""The FP8 kernel's measured decode plans (:mod:`loom_plugins.attention.fp8_decode_plans`).

Written by ``python scripts/bench_fp8_decode_plans.py --fill-table RESULTS.json`` from a sweep run
on the GPU the numbers are for (``--out RESULTS.json``): for each head layout and batch size, the
launch of ``_paged_attn_fp8_kernel`` with the lowest latency over the swept contexts, kept only
where it beat today's rule by the sweep's margin. Empty until measured: every decode launch over
an FP8 pool then keeps the rule (``decode_plans.choose_num_splits`` with
``triton_fp8_attention.fp8_launch_config``'s tile).

Key: (SMs of the GPU, KV heads, query heads per KV head, head size, batch size).
Value: (num_splits, block_n, num_warps, num_stages, max_registers, prefetch_table); None: the
launcher's, Triton's or ptxas's choice. ``max_registers`` (Triton's ``maxnreg``) caps a thread's registers so that more
one-warp programs stay resident on a SM (65,536 registers a SM: 167 a thread allow 12 warps, 128
allow 16), at the price of a few spilled bytes (``scripts/paged_sass.py --fp8-plans``).
``prefetch_table`` loads each key tile's block-table entries one iteration ahead, so that Triton's
pipeliner double-buffers the K/V tiles (twice the shared memory a program).
"""

from __future__ import annotations

# From fp8-decode-plans-h200.json (NVIDIA H200, bound 4096, cold L2), margin 3%.
PLANS: dict[tuple[int, int, int, int, int], tuple[int, int | None, int | None, int | None, int | None, bool]] = {
    (132, 8, 4, 128, 1): (16, 32, 1, 3, None, True),  # llama-8b: 1.09x the rule
    (132, 8, 4, 128, 4): (16, 32, 1, 3, 128, True),  # llama-8b: 1.11x the rule
    (132, 8, 4, 128, 16): (4, 32, 1, 3, None, True),  # llama-8b: 1.24x the rule
    (132, 8, 4, 128, 256): (1, 32, 1, 3, 128, False),  # llama-8b: 1.09x the rule
    (132, 4, 8, 128, 1): (16, 64, 2, 2, None, False),  # qwen3-30b-a3b: 1.06x the rule
    (132, 4, 8, 128, 4): (16, 32, 1, 3, 128, True),  # qwen3-30b-a3b: 1.06x the rule
    (132, 4, 8, 128, 16): (8, 32, 1, 3, 128, True),  # qwen3-30b-a3b: 1.14x the rule
    (132, 4, 8, 128, 64): (1, 64, 1, 3, None, True),  # qwen3-30b-a3b: 1.04x the rule
}
