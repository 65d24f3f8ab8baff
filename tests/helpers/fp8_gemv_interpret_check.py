"""The FP8 weight-only GEMV (``loom_plugins.quant.fp8_gemv``) on the CPU, through Triton's interpreter.

Run as a script in its own process (``TRITON_INTERPRET`` must be set before the kernels are
defined); prints one line per case and exits non-zero on a failure.
``tests/unit/test_fp8_gemv.py`` runs it. For every plan shape (no split, split-K merged by the
second launch, split-K merged by the last split to arrive), 1-4 rows, odd N and K, with and
without a bias, float32, fp16 and bf16 activations (bf16: the fp16 dot of the power-of-two scaled
rows), e4m3 codes over their whole range (subnormals included) and per-channel scales spread
over six orders of magnitude:

- the output against the W8A16 reference ``x @ (codes * scale)^T (+ bias)`` in float64 (the
  activations NOT rounded to e4m3: that is what the GEMV computes), within ``(K 2^-23) (|x| @
  |W|^T) + u |ref|`` (float32 accumulation in any order, the scale's product rounded once per
  split, the output rounded once; ``u`` the output's unit roundoff; half its smallest subnormal
  for the tiny outputs) plus, for bf16, ``2^-30
  max|x_row| sum_k |W[n, k]|`` for the fp16 rounding of a row's values far below its largest;
- batch invariance within 1-4 rows: each row of a 4-row call equals, bit for bit, the same row
  computed alone with the same plan (the 4 rows: ordinary, large (1e4; fp16: 30, its outputs
  must stay below 65504), tiny (1e-6), zero);
- the counters of the fused merge are all back to zero after every launch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported in the functions: after the interpreter is set up)
    import torch

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()


# (N, K, activation dtype, bias, (block_n, block_k, split, fused_reduce))
CASES = [
    (40, 96, "float32", False, (16, 32, 1, False)),  # one split, ragged N
    (50, 200, "float32", True, (16, 32, 4, True)),  # split-K, ragged K, merged by the last split
    (33, 160, "float16", True, (16, 32, 3, True)),  # three pieces, fp16
    (20, 256, "float16", False, (16, 64, 2, False)),  # the second launch, fp16
    (37, 176, "bfloat16", True, (16, 32, 1, False)),  # bf16 -> fp16 dot, one split
    (24, 208, "bfloat16", False, (16, 64, 4, True)),  # bf16, split-K merged by the last split, ragged K
    (18, 96, "bfloat16", True, (16, 32, 3, False)),  # bf16, the second launch
]


def _codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """e4m3 codes ``[n, k]`` over the whole range (NaN 0x7f / 0xff excluded), subnormals included."""
    import torch

    raw = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32)
    raw = torch.where((raw & 0x7F) == 0x7F, raw - 1, raw).to(torch.uint8)
    return raw.view(torch.float8_e4m3fn)


def _excess(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
            u: float) -> float:
    """How far ``y`` is past the bound around the float64 reference ``x @ w^T (+ bias)``: ``(K 2^-23)
    (|x| @ |W|^T) + u |ref|`` + half the output dtype's smallest subnormal (fp16 outputs of the
    tiny scales round there), + for bf16 the fp16 rounding of a row's values far below its largest."""
    import torch

    xd = x.double()
    ref = xd @ w.t() + (bias.double() if bias is not None else 0.0)
    bound = (x.shape[-1] * 2.0**-23) * (xd.abs() @ w.abs().t()) + u * ref.abs() + torch.finfo(x.dtype).smallest_normal * u
    if x.dtype == torch.bfloat16:
        bound += 2.0**-30 * xd.abs().amax(dim=1, keepdim=True) * w.abs().sum(dim=1)[None, :]
    return float(((y.double() - ref).abs() - bound).max().item())


