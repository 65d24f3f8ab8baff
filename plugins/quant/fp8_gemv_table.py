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

PLANS: dict[tuple[int, int, int], tuple[int, int, int, int, int, int, bool]] = {}
