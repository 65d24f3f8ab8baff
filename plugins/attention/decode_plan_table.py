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

# From bench/results/gpu-decode-plans-h200.json (NVIDIA H200, bound 4096, cold L2), margin 3%.
PLANS: dict[tuple[int, int, int, int, int], tuple[int, int, int | None, int | None, int | None, bool]] = {
    (132, 4, 8, 128, 1): (16, 128, 128, 8, 2, False),  # qwen3-30b-a3b: 1.06x the rule
    (132, 4, 8, 128, 2): (16, 0, 128, 4, 2, False),  # qwen3-30b-a3b: 1.06x the rule
    (132, 4, 8, 128, 4): (16, 128, 128, 4, 2, False),  # qwen3-30b-a3b: 1.06x the rule
    (132, 4, 8, 128, 8): (8, 0, 128, 4, 2, False),  # qwen3-30b-a3b: 1.08x the rule
    (132, 4, 8, 128, 16): (4, 0, 128, 4, 2, False),  # qwen3-30b-a3b: 1.11x the rule
    (132, 8, 4, 128, 1): (16, 0, 128, 4, 2, False),  # llama-8b: 1.05x the rule
    (132, 8, 4, 128, 2): (16, 128, 128, 4, 2, False),  # llama-8b: 1.04x the rule
    (132, 8, 4, 128, 4): (8, 128, 128, 4, 2, False),  # llama-8b: 1.06x the rule
    (132, 8, 4, 128, 8): (4, 256, 128, 4, 2, True),  # llama-8b: 1.11x the rule
    (132, 8, 4, 128, 16): (2, 0, 128, 4, 2, True),  # llama-8b: 1.18x the rule
    (132, 3, 3, 64, 1): (32, 0, 128, 4, 2, True),  # smollm2: 1.08x the rule
    (132, 3, 3, 64, 2): (32, 0, 128, 4, 2, True),  # smollm2: 1.06x the rule
    (132, 3, 3, 64, 4): (8, 0, 128, 4, 2, True),  # smollm2: 1.06x the rule
    (132, 3, 3, 64, 8): (8, 0, 128, 4, 2, True),  # smollm2: 1.12x the rule
    (132, 3, 3, 64, 16): (8, 0, 128, 4, 2, True),  # smollm2: 1.24x the rule
    (132, 8, 1, 128, 1): (32, 0, 128, 4, 2, True),  # mha-8x128: 1.19x the rule
    (132, 8, 1, 128, 2): (16, 128, 128, 4, 2, True),  # mha-8x128: 1.15x the rule
    (132, 8, 1, 128, 4): (8, 0, 128, 4, 2, True),  # mha-8x128: 1.19x the rule
    (132, 8, 1, 128, 8): (4, 128, 128, 8, 2, True),  # mha-8x128: 1.17x the rule
    (132, 8, 1, 128, 16): (2, 0, 128, 4, 2, True),  # mha-8x128: 1.19x the rule
}
