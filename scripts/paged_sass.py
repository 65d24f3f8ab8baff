"""Instructions a key/value element in the paged attention kernel's decode loop, bf16 against FP8 KV,
compiled for Hopper without a GPU (as ``scripts/w4a16_sass.py`` does for the W4A16 GEMV).

The decode step of a large batch reads every cached key and value once; with an FP8 pool it reads
half the bytes, which pays only if converting the codes costs less than the bytes saved. This
compiles ``_paged_attn_kernel`` (``plugins/attention/triton_kernels.py``) for sm_90 through
Triton and its bundled ptxas with the decode plan (16 query rows of one KV head, 64 keys a tile,
head size 128) for bf16 and fp16 activations, over a dense and an FP8 pool, and counts the
instructions of the key loop against the K and V elements a thread handles an iteration.

    PYTHONPATH=service:plugins/.. python scripts/paged_sass.py [--out FILE]
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


def count(dtype: str, fp8: bool, num_stages: int | None = None, block_n: int = 64, num_warps: int = 4,
          group: int = 4, head_dim: int = 128, num_splits: int = 1, fused: bool = False) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loom_plugins.attention import triton_kernels as tk

    code = "*fp8e4nv" if fp8 else f"*{dtype}"
    sig = dict(q_ptr=f"*{dtype}", kc_ptr=code, vc_ptr=code, ks_ptr="*fp32", vs_ptr="*fp32", out_ptr=f"*{dtype}",
               part_o_ptr="*fp32", part_lse_ptr="*fp32", qsl_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32",
               seq_ids_ptr="*i32", counter_ptr="*i32", qk_scale="fp32", window="i32", soft_cap="fp32",
               num_q_heads="i32", min_keys="i32", stride_qt="i32", stride_qh="i32", stride_ot="i32", stride_oh="i32", stride_kcb="i32",
               stride_kcs="i32", stride_kch="i32", stride_vcb="i32", stride_vcs="i32", stride_vch="i32",
               stride_sb="i32", stride_ss="i32", stride_sh="i32", stride_bt="i32")
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, GROUP=group, BLOCK_M=max(16, 1 << (group - 1).bit_length()),
                  BLOCK_N=block_n, PAGE=16, NUM_SPLITS=num_splits, HAS_SEQ_IDS=False, HAS_WINDOW=False,
                  HAS_SOFT_CAP=False, PRECISION="tf32", FP8_KV=fp8, FUSED_COMBINE=fused and num_splits > 1,
                  BLOCK_S=num_splits)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n.startswith("stride")}
    options: dict[str, Any] = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    compiled = triton.compile(ASTSource(tk._paged_attn_kernel, {**sig, **{c: "constexpr" for c in consts}}, consts,
                                        attrs), target=GPUTarget("cuda", 90, 32), options=options)
    sass, regs, spills = disassemble(compiled)
    ops = collections.Counter(_OP.findall(_k_loop(sass)))
    total = len(_OP.findall(sass))
    elements = 2 * block_n * head_dim // (32 * num_warps)  # K and V elements a thread handles an iteration
    return {"activations": dtype, "pool": "fp8_e4m3" if fp8 else dtype, "num_stages": num_stages or "default",
            "block_n": block_n, "num_warps": num_warps, "group": group, "head_dim": head_dim,
            "num_splits": num_splits, "fused_combine": fused and num_splits > 1,
            "loop_instructions": sum(ops.values()), "kv_elements_per_thread": elements,
            "instructions_per_kv_element": round(sum(ops.values()) / elements, 2),
            "instructions_outside_loop": total - sum(ops.values()), "registers": regs, "spills": spills,
            "by_opcode": dict(ops.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the counts as JSON here")
    parser.add_argument("--decode-plans", action="store_true",
                        help="count the decode plans scripts/bench_decode_plans.py sweeps (bf16 pool) instead")
    args = parser.parse_args()
    if args.decode_plans:
        decode_plans(args.out)
        return
    results = [count(d, fp8, st) for d in ("bf16", "fp16") for fp8 in (False, True) for st in (None, 1)]
    for r in results:
        top = ", ".join(f"{k} {v}" for k, v in list(r["by_opcode"].items())[:5])
        print(f"{r['activations']} activations, {r['pool']} pool, stages {r['num_stages']}: "
              f"{r['instructions_per_kv_element']:.2f} instructions a K/V element ({r['loop_instructions']}), "
              f"{r['registers']} registers; {top}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"target": "sm_90 (triton 3.6, bundled ptxas)", "results": results},
                                             indent=1) + "\n")


def decode_plans(out: str | None) -> None:
    """The decode kernel's tiles, warps and stages at Qwen3-30B-A3B's (G 8) and llama-8b's (G 4)
    layouts, unsplit and with 16 splits merged by the last split: the loop's instructions a K/V
    element, and the instructions outside it (the prologue's loads and the epilogues), which a
    program of one or two key tiles, as a batch-1 decode runs them, spends most of its time in."""
    plans = [(64, 4, None), (64, 4, 1), (64, 4, 2), (32, 4, 2), (32, 2, 2), (16, 2, 2), (16, 1, 2), (128, 8, 2)]
    results = []
    for group in (8, 4):
        for block_n, warps, stages in plans:
            results.append(count("bf16", False, stages, block_n, warps, group=group))
        results.append(count("bf16", False, None, 64, 4, group=group, num_splits=16))
        results.append(count("bf16", False, None, 64, 4, group=group, num_splits=16, fused=True))
        results.append(count("bf16", False, 2, 32, 2, group=group, num_splits=16, fused=True))
    for r in results:
        split = f"{r['num_splits']} splits{' fused' if r['fused_combine'] else ''}"
        print(f"G {r['group']} d {r['head_dim']} BLOCK_N {r['block_n']:3d} warps {r['num_warps']} stages "
              f"{r['num_stages']!s:7s} {split:17s}: {r['instructions_per_kv_element']:5.2f} a K/V element "
              f"({r['loop_instructions']} in the loop), {r['instructions_outside_loop']} outside it, "
              f"{r['registers']} registers, {r['spills']} spill bytes", flush=True)
    if out:
        Path(out).write_text(json.dumps({"target": "sm_90 (triton 3.6, bundled ptxas)", "results": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
