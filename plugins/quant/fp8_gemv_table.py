"""Measured plans of the FP8 weight-only GEMV (``loom_plugins.quant.fp8_gemv``), per layer shape.

Written by ``python scripts/bench_fp8_gemv.py --fill-table RESULTS.json`` from a sweep run on the
GPU the numbers are for (``--out RESULTS.json``): per shape, the plan that saved the most time
against the W8A8 path (activation quantization + ``torch._scaled_mm``), replayed from CUDA
graphs, serving the row counts up to the largest where it was at least the sweep's margin
faster at that count and every smaller one (0 rows: no plan beat W8A8). A shape not listed runs
``fp8_gemv.default_plan`` at 1-4 rows; a listed shape's larger row counts run W8A8.

Key: (SMs of the GPU, N output features, K input features). Value: (the most token rows it
serves, block_n, block_k, split, num_warps, num_stages, fused_reduce).
"""

from __future__ import annotations

# From fp8gemv.json (NVIDIA H200, cold L2), margin 5%.
PLANS: dict[tuple[int, int, int], tuple[int, int, int, int, int, int, bool]] = {
    (132, 6144, 4096): (4, 128, 128, 8, 4, 3, False),  # llama-8b qkv_proj: {'1': 14.09, '2': 14.38, '3': 13.92, '4': 14.55} us, cuBLAS {'1': 21.61, '2': 22.29, '3': 22.25, '4': 22.92}
    (132, 4096, 4096): (4, 64, 128, 8, 4, 4, False),  # llama-8b o_proj: {'1': 12.47, '2': 13.77, '3': 13.07, '4': 13.27} us, cuBLAS {'1': 17.65, '2': 17.8, '3': 17.44, '4': 17.64}
    (132, 28672, 4096): (0, 64, 256, 2, 4, 3, True),  # llama-8b gate_up_proj: {} us, cuBLAS {'1': 49.58, '2': 51.48, '3': 50.93, '4': 51.09}
    (132, 4096, 14336): (4, 64, 128, 8, 4, 4, True),  # llama-8b down_proj: {'1': 28.76, '2': 30.25, '3': 30.44, '4': 31.09} us, cuBLAS {'1': 51.83, '2': 49.72, '3': 51.5, '4': 51.12}
}
