"""Instructions a key/value element in the paged attention kernels' decode loop, bf16 against FP8 KV,
compiled for Hopper without a GPU (as ``scripts/w4a16_sass.py`` does for the W4A16 GEMV).

The decode step of a large batch reads every cached key and value once; with an FP8 pool it reads
half the bytes, which pays only if converting the codes costs less than the bytes saved. This
compiles, for sm_90 through Triton and its bundled ptxas, the decode plan of

* the generic kernel (``plugins/attention/triton_kernels.py``: 16 query rows of one KV head, 64
  keys a tile, 4 warps) over a dense pool and over the FP8 pool (its ``FP8_KV`` path, the
  fallback under ``LOOM_FP8_KV_KERNEL=0``), for bf16 and fp16 activations;
* the FP8 kernel (``plugins/attention/triton_fp8_attention.py``: 8 query rows, 64 keys, 1 warp);

all at head size 128 and 4 query heads per KV head (Llama 3 8B), and counts the instructions of
the key loop against the K and V elements a thread handles an iteration, and against the bytes
it reads (2 an element in bf16; 1 in FP8, plus a 4-byte scale a key and head for each of K and V).

    PYTHONPATH=service:plugins/.. python scripts/paged_sass.py [--out FILE]

``--decode-plans`` counts the generic kernel's decode plans instead (the tiles, warps, stages and
split merges that ``scripts/bench_decode_plans.py`` times): the loop, and the instructions outside
it that a program of one or two key tiles spends most of its time in.
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

HEAD_DIM, GROUP, PAGE = 128, 4, 16
_COMMON = dict(q_ptr="", kc_ptr="", vc_ptr="", ks_ptr="*fp32", vs_ptr="*fp32", out_ptr="", part_o_ptr="*fp32",
               part_lse_ptr="*fp32", qsl_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32", seq_ids_ptr="*i32",
               qk_scale="fp32", window="i32", soft_cap="fp32", num_q_heads="i32", stride_qt="i32",
               stride_qh="i32", stride_ot="i32", stride_oh="i32", stride_kcb="i32", stride_kcs="i32",
               stride_kch="i32")


def _signature(dtype: str, code: str, v_strides: tuple[str, ...], generic: bool) -> dict[str, str]:
    sig = {**_COMMON, "q_ptr": f"*{dtype}", "kc_ptr": code, "vc_ptr": code, "out_ptr": f"*{dtype}"}
    sig.update({s: "i32" for s in v_strides})
    sig.update(stride_sb="i32", stride_ss="i32", stride_sh="i32", stride_bt="i32")
    if generic:  # the split merge's arrivals and the fewest keys a split takes
        sig.update(counter_ptr="*i32", min_keys="i32")
    return sig


def count(dtype: str, pool: str, num_stages: int | None = None, block_n: int = 64, num_warps: int = 4,
          group: int = GROUP, head_dim: int = HEAD_DIM, num_splits: int = 1, fused: bool = False,
          fp8_tile: tuple[int, int] | None = None, maxnreg: int | None = None,
          prefetch_table: bool = False) -> dict[str, Any]:
    """``pool``: "dense" (the generic kernel over a pool of ``dtype``), "fp8_generic" (its FP8
    path) or "fp8_kernel" (the FP8 kernel, at its own launch configuration). ``block_n``,
    ``num_warps``, ``num_splits`` and ``fused`` (the last split merges) shape the generic kernel;
    ``fp8_tile`` (block_n, num_warps) replaces the FP8 kernel's own; ``maxnreg`` caps the registers
    a thread (ptxas spills the rest); ``prefetch_table`` is the FP8 kernel's ``PREFETCH_TABLE``."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loom_plugins.attention import triton_fp8_attention as f8
    from loom_plugins.attention import triton_kernels as tk

    if pool == "fp8_kernel":
        cfg = f8.fp8_launch_config(group, head_dim, 1)
        block_m = cfg["block_m"]
        if fp8_tile is None:
            block_n, num_warps = cfg["block_n"], cfg["num_warps"]
        else:  # a decode plan's tile (scripts/bench_fp8_decode_plans.py)
            block_n, num_warps = fp8_tile
        kernel = f8._paged_attn_fp8_kernel
        sig = _signature(dtype, "*fp8e4nv", ("stride_vcb", "stride_vch", "stride_vcd"), generic=False)
        consts: dict[str, Any] = dict(TILE_PAGES=max(1, block_n // PAGE), TILE_W=min(block_n, PAGE),
                                      F32_DOTS=False, PREFETCH_TABLE=prefetch_table)
        num_splits, fused = 1, False
    else:
        block_m = max(16, 1 << (group - 1).bit_length())
        kernel = tk._paged_attn_kernel
        sig = _signature(dtype, "*fp8e4nv" if pool == "fp8_generic" else f"*{dtype}",
                         ("stride_vcb", "stride_vcs", "stride_vch", "stride_vcd"), generic=True)
        consts = dict(PRECISION="tf32", FP8_KV=pool == "fp8_generic", FUSED_COMBINE=fused and num_splits > 1,
                      BLOCK_S=num_splits)
    consts.update(HEAD_DIM=head_dim, BLOCK_D=head_dim, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=PAGE,
                  NUM_SPLITS=num_splits, HAS_SEQ_IDS=False, HAS_WINDOW=False, HAS_SOFT_CAP=False,
                  USE_PDL=False)  # the plain launch (scripts/pdl_sass.py compares the PDL one)
    if pool == "dense":  # a dense pool's d stride is 1: Triton specializes it away at launch
        consts["stride_vcd"] = 1
    sig.update({c: "constexpr" for c in consts})
    # pointers and strides 16-divisible, as Triton's own specialization of such arguments finds them
    names = list(kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t != "constexpr" and (n.endswith("_ptr") or n.startswith("stride"))}
    options: dict[str, Any] = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(ASTSource(kernel, {n: sig[n] for n in names}, consts, attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    sass, regs, spills = disassemble(compiled)
    ops = collections.Counter(_OP.findall(_k_loop(sass)))
    elements = 2 * block_n * head_dim // (32 * num_warps)  # K and V elements a thread handles an iteration
    kv_bytes = elements * (2 if pool == "dense" else 1 + 4 / head_dim)
    total = sum(ops.values())
    return {"kernel": "fp8" if pool == "fp8_kernel" else "generic", "activations": dtype,
            "pool": dtype if pool == "dense" else "fp8_e4m3", "block_m": block_m, "block_n": block_n,
            "num_warps": num_warps, "num_stages": num_stages or "default", "maxnreg": maxnreg,
            "prefetch_table": prefetch_table, "group": group, "head_dim": head_dim,
            "num_splits": num_splits, "fused_combine": fused and num_splits > 1, "loop_instructions": total,
            "kv_elements_per_thread": elements, "instructions_per_kv_element": round(total / elements, 2),
            "instructions_per_kv_byte": round(total / kv_bytes, 2),
            "instructions_outside_loop": len(_OP.findall(sass)) - total, "registers": regs, "spill_bytes": spills,
            "shared_bytes": compiled.metadata.shared, "by_opcode": dict(ops.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the counts as JSON here")
    parser.add_argument("--decode-plans", action="store_true",
                        help="count the decode plans scripts/bench_decode_plans.py sweeps (bf16 pool) instead")
    parser.add_argument("--fp8-plans", action="store_true",
                        help="count the FP8 kernel's decode tiles scripts/bench_fp8_decode_plans.py sweeps instead")
    args = parser.parse_args()
    if args.decode_plans:
        decode_plans(args.out)
        return
    if args.fp8_plans:
        fp8_plans(args.out)
        return
    results = [count(d, pool, st) for d in ("bf16", "fp16") for pool in ("dense", "fp8_generic")
               for st in (None, 1)]
    results += [count(d, "fp8_kernel") for d in ("bf16", "fp16")]
    for r in results:
        top = ", ".join(f"{k} {v}" for k, v in list(r["by_opcode"].items())[:5])
        print(f"{r['kernel']} kernel, {r['activations']} activations, {r['pool']} pool, stages {r['num_stages']}: "
              f"{r['instructions_per_kv_element']:.2f} instructions a K/V element, "
              f"{r['instructions_per_kv_byte']:.2f} a byte ({r['loop_instructions']}), {r['registers']} registers, "
              f"{r['spill_bytes']} bytes spilled; {top}", flush=True)
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
            results.append(count("bf16", "dense", stages, block_n, warps, group=group))
        results.append(count("bf16", "dense", None, 64, 4, group=group, num_splits=16))
        results.append(count("bf16", "dense", None, 64, 4, group=group, num_splits=16, fused=True))
        results.append(count("bf16", "dense", 2, 32, 2, group=group, num_splits=16, fused=True))
    for r in results:
        split = f"{r['num_splits']} splits{' fused' if r['fused_combine'] else ''}"
        print(f"G {r['group']} d {r['head_dim']} BLOCK_N {r['block_n']:3d} warps {r['num_warps']} stages "
              f"{r['num_stages']!s:7s} {split:17s}: {r['instructions_per_kv_element']:5.2f} a K/V element "
              f"({r['loop_instructions']} in the loop), {r['instructions_outside_loop']} outside it, "
              f"{r['registers']} registers, {r['spill_bytes']} spill bytes", flush=True)
    if out:
        Path(out).write_text(json.dumps({"target": "sm_90 (triton 3.6, bundled ptxas)", "results": results},
                                        indent=1) + "\n")


def fp8_plans(out: str | None) -> None:
    """The FP8 kernel's decode tiles (block_n, warps, stages) at llama-8b's (G 4) and
    Qwen3-30B-A3B's (G 8) layouts, bf16 activations, unsplit: the loop's instructions a K/V
    element, registers (a warp's 32 threads each hold them: 65,536 a SM bound the resident
    warps), spills and shared memory a program (the stages' K and V tiles: the other bound)."""
    from bench_fp8_decode_plans import TILES

    results = []
    for group in (4, 8):
        for block_n, warps, stages, maxnreg, prefetch in TILES:
            tile = None if block_n is None else (block_n, warps or 1)
            results.append(count("bf16", "fp8_kernel", stages, group=group, fp8_tile=tile, maxnreg=maxnreg,
                                 prefetch_table=prefetch))
    for r in results:
        regs = r["registers"]
        warps_by_regs = 65536 // (32 * (-(-regs // 8) * 8)) if regs else 0  # registers are allotted 8 at a time
        progs_by_regs = warps_by_regs // r["num_warps"]
        progs_by_smem = (228 << 10) // max(1, r["shared_bytes"] + 1024)  # 1 KB a block reserved by the driver
        r["programs_per_sm"] = min(progs_by_regs, progs_by_smem, 32, 64 // r["num_warps"])
        print(f"G {r['group']} BLOCK_N {r['block_n']:3d} warps {r['num_warps']} stages {r['num_stages']!s:7s} "
              f"maxnreg {r['maxnreg']!s:4s} prefetch {r['prefetch_table']!s:5s}: "
              f"{r['instructions_per_kv_element']:5.2f} a K/V element ({r['loop_instructions']} in the loop), "
              f"{r['instructions_outside_loop']} outside it, {regs} registers, {r['spill_bytes']} spill bytes, "
              f"{r['shared_bytes']} shared bytes; resident programs a SM: {progs_by_regs} by registers, "
              f"{progs_by_smem} by shared memory", flush=True)
    if out:
        Path(out).write_text(json.dumps({"target": "sm_90 (triton 3.6, bundled ptxas)", "results": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
