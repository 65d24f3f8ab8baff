"""FP8 layers' inputs quantized by the kernel that makes them (``loom.layers.quantized_input``),
timed against the kernel and the layer's own quantizer one after the other, on llama-8b's shapes.

Per token count: the residual add + RMSNorm (H 4096) and SiLU-and-mul (I 14336) alone (dense
output), then each followed by ``fp8_triton.quantize_rows`` (what a layer does with its own
input), then fused (``fused_add_rms_norm_quant`` / ``silu_and_mul_quant``, with the launch
variants given); then the same chains with the ``_scaled_mm`` that takes the rows (qkv 6144 x
4096, down 4096 x 14336), since under PDL a kernel's launch overlaps the one before. Each time is
the best replay of a CUDA graph of 20 calls (``bench_w4a16_plans._time_graphed``).

    python3 scripts/bench_fused_input.py [--tokens 256,2048,16384] [--out FILE]
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

H, INTER = 4096, 14336
# (block, warps); None: the rule (two passes of 2,048 x 8 warps since session 35; the whole row in
# one 16,384 block with 16 warps before it)
SILU_VARIANTS = [(None, None), (16384, 16), (1024, 4), (1024, 8), (2048, 4), (4096, 8)]


def _times(m: int, weights: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, float]:
    """Microseconds of each variant at ``m`` tokens."""
    from loom.layers import fused_ops
    from loom_plugins.quant import fp8_triton

    dev, dt = weights["norm_w"].device, torch.bfloat16
    x = torch.randn(m, H, device=dev, dtype=dt, generator=g)
    res = torch.randn(m, H, device=dev, dtype=dt, generator=g)
    gu = torch.randn(m, 2 * INTER, device=dev, dtype=dt, generator=g)
    norm_w = weights["norm_w"]

    def mm(rows: tuple[torch.Tensor, torch.Tensor], w: str) -> torch.Tensor:
        q, s = rows
        return torch._scaled_mm(q, weights[w].t(), scale_a=s, scale_b=weights[w + "_scale"], out_dtype=dt,
                                use_fast_accum=True)

    def norm() -> Any:
        return fused_ops.fused_add_rms_norm(x, res, norm_w, 1e-6)

    def norm_quant(warps: int | None = None) -> Any:
        return fused_ops.fused_add_rms_norm_quant(x, res, norm_w, 1e-6, None, warps=warps)

    def norm_then_quant() -> Any:
        return fp8_triton.quantize_rows(norm()[0])

    def silu() -> Any:
        return fused_ops.silu_and_mul(gu)

    def silu_then_quant() -> Any:
        return fp8_triton.quantize_rows(silu())

    times: dict[str, float] = {
        "norm": _time_graphed(norm, dev),
        "norm+quantize": _time_graphed(norm_then_quant, dev),
        "norm_quant": _time_graphed(norm_quant, dev),
        "norm_quant 8 warps": _time_graphed(lambda: norm_quant(8), dev),
        "silu": _time_graphed(silu, dev),
        "silu+quantize": _time_graphed(silu_then_quant, dev),
    }
    for block, warps in SILU_VARIANTS:
        times[f"silu_quant block {block or 'rule'} warps {warps or 'rule'}"] = _time_graphed(
            lambda b=block, w=warps: fused_ops.silu_and_mul_quant(gu, None, block=b, warps=w), dev)
    times["norm+quantize+qkv"] = _time_graphed(lambda: mm(norm_then_quant(), "qkv"), dev)
    times["norm_quant+qkv"] = _time_graphed(lambda: mm(norm_quant()[:2], "qkv"), dev)
    times["silu+quantize+down"] = _time_graphed(lambda: mm(silu_then_quant(), "down"), dev)
    times["silu_quant+down"] = _time_graphed(lambda: mm(fused_ops.silu_and_mul_quant(gu, None), "down"), dev)
    return {k: round(v * 1e6, 2) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="256,2048,16384")
    parser.add_argument("--out")
    args = parser.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {
        "qkv": torch.randn(6144, H, device=dev, generator=g).to(torch.float8_e4m3fn),
        "qkv_scale": torch.rand(1, 6144, device=dev, generator=g) + 0.5,
        "down": torch.randn(H, INTER, device=dev, generator=g).to(torch.float8_e4m3fn),
        "down_scale": torch.rand(1, H, device=dev, generator=g) + 0.5,
        "norm_w": torch.randn(H, device=dev, generator=g).to(torch.bfloat16),
    }
    rows: list[dict[str, Any]] = []
    for m in [int(t) for t in args.tokens.split(",")]:
        us = _times(m, weights, g)
        print(f"M={m}: " + ", ".join(f"{k} {v}" for k, v in us.items()), flush=True)
        rows.append({"tokens": m, "us": us})
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
