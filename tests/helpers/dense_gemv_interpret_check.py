"""The dense GEMV (``loom.layers.dense_gemv``) on the CPU, through Triton's interpreter.

Run as a script in its own process (``TRITON_INTERPRET`` must be set before the kernels are
defined); prints one line per case and exits non-zero on a failure.
``tests/unit/test_dense_gemv.py`` runs it. For every plan shape (no split, split-K merged by the
second launch, split-K merged by the last split to arrive), 1-4 rows, ragged N and K, with and
without a bias, float32 (IEEE dots) and fp16:

- the output against a float64 reference within ``(K 2^-23) (|x| @ |W|^T) + u |ref|`` (float32
  accumulation in any order, then one rounding to the output dtype, unit roundoff ``u``);
- batch invariance within 1-4 rows: each row of a 4-row call equals, bit for bit, the same row
  computed alone with the same plan;
- the counters of the fused merge are all back to zero after every launch.

bf16 is left to the GPU tests: the interpreter of triton 3.6 computes bf16 dots wrongly.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()


# (N, K, dtype, bias, (block_n, block_k, split, fused_reduce))
CASES = [
    (40, 96, "float32", False, (16, 32, 1, False)),  # one split, ragged N
    (64, 128, "float32", True, (32, 64, 2, False)),  # split-K, merged by the second launch
    (50, 200, "float32", True, (16, 32, 4, True)),  # split-K, ragged K, merged by the last split
    (33, 160, "float16", True, (16, 32, 3, True)),  # three pieces (not a power of two), fp16
    (48, 64, "float16", False, (16, 64, 1, False)),  # fp16, one K tile
    (20, 256, "float16", True, (16, 32, 8, False)),  # many pieces, the second launch, fp16
]


def run_case(n: int, k: int, dtype_name: str, with_bias: bool, plan_args: tuple[int, int, int, bool]) -> list[str]:
    import torch

    from loom.layers import dense_gemv as dg
    from loom.layers.split_k import counters

    dtype = getattr(torch, dtype_name)
    u = 2.0**-24 if dtype == torch.float32 else 2.0**-11
    bn, bk, split, fused = plan_args
    plan = dg.GemvPlan(bn, bk, split, 4, 2, fused)
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype) if with_bias else None
    errors: list[str] = []
    x4 = torch.randn(4, k, generator=gen).to(dtype)
    for m in range(1, dg.MAX_M + 1):
        x = x4[:m]
        y = dg.dense_gemv(x, w, bias, plan)
        ref = x.double() @ w.double().t() + (bias.double() if bias is not None else 0.0)
        bound = (k * 2.0**-23) * (x.double().abs() @ w.double().abs().t()) + u * ref.abs() + 1e-30
        excess = ((y.double() - ref).abs() - bound).max().item()
        if y.shape != (m, n) or y.dtype != dtype or excess > 0:
            errors.append(f"m={m}: shape {tuple(y.shape)} {y.dtype}, error past the bound by {excess:.3e}")
        ctr = counters(x.device)
        if ctr is not None and int(ctr.abs().sum()) != 0:
            errors.append(f"m={m}: counters left at {int(ctr.abs().sum())}")
        if m == dg.MAX_M:
            for r in range(m):
                alone = dg.dense_gemv(x4[r : r + 1], w, bias, plan)
                if not torch.equal(alone[0], y[r]):
                    errors.append(f"row {r} of 4 differs from the row alone")
    return errors


def main() -> int:
    _setup()
    failures = 0
    for case in CASES:
        errors = run_case(*case)
        failures += bool(errors)
        print(f"{'FAIL' if errors else 'ok  '} {case}: {'; '.join(errors) or 'within the bound, rows batch-invariant'}")
    print(f"{len(CASES) - failures} of {len(CASES)} cases passed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
