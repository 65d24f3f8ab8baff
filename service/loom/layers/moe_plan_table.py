"""Measured tile plans of the MoE experts' two kernels at one token (``fused_moe_triton``).

A one-token step runs its ``k`` experts straight from the routing's ids (``direct_experts``):
``k`` blocks of one row each, so the grid is ``k x (output tiles)`` and nothing but the tiling
decides how the weights stream. ``block_config``'s decode tiles (16 x 64 x 128, 4 warps, 4
stages for both kernels) were written before measurement; on the H200 they left the gate/up
kernel at 87% and the down kernel at 75% of the copy bandwidth (2026-12-03 profile). This
table, filled from ``python3 scripts/bench_moe_plans.py --out RESULTS.json`` on the GPU the
numbers are for (the sweep prints the entry), gives each kernel its own tiles.

A plan changes the tiling of the outputs and the software pipeline, never a row's reduction
order: every output is the chain of the dot's k16 steps over K in increasing order (BLOCK_K
only groups them), so a token's expert rows are the same bits with any plan of the table as
with the sorted path's tiles in a larger batch (``tests/gpu/test_fused_moe_gpu.py`` checks it).

Key: (SMs of the GPU, hidden size, intermediate size per rank, dtype name). Value: the gate/up
kernel's (block_n, block_k, num_warps, num_stages), then the down kernel's. Empty until
measured: every shape keeps ``block_config``'s tiles.
"""

from __future__ import annotations

PlanTiles = tuple[int, int, int, int]  # block_n, block_k, num_warps, num_stages

PLANS: dict[tuple[int, int, int, str], tuple[PlanTiles, PlanTiles]] = {
    (132, 2048, 768, 'bfloat16'): ((64, 128, 4, 4), (64, 128, 4, 4)),  # gpu-moe-plans-h200.json
}
