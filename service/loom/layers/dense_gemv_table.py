"""Which dense linear shapes the Triton GEMV (:mod:`loom.layers.dense_gemv`) serves, and how.

Written by ``python scripts/bench_dense_gemv.py --fill-table RESULTS.json`` from a sweep run on
the GPU the numbers are for (``--out RESULTS.json``): a shape is listed only where its best plan
beat cuBLAS, replayed from CUDA graphs, by the sweep's margin at every row count up to the one
listed. Empty until measured: every shape then stays on cuBLAS.

Key: (SMs of the GPU, N output features, K input features). Value: (the most token rows it
serves, block_n, block_k, split, num_warps, num_stages, fused_reduce).
"""

from __future__ import annotations

# From bench/results/gpu-dense-gemv-h200.json (NVIDIA H200, cold L2), margin 5%.
PLANS: dict[tuple[int, int, int], tuple[int, int, int, int, int, int, bool]] = {
    (132, 2048, 4096): (2, 128, 128, 8, 4, 3, True),  # qwen3-30b-a3b o_proj: {'1': 8.06, '2': 8.95, '3': 9.69, '4': 10.12} us, cuBLAS {'1': 9.73, '2': 9.9, '3': 9.64, '4': 9.89}
    (132, 128, 2048): (4, 16, 256, 8, 4, 4, True),  # qwen3-30b-a3b router: {'1': 4.17, '2': 4.68, '3': 4.68, '4': 5.24} us, cuBLAS {'1': 6.24, '2': 5.87, '3': 5.62, '4': 5.69}
    (132, 6144, 4096): (1, 64, 64, 2, 4, 6, True),  # llama-8b qkv_proj: {'1': 15.53, '2': 16.07, '3': 16.24, '4': 16.46} us, cuBLAS {'1': 17.86, '2': 16.48, '3': 15.96, '4': 16.14}
    (132, 4096, 4096): (3, 64, 128, 4, 4, 3, True),  # llama-8b o_proj: {'1': 11.61, '2': 12.04, '3': 12.91, '4': 13.24} us, cuBLAS {'1': 13.2, '2': 13.15, '3': 13.62, '4': 13.59}
    (132, 960, 576): (4, 64, 64, 1, 4, 6, False),  # smollm2 qkv_proj: {'1': 3.29, '2': 3.62, '3': 4.01, '4': 3.86} us, cuBLAS {'1': 4.43, '2': 4.42, '3': 4.44, '4': 4.7}
    (132, 576, 576): (4, 64, 64, 1, 4, 6, False),  # smollm2 o_proj: {'1': 3.86, '2': 3.65, '3': 3.64, '4': 3.78} us, cuBLAS {'1': 4.26, '2': 4.13, '3': 4.25, '4': 4.07}
    (132, 3072, 576): (4, 64, 64, 1, 4, 6, False),  # smollm2 gate_up_proj: {'1': 4.29, '2': 4.03, '3': 4.44, '4': 4.13} us, cuBLAS {'1': 4.6, '2': 4.75, '3': 4.8, '4': 4.5}
    (132, 576, 1536): (2, 64, 64, 8, 4, 6, True),  # smollm2 down_proj: {'1': 4.57, '2': 5.05, '3': 5.82, '4': 6.3} us, cuBLAS {'1': 5.87, '2': 5.82, '3': 5.55, '4': 5.61}
}
