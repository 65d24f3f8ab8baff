"""Instructions a weight in the dense GEMV's K loop (``loom.layers.dense_gemv``), compiled for Hopper
without a GPU, as ``scripts/w4a16_sass.py`` does for the W4A16 kernels.

A bf16 GEMV at batch 1 must move about 2.4 T weights a second to keep up with the H200's
~4.8 TB/s. The kernel streams each ``[BLOCK_N, BLOCK_K]`` weight tile through shared memory with
``cp.async`` (LDGSTS, 16 bytes a thread an instruction) and multiplies it on the tensor cores
(HGMMA for 64-row tiles and more, HMMA below), so the loop should cost about one to two
instructions a weight and no registers to spare; this compiles the plans the sweep starts from
and counts, per plan: the loop's instructions over the weights a thread handles an iteration, the
16-byte asynchronous copies, the tensor-core instructions, registers and spills.

    PYTHONPATH=service:plugins/.. python scripts/dense_gemv_sass.py [--fp8] [--out FILE]

With ``--fp8``, the same for the FP8 weight-only GEMV (``loom_plugins.quant.fp8_gemv``): an e4m3
weight is one byte, so the H200's bandwidth brings twice the weights a second (~4.8 T) and
the loop's budget a weight halves; the code conversions (F2FP, a quarter-rate pipe: 16 a clock
an SM) must stay near 0.5 a weight, which only the fp16 dot allows (one per pair of codes).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from w4a16_sass import _OP, _k_loop, disassemble  # noqa: E402 (the same loop finder and disassembly)

# (block_n, block_k, num_warps, num_stages, split-K merge: "none", "launch" or "fused")
PLANS = [(64, 128, 4, 3, "none"), (64, 128, 4, 3, "fused"), (128, 64, 4, 4, "none"), (32, 128, 4, 4, "launch"),
         (16, 256, 4, 4, "none")]
# The FP8 weight-only GEMV (``--fp8``: e4m3 codes, bf16 activations through the fp16 dot, and fp16
# ones): the rule's 64 x 256 tile (loom_plugins.quant.fp8_gemv.default_plan) and two neighbours.
# Last, block-wise FP8 (Qwen3's and DeepSeek's 128 x 128 blocks): fp8_gemv.block_plan's 64 x 128
# tile, each K tile's sums scaled by its blocks.
FP8_PLANS = [(64, 256, 4, 3, "fused", "bf16", "fp8e4nv"), (64, 256, 4, 3, "none", "fp16", "fp8e4nv"),
             (128, 128, 4, 3, "fused", "bf16", "fp8e4nv"), (32, 512, 4, 3, "launch", "bf16", "fp8e4nv"),
             (64, 128, 4, 3, "fused", "bf16", "fp8e4nv", (128, 128))]


def count(block_n: int, block_k: int, num_warps: int, num_stages: int, merge: str, dtype: str = "bf16",
          weight: str | None = None, scale_block: tuple[int, int] | None = None) -> dict[str, Any]:
    """``weight``: the weight's Triton dtype when it is not the activations' (``"fp8e4nv"``: the FP8
    weight-only GEMV, codes converted in registers and a scale per output; with ``scale_block``
    one per block)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loom.layers import dense_gemv as dg

    act = f"*{dtype}"
    sig = dict(x_ptr=act, w_ptr=f"*{weight}" if weight else act, scale_ptr="*fp32", bias_ptr=act, out_ptr=act, part_ptr="*fp32", counter_ptr="*i32", M="i32",
               N="i32", K="i32", K_SPLIT="i32", SPLIT="i32", stride_xm="i32", stride_wn="i32", stride_om="i32")
    consts = dict(HAS_BIAS=False, PARTIAL=merge != "none", FUSED_REDUCE=merge == "fused", EVEN_K=True, IEEE=False,
                  W_SCALE=weight is not None, X_F16=weight is not None and dtype == "bf16", MAX_ROWS=dg.MAX_M, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=16, BLOCK_S=32,
                  SCALE_BN=scale_block[0] if scale_block else 0, SCALE_BK=scale_block[1] if scale_block else 0)
    names = list(sig)
    # What Triton's launcher sees for Qwen3's and llama's shapes: every pointer 16-byte aligned,
    # N, K, the strides and K_SPLIT (a multiple of block_k) multiples of 16; M (2-4) and SPLIT not.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in ("M", "SPLIT")}
    compiled = triton.compile(ASTSource(dg._dense_gemv_kernel, {**sig, **{c: "constexpr" for c in consts}}, consts,
                                        attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    sass, regs, spills = disassemble(compiled)
    ops = collections.Counter(_OP.findall(_k_loop(sass)))
    weights = block_n * block_k // (32 * num_warps)  # weights a thread handles an iteration
    kind = (f" {dtype} x {weight}" if weight else "") + (f" blocks {scale_block[0]}x{scale_block[1]}" if scale_block else "")
    return {"plan": f"{block_n}x{block_k} w{num_warps} s{num_stages} merge {merge}{kind}", "loop_instructions": sum(ops.values()),
            "weights_per_thread": weights, "instructions_per_weight": round(sum(ops.values()) / weights, 2),
            "async_copies": ops.get("LDGSTS", 0), "tensor_core": ops.get("HGMMA", 0) + ops.get("HMMA", 0),
            "registers": regs, "spills": spills, "by_opcode": dict(ops.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the counts as JSON here")
    parser.add_argument("--fp8", action="store_true", help="the FP8 weight-only GEMV's plans instead")
    args = parser.parse_args()
    plans: list[Any] = FP8_PLANS if args.fp8 else PLANS
    results = [count(*p) for p in plans]
    for r in results:
        print(f"{r['plan']:<28} {r['instructions_per_weight']:5.2f} instructions a weight ({r['loop_instructions']} "
              f"for {r['weights_per_thread']}), {r['async_copies']} LDGSTS, {r['tensor_core']} tensor-core, "
              f"{r['registers']} registers, {r['spills']} spills", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"target": "sm_90 (triton 3.6, bundled ptxas)", "results": results},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