def run_case(n: int, k: int, dtype_name: str, with_bias: bool, plan_args: tuple[int, int, int, bool]) -> list[str]:
    import torch

    from loom.layers import dense_gemv as dg
    from loom.layers.split_k import counters
    from loom_plugins.quant import fp8_gemv

    dtype = getattr(torch, dtype_name)
    u = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    bn, bk, split, fused = plan_args
    plan = dg.GemvPlan(bn, bk, split, 4, 2, fused)
    gen = torch.Generator().manual_seed(n * 1000 + k)
    codes = _codes(n, k, gen)
    # 1e-7 .. 1e-1 (fp16: .. 1e-3, and the large row 30 instead of 1e4, inside fp16's range)
    top = -3 if dtype == torch.float16 else -1
    scale = (10.0 ** (torch.rand(n, generator=gen) * 6 - 6 + top)).float()
    w = codes.double() * scale.double()[:, None]  # the dequantized weight, exactly
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype) if with_bias else None
    x4 = torch.randn(4, k, generator=gen)
    x4[1] *= 30.0 if dtype == torch.float16 else 1e4
    x4[2] *= 1e-6
    x4[3] = 0.0
    x4 = x4.to(dtype)
    errors: list[str] = []
    for m in range(1, dg.MAX_M + 1):
        x = x4[:m]
        y = fp8_gemv.fp8_gemv(x, codes, scale, bias, plan)
        excess = _excess(y, x, w, bias, u)
        if y.shape != (m, n) or y.dtype != dtype or excess > 0:
            errors.append(f"m={m}: shape {tuple(y.shape)} {y.dtype}, error past the bound by {excess:.3e}")
        ctr = counters(x.device)
        if ctr is not None and int(ctr.abs().sum()) != 0:
            errors.append(f"m={m}: counters left at {int(ctr.abs().sum())}")
        if m == dg.MAX_M:
            for r in range(m):
                alone = fp8_gemv.fp8_gemv(x4[r : r + 1], codes, scale, bias, plan)
                if not torch.equal(alone[0], y[r]):
                    errors.append(f"row {r} of 4 differs from the row alone")
    return errors


# Block-wise scales (one per block of bn rows x bk inputs): (N, K, dtype, bias, block, plan)
BLOCK_CASES = [
    (40, 96, "float32", False, (16, 32), (16, 32, 1, False)),  # ragged N: a partial row block
    (48, 160, "bfloat16", True, (16, 32), (16, 32, 3, True)),  # split in whole blocks, merged by the last split
    (20, 256, "float16", False, (8, 128), (16, 64, 2, False)),  # two K tiles a block, the second launch
    (24, 208, "bfloat16", False, (8, 64), (16, 32, 2, True)),  # a partial last column block
]


def run_block_case(n: int, k: int, dtype_name: str, with_bias: bool, block: tuple[int, int],
                   plan_args: tuple[int, int, int, bool]) -> list[str]:
    """The block-scaled GEMV against ``x @ (codes * grid[row // bn, col // bk])^T`` in float64,
    within the per-channel cases' bound (each K tile's sums take their blocks' scale once)."""
    import torch

    from loom.layers import dense_gemv as dg

    dtype = getattr(torch, dtype_name)
    u = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    bn, bk = block
    plan = dg.GemvPlan(*plan_args[:3], 4, 2, plan_args[3])
    gen = torch.Generator().manual_seed(n * 100 + k)
    codes = _codes(n, k, gen)
    top = -3 if dtype == torch.float16 else -1
    grid = (10.0 ** (torch.rand(-(-n // bn), -(-k // bk), generator=gen) * 4 - 4 + top)).float()
    full = grid.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    w = codes.double() * full
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype) if with_bias else None
    x4 = torch.randn(4, k, generator=gen)
    x4[1] *= 30.0 if dtype == torch.float16 else 1e4
    x4[2] *= 1e-6
    x4 = x4.to(dtype)
    errors: list[str] = []
    for m in (1, 4):
        x = x4[:m]
        y = dg.dense_gemv(x, codes, bias, plan, scale=grid, scale_block=block)
        excess = _excess(y, x, w, bias, u)
        if y.shape != (m, n) or excess > 0:
            errors.append(f"m={m}: error past the bound by {excess:.3e}")
        if m == 4:
            alone = dg.dense_gemv(x4[:1], codes, bias, plan, scale=grid, scale_block=block)
            if not torch.equal(alone[0], y[0]):
                errors.append("row 0 of 4 differs from the row alone")
    return errors


def main() -> int:
    _setup()
    failed = 0
    for label, cases, run, passing in (("", CASES, run_case, "within the bound, rows batch-invariant"),
                                       ("block ", BLOCK_CASES, run_block_case, "within the bound")):
        failures = 0
        for case in cases:
            errors = run(*case)  # type: ignore[operator]
            failures += bool(errors)
            print(f"{'FAIL' if errors else 'ok  '} {label}{case}: {'; '.join(errors) or passing}", flush=True)
        print(f"{len(cases) - failures} of {len(cases)} {label}cases passed")
        failed += failures
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
