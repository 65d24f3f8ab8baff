"""The decode path's Triton kernels compiled for Hopper (sm_90) with and without Programmatic
Dependent Launch (``USE_PDL``), on a machine without a GPU, as ``scripts/w4a16_sass.py`` compiles.

For each kernel, at the shapes a batch-1 decode step of Qwen3-30B-A3B / llama-8b runs, both
variants are compiled through Triton's compiler and the ptxas it bundles; the script reports:

- the ``griddepcontrol`` instructions of the PTX (one ``wait`` and one ``launch_dependents`` with
  PDL, none without) and whether every global load (``ld.global``, ``cp.async``) and atomic comes
  after the ``wait`` in the PTX's text (the kernel then reads nothing an earlier kernel wrote
  before waiting); PTX order is program order for these: ptxas does not move memory accesses
  across ``griddepcontrol.wait``, which, like a barrier, orders the memory operations around it;
- the same in the SASS (the opcodes the two variants differ by, and the first global load's
  position against the wait's), registers, spills and instruction counts on and off.

    PYTHONPATH=service:plugins/.. python scripts/pdl_sass.py [--only TEXT] [--out FILE]

Exits non-zero when a PDL variant lacks either instruction, has a global load before its wait,
or differs from the plain variant by more than the two instructions and their scheduling
(registers or spills changed).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from w4a16_sass import _OP, disassemble  # noqa: E402 (the same disassembly)

# PTX global reads / atomics whose place against the wait is checked.
_PTX_MEM = re.compile(r"^\s*(?:@%p\d+\s+)?(ld\.global|cp\.async|atom\.|red\.|ld\.param)", re.M)
# SASS: global loads, asynchronous copies, atomics (LDG, LDGSTS, ATOMG, RED) and the PDL opcodes.
_SASS_MEM = ("LDG", "LDGSTS", "ATOMG", "ATOM", "RED", "UBLKCP", "UTMALDG")


@dataclass(frozen=True)
class Case:
    label: str
    kernel: Callable[[], Any]  # -> the JITFunction (imported lazily)
    sig: dict[str, str]
    consts: dict[str, Any]
    num_warps: int
    num_stages: int | None = None
    plain_ints: tuple[str, ...] = ()  # integer arguments not specialized as multiples of 16


def compile_sm90(fn: Any, sig: dict[str, str], consts: dict[str, Any], num_warps: int,
                 num_stages: int | None = None, plain_ints: tuple[str, ...] = ()) -> Any:
    """``fn`` compiled for sm_90: ``sig`` types its run-time arguments, ``consts`` its constexprs
    (those it leaves out keep the kernel's defaults, e.g. ``USE_PDL=False``); pointers and other
    integers 16-divisible, as Triton's launcher specializes the usual tensors and strides."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    params = inspect.signature(fn.fn).parameters
    all_consts = {n: params[n].default for n in names
                  if n not in sig and n not in consts and params[n].default is not inspect.Parameter.empty}
    all_consts.update(consts)
    full = {n: sig.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if (t.startswith("*") or t == "i32") and n not in plain_ints}
    options: dict[str, Any] = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    return triton.compile(ASTSource(fn, full, all_consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def _cases() -> list[Case]:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    from loom.layers import dense_gemv as dg
    from loom.layers import fused_moe_triton as fm
    from loom.layers import fused_ops as fo
    from loom.layers import moe_norm_router as nr
    from loom.layers import moe_router_gemv as mr
    from loom.layers import moe_routing_triton as rt
    from loom.layers import split_k as sk
    from loom_plugins.attention import triton_fp8_attention as f8
    from loom_plugins.attention import triton_kernels as tk
    from loom_plugins.quant import w4a16_triton as wt

    bf = "*bf16"
    gemv_sig = dict(x_ptr=bf, w_ptr=bf, scale_ptr="*fp32", bias_ptr=bf, out_ptr=bf, part_ptr="*fp32",
                    counter_ptr="*i32", M="i32", N="i32", K="i32", K_SPLIT="i32", SPLIT="i32", stride_xm="i32",
                    stride_wn="i32", stride_om="i32")
    gemv_consts = dict(HAS_BIAS=False, EVEN_K=True, IEEE=False, W_SCALE=False, X_F16=False, MAX_ROWS=dg.MAX_M,
                       BLOCK_M=16)
    norm_sig = dict(x_ptr=bf, res_ptr=bf, w_ptr=bf, out_ptr=bf, res_out_ptr=bf, ew_ptr=bf, stride_xt="i32",
                    stride_xr="i32", stride_rt="i32", stride_rr="i32", R="i32", H="i32", eps="fp32")
    qkn_sig = dict(q_ptr=bf, k_ptr=bf, q_out_ptr=bf, k_out_ptr=bf, qw_ptr=bf, kw_ptr=bf, pos_ptr="*i64",
                   cos_ptr="*fp32", sin_ptr="*fp32", stride_qt="i32", stride_qh="i32", stride_kt="i32",
                   stride_kh="i32", stride_cos="i32", HQ="i32", HKV="i32", D="i32", q_eps="fp32", k_eps="fp32")
    store_sig = dict(k_ptr=bf, v_ptr=bf, kc_ptr=bf, vc_ptr=bf, ks_ptr=bf, vs_ptr=bf, slot_ptr="*i64",
                     **{s: "i32" for s in ("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_kcb",
                                           "stride_kcs", "stride_kch", "stride_vcb", "stride_vcs", "stride_vch",
                                           "stride_sb", "stride_ss", "stride_sh")})
    attn_common = dict(q_ptr=bf, ks_ptr="*fp32", vs_ptr="*fp32", out_ptr=bf, part_o_ptr="*fp32",
                       part_lse_ptr="*fp32", qsl_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32",
                       seq_ids_ptr="*i32", qk_scale="fp32", window="i32", soft_cap="fp32", num_q_heads="i32",
                       stride_qt="i32", stride_qh="i32", stride_ot="i32", stride_oh="i32", stride_kcb="i32",
                       stride_kcs="i32", stride_kch="i32", stride_sb="i32", stride_ss="i32", stride_sh="i32",
                       stride_bt="i32")
    attn_sig = dict(attn_common, kc_ptr=bf, vc_ptr=bf, counter_ptr="*i32", min_keys="i32", stride_vcb="i32",
                    stride_vcs="i32", stride_vch="i32")
    attn_consts = dict(HEAD_DIM=128, BLOCK_D=128, GROUP=8, BLOCK_M=16, BLOCK_N=128, PAGE=16, NUM_SPLITS=16,
                       HAS_SEQ_IDS=False, HAS_WINDOW=False, HAS_SOFT_CAP=False, PRECISION="tf32", FP8_KV=False,
                       FUSED_COMBINE=True, BLOCK_S=16, stride_vcd=1)
    fp8_sig = dict(attn_common, kc_ptr="*fp8e4nv", vc_ptr="*fp8e4nv", stride_vcb="i32", stride_vch="i32",
                   stride_vcd="i32")
    fp8_consts = dict(HEAD_DIM=128, BLOCK_D=128, GROUP=4, BLOCK_M=8, BLOCK_N=64, PAGE=16, TILE_PAGES=4, TILE_W=16,
                      NUM_SPLITS=1, HAS_SEQ_IDS=False, HAS_WINDOW=False, HAS_SOFT_CAP=False, F32_DOTS=False)
    combine_sig = dict(out_ptr=bf, part_o_ptr="*fp32", part_lse_ptr="*fp32", qsl_ptr="*i32", seq_lens_ptr="*i32",
                       seq_ids_ptr="*i32", num_q_heads="i32", window="i32", min_keys="i32", stride_ot="i32",
                       stride_oh="i32")
    moe_ptrs = dict(w_ptr=bf, out_ptr=bf, sorted_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32",
                    scale_ptr="*fp32")
    cfg = fm.block_config(1, 1, _bf16())
    moe_consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION="tf32", DIRECT=True,
                      EVEN_K=True, stride_wk=1)
    router_sig = dict(x_ptr=bf, w_ptr=bf, logits_ptr=bf, part_ptr="*fp32", counter_ptr="*i32", weights_ptr=bf,
                      ids_ptr="*i32", M="i32", N="i32", K="i32", K_SPLIT="i32", SPLIT="i32", TILES="i32",
                      stride_xm="i32", stride_wn="i32", stride_l="i32")
    experts, top_k = 128, 8
    router_consts = dict(EVEN_K=True, IEEE=False, MAX_ROWS=dg.MAX_M, BLOCK_N=16, BLOCK_K=256, BLOCK_M=16, BLOCK_S=8,
                         TOP_K=top_k, ROUTE_T=rt.route_rows(experts), BLOCK_TK=8, BLOCK_E=rt._block_e(experts),
                         RENORMALIZE=True)
    router_sig_norm = {n: t for n, t in router_sig.items() if n not in ("x_ptr", "stride_xm")}
    router_sig_norm.update(stride_xt="i32", stride_rt="i32", eps="fp32")
    w4_sig = dict(x_ptr=bf, perm_ptr="*i32", qw_ptr="*i32", s_ptr=bf, z_ptr=bf, bias_ptr=bf, out_ptr="*fp32",
                  N="i32", K="i32", K_SPLIT="i32", stride_qk="i32", stride_sk="i32", stride_os="i32", MAGIC="i32",
                  HI_SHIFT="i32")
    w4_consts = dict(GROUP=128, BITS=4, F=8, WORDS=16, HAS_PERM=False, EVEN_K=True, X_PAIRS=True, HAS_BIAS=False,
                     PARTIAL=True, BLOCK_N=64, BLOCK_K=128)
    split_sig = dict(part_ptr="*fp32", bias_ptr=bf, out_ptr=bf, N="i32", SPLIT="i32", stride_ps="i32",
                     stride_pm="i32", stride_om="i32")
    return [
        Case("dense GEMV 64x128 (qkv)", lambda: dg._dense_gemv_kernel, gemv_sig,
             dict(gemv_consts, PARTIAL=False, FUSED_REDUCE=False, BLOCK_N=64, BLOCK_K=128, BLOCK_S=1), 4, 3,
             ("SPLIT", "M")),
        Case("dense GEMV split 8, last merges (o_proj)", lambda: dg._dense_gemv_kernel, gemv_sig,
             dict(gemv_consts, PARTIAL=True, FUSED_REDUCE=True, BLOCK_N=64, BLOCK_K=128, BLOCK_S=8), 4, 3,
             ("SPLIT", "M")),
        Case("split-K sum", lambda: sk.split_sum_kernel, split_sig, dict(HAS_BIAS=False, BLOCK_N=256), 4, None,
             ("SPLIT",)),
        Case("add + RMSNorm (H 2048)", lambda: fo._add_rms_norm_kernel, norm_sig,
             dict(HAS_RESIDUAL=True, BLOCK=2048, TOP_K=0), fo.norm_warps(2048)),
        Case("MoE combine + add + RMSNorm (k 8)", lambda: fo._add_rms_norm_kernel, norm_sig,
             dict(HAS_RESIDUAL=True, BLOCK=2048, TOP_K=8), fo.norm_warps(2048)),
        Case("add + RMSNorm + FP8 quantize (H 4096)", lambda: fo._add_rms_norm_quant_kernel,
             dict(x_ptr=bf, res_ptr=bf, w_ptr=bf, q_ptr="*fp8e4nv", scale_ptr="*fp32", res_out_ptr=bf,
                  static_ptr="*fp32", stride_xt="i32", stride_rt="i32", H="i32", eps="fp32"),
             dict(HAS_RESIDUAL=True, STATIC=False, BLOCK=4096), fo.norm_warps(4096)),
        Case("SiLU-and-mul + FP8 quantize (I 14336, two passes)", lambda: fo._silu_and_mul_quant_kernel,
             dict(x_ptr=bf, q_ptr="*fp8e4nv", scale_ptr="*fp32", static_ptr="*fp32", stride_xt="i32", INTER="i32"),
             dict(STATIC=False, BLOCK=fo._SILU_QUANT_BLOCK, ONE_PASS=False), fo._SILU_QUANT_WARPS),
        Case("qk_norm_rotary (d 128)", lambda: fo._qk_norm_rotary_kernel, qkn_sig,
             dict(HALF=64, BLOCK=128, BLOCK_HALF=64, GEMMA=False), fo.norm_warps(128)),
        Case("store_kv (4 KV heads, d 128)", lambda: tk._store_kv_kernel, store_sig,
             dict(NUM_KV_HEADS=4, HEAD_DIM=128, BLOCK_H=4, BLOCK_D=128, PAGE=16, FP8_KV=False, stride_vcd=1), 4),
        Case("paged decode, 16 splits, last merges (G 8)", lambda: tk._paged_attn_kernel, attn_sig, attn_consts, 4,
             2),
        Case("paged decode combine (16 splits)", lambda: tk._combine_kernel, combine_sig,
             dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=16, BLOCK_S=16, BLOCK_N=128, HAS_SEQ_IDS=False,
                  HAS_WINDOW=False), 4),
        Case("FP8 paged decode (G 4)", lambda: f8._paged_attn_fp8_kernel, fp8_sig, fp8_consts, 1),
        Case("MoE router + routing (E 128, k 8)", lambda: mr._router_route_kernel, router_sig, router_consts, 4, 3,
             ("M", "SPLIT", "TILES")),
        Case("residual norm + MoE router + routing (H 2048, E 128, k 8)", lambda: nr._norm_router_route_kernel,
             dict(x_ptr=bf, res_ptr=bf, norm_w_ptr=bf, normed_ptr=bf, res_out_ptr=bf, **router_sig_norm), dict(
                 router_consts, NW=8, LOG_NW=3, WARP_COLS=256, WARP_SUM=True), 4, 3, ("M", "SPLIT", "TILES")),
        Case("MoE gate/up, direct", lambda: fm._gate_up_kernel,
             dict(x_ptr=bf, **moe_ptrs, N="i32", K="i32", INTER="i32", stride_xt="i32", stride_we="i32",
                  stride_wn="i32", stride_ot="i32", stride_se="i32"), dict(moe_consts, TOP_K=top_k), cfg.num_warps,
             cfg.num_stages,
             ("N",)),
        Case("MoE down, direct", lambda: fm._down_kernel,
             dict(a_ptr=bf, **moe_ptrs, N="i32", K="i32", H="i32", stride_at="i32", stride_we="i32",
                  stride_wn="i32", stride_ot="i32", stride_se="i32"), moe_consts, cfg.num_warps, cfg.num_stages,
             ("N",)),
        Case("W4A16 int GEMV (g128, 64x128)", lambda: wt._gemv_int_kernel, w4_sig, w4_consts, 4, 2,
             ("K_SPLIT", "MAGIC", "HI_SHIFT")),
    ]


def _bf16() -> Any:
    import torch

    return torch.bfloat16


def _ptx_report(ptx: str) -> dict[str, Any]:
    waits = ptx.count("griddepcontrol.wait")
    launches = ptx.count("griddepcontrol.launch_dependents")
    body = ptx[ptx.find("{", ptx.find(".entry")):]
    wait_at = body.find("griddepcontrol.wait")
    mem = [m.start() for m in _PTX_MEM.finditer(body) if not m.group(1).startswith("ld.param")]
    before = sum(1 for p in mem if wait_at >= 0 and p < wait_at)
    return {"ptx_wait": waits, "ptx_launch_dependents": launches, "ptx_global_accesses": len(mem),
            "ptx_global_accesses_before_wait": before}


def _sass_ops(sass: str) -> list[str]:
    return _OP.findall(sass)


def _sass_report(ops: list[str], new_ops: set[str]) -> dict[str, Any]:
    """Where the first global memory access sits against the first opcode only the PDL variant has."""
    first_new = next((i for i, op in enumerate(ops) if op in new_ops), -1)
    first_mem = next((i for i, op in enumerate(ops) if op in _SASS_MEM), -1)
    return {"sass_first_pdl_op_at": first_new, "sass_first_global_access_at": first_mem}


def check(case: Case) -> dict[str, Any]:
    fn = case.kernel()
    out: dict[str, Any] = {"case": case.label, "kernel": fn.fn.__name__}
    variants = {}
    for pdl in (False, True):
        compiled = compile_sm90(fn, case.sig, {**case.consts, "USE_PDL": pdl}, case.num_warps, case.num_stages,
                                case.plain_ints)
        sass, regs, spills = disassemble(compiled)
        variants[pdl] = (compiled, _sass_ops(sass), regs, spills)
    (c_off, ops_off, regs_off, sp_off), (c_on, ops_on, regs_on, sp_on) = variants[False], variants[True]
    diff = collections.Counter(ops_on)
    diff.subtract(collections.Counter(ops_off))
    added = {op: n for op, n in diff.items() if n > 0}
    removed = {op: -n for op, n in diff.items() if n < 0}
    out.update(instructions_off=len(ops_off), instructions_on=len(ops_on), registers_off=regs_off,
               registers_on=regs_on, spills_off=sp_off, spills_on=sp_on, opcodes_added=added,
               opcodes_removed=removed, ptx_off=_ptx_report(c_off.asm["ptx"]), ptx_on=_ptx_report(c_on.asm["ptx"]),
               sass_on=_sass_report(ops_on, set(added)))
    problems = []
    if out["ptx_on"]["ptx_wait"] != 1 or out["ptx_on"]["ptx_launch_dependents"] != 1:
        problems.append("PDL variant lacks a griddepcontrol instruction")
    if out["ptx_off"]["ptx_wait"] or out["ptx_off"]["ptx_launch_dependents"]:
        problems.append("plain variant has griddepcontrol")
    if out["ptx_on"]["ptx_global_accesses_before_wait"]:
        problems.append("a global access precedes the wait in the PTX")
    s = out["sass_on"]
    if s["sass_first_global_access_at"] >= 0 and not 0 <= s["sass_first_pdl_op_at"] < s["sass_first_global_access_at"]:
        problems.append("a global access precedes the first PDL opcode in the SASS")
    if regs_on != regs_off or sp_on != sp_off:
        problems.append(f"registers / spills changed: {regs_off}/{sp_off} -> {regs_on}/{sp_on}")
    out["problems"] = problems
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--only", help="only the cases whose label contains this text")
    args = parser.parse_args()
    rows = []
    for case in _cases():
        if args.only and args.only not in case.label:
            continue
        try:
            row = check(case)
        except Exception as exc:  # reported, and the script fails
            row = {"case": case.label, "problems": [f"{type(exc).__name__}: {exc}"]}
        rows.append(row)
        if "instructions_off" in row:
            print(f"{'ok  ' if not row['problems'] else 'FAIL'} {row['case']}: {row['instructions_off']} -> "
                  f"{row['instructions_on']} SASS instructions (+{row['opcodes_added']} -{row['opcodes_removed']}), "
                  f"registers {row['registers_off']} -> {row['registers_on']}, spills {row['spills_on']}; PTX "
                  f"wait {row['ptx_on']['ptx_wait']}, launch_dependents {row['ptx_on']['ptx_launch_dependents']}, "
                  f"{row['ptx_on']['ptx_global_accesses']} global accesses, "
                  f"{row['ptx_on']['ptx_global_accesses_before_wait']} before the wait; SASS first PDL op at "
                  f"{row['sass_on']['sass_first_pdl_op_at']}, first global access at "
                  f"{row['sass_on']['sass_first_global_access_at']}"
                  + (f": {'; '.join(row['problems'])}" if row["problems"] else ""))
        else:
            print(f"FAIL {row['case']}: {'; '.join(row['problems'])}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    if any(r["problems"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
