"""``torch._scaled_mm`` with row-wise scales, with and without fast accumulation, on llama-8b's
layers: time (replayed from a CUDA graph, beside bf16 cuBLAS on the same shape) and error.

PyTorch serves row-wise scales (per-token activations x per-channel weights, what Loom's FP8
layers use) with a CUTLASS kernel; without ``use_fast_accum`` it promotes the tensor cores' partial
sums to float32 every 128 inputs, which its authors measured as much slower
(pytorch/pytorch#147971). The error of each against the float64 product of the same e4m3
operands and scales is reported relative to the output's RMS (max and mean), so the cost of fast
accumulation in accuracy is a figure, not a guess.

    PYTHONPATH=service:plugins/.. python scripts/bench_fp8_fast_accum.py [--tokens 16,256,4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_w4a16_plans import _time_graphed  # noqa: E402

SHAPES = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096), ("down_proj", 4096, 14336)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="16,64,256,1024,4096,16384")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    rows: list[dict[str, Any]] = []
    for m in [int(t) for t in args.tokens.split(",")]:
        sums = {"bf16": 0.0, "slow": 0.0, "fast": 0.0}
        for name, n, k in SHAPES:
            x = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
            w16 = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
            xs = x.float().abs().amax(1, keepdim=True) / 448.0
            xq = (x.float() / xs).to(torch.float8_e4m3fn)
            ws = w16.float().abs().amax(1, keepdim=True).t() / 448.0  # [1, N]
            wq = (w16.float() / ws.t()).to(torch.float8_e4m3fn)
            wt = wq.t()  # [K, N] column-major
            ref = (xq.double() @ wq.double().t()) * xs.double() * ws.double()
            rms = ref.pow(2).mean().sqrt().item()
            row: dict[str, Any] = {"layer": name, "m": m, "n": n, "k": k}
            for mode, fast in (("slow", False), ("fast", True)):
                out = torch._scaled_mm(xq, wt, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, use_fast_accum=fast)
                err = (out.double() - ref).abs()
                row[f"{mode}_max_err_over_rms"] = err.max().item() / rms
                row[f"{mode}_mean_err_over_rms"] = err.mean().item() / rms
                row[f"{mode}_us"] = 1e6 * _time_graphed(
                    lambda xq=xq, wt=wt, xs=xs, ws=ws, fast=fast: torch._scaled_mm(
                        xq, wt, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, use_fast_accum=fast), device, reps=5)
            bf = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            row["bf16_us"] = 1e6 * _time_graphed(lambda x=x, w16=w16, bf=bf: torch.matmul(x, w16.t(), out=bf), device, reps=5)
            for key in sums:
                sums[key] += row[f"{key}_us"]
            print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            rows.append(row)
        print(f"M={m}: over the four layers bf16 {sums['bf16']:.1f} us, FP8 slow-accum {sums['slow']:.1f}, "
              f"fast-accum {sums['fast']:.1f} (fast / slow {sums['fast'] / sums['slow']:.3f}, fast / bf16 "
              f"{sums['fast'] / sums['bf16']:.3f})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
