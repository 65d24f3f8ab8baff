"""Which dense linear shapes the Triton GEMV (:mod:`loom.layers.dense_gemv`) serves, and how.

Written by ``python scripts/bench_dense_gemv.py --fill-table RESULTS.json`` from a sweep run on
the GPU the numbers are for (``--out RESULTS.json``): a shape is listed only where its best plan
beat cuBLAS, replayed from CUDA graphs, by the sweep's margin at every row count up to the one
listed. Empty until measured: every shape then stays on cuBLAS.

Key: (SMs of the GPU, N output features, K input features). Value: (the most token rows it
serves, block_n, block_k, split, num_warps, num_stages, fused_reduce).
"""

from __future__ import annotations

PLANS: dict[tuple[int, int, int], tuple[int, int, int, int, int, int, bool]] = {}
