"""Fused kernels compiled for Hopper (sm_90) on a machine without a GPU (Triton's front end, its
GPU passes and the ptxas it bundles; no launch), each next to the kernel(s) whose results it must
reproduce bit for bit:

* ``routing``: the MoE decode path's ``_route_sort_kernel`` against ``_route_kernel``
  (``loom.layers.moe_routing_triton``);
* ``qk_norm_rotary``: ``fused_ops._qk_norm_rotary_kernel`` against ``_add_rms_norm_kernel`` on
  one head;
* ``rope_store``: the paged backend's RoPE-and-store kernel against ``_qk_norm_rotary_kernel``;
* ``combine_norm``: ``_add_rms_norm_kernel`` summing an MoE layer's expert rows first (``TOP_K``)
  against it adding a plain residual;
* ``router_epilogue``: ``moe_router_gemv._router_route_kernel`` against the dense GEMV's kernel
  (split K, merged by the last split) followed by ``_route_kernel``;
* ``norm_router``: ``moe_norm_router._norm_router_route_kernel`` against ``_add_rms_norm_kernel``
  (the sum of squares: the norm's 8-warp layout and butterflies against the fused kernel's warp
  rows and pairwise tree; see that module) and ``_router_route_kernel`` (every other reduction and
  the dot alike; its SASS the same with and without FMA contraction, which the fused kernel
  compiles without, as the norm does);
* ``quantized_input``: ``fused_ops._add_rms_norm_quant_kernel`` against ``_add_rms_norm_kernel``
  (its sum of squares first, in the same layout: the same normed values, whose max and codes
  follow), and ``_silu_and_mul_quant_kernel`` at the launches ``silu_and_mul_quant``'s rule makes
  (SmolLM2's row in one block, llama-8b's in two passes), none spilling;
* ``greedy``: the sampler's one-launch greedy pick (``loom.sample.greedy_triton``), alone;
* ``expert_pipelining``: the MoE expert kernels with whole K tiles load through cp.async (the
  software pipeline a K mask in the loop kept triton 3.6 from building), without spills, for
  dense bf16 experts and FP8 ones (scales per channel and per block).

Checks what the interpreter cannot: that each kernel compiles, without register spills, and that
the fused kernel reduces every float32 value (softmax max and sum, argmax, renormalisation; the
sum of squares) over the same tile shapes in the same register layouts as the other: the
reduction order is fixed by the layout, so the two give the same bits on the GPU too (the
interpreter only shows it for numpy's order). Run as a script in its own process, without
``TRITON_INTERPRET``, with the group to check (``tests/unit/test_fused_moe.py`` and
``tests/unit/test_fused_layers.py`` run it). Prints one line per case; exits non-zero on a failure.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def compile_for_hopper(fn: Any, sig: dict[str, str], consts: dict[str, Any], num_warps: int) -> Any:
    """``fn`` compiled for sm_90 with pointers and strides 16-aligned (as Triton's launcher
    specializes the usual tensors; the token count T never is)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n.startswith("stride")}
    full = {**sig, **{c: "constexpr" for c in consts}}
    return triton.compile(ASTSource(fn, full, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def float_reductions(ttgir: str) -> list[str]:
    """Each float32 ``tt.reduce`` of a kernel's TTGIR as ``shape @ layout`` (the layout spelled
    out, not by its local alias), in program order."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.[^\n]+)$", ttgir, flags=re.M))
    out = []
    for operands in re.findall(r"^\s+\}\) : \((tensor<[^)]*?)\) ->", ttgir, flags=re.M):
        first = re.match(r"tensor<([\dx]+xf32), (#\w+)>", operands)  # a reduction's first operand
        if first:
            out.append(f"{first.group(1)} @ {aliases.get(first.group(2), first.group(2))}")
    return out


def _spills(compiled: Any) -> tuple[int, int]:
    sys.path.insert(0, str(ROOT / "scripts"))
    from w4a16_sass import disassemble

    _, regs, spills = disassemble(compiled)
    return regs, spills


def _compare(label: str, name: str, reference: tuple[str, Any], fused: tuple[str, Any]) -> int:
    """One line for ``fused`` against ``reference`` (each (kernel name, compiled)): 1 on a failure."""
    want, got = float_reductions(reference[1].asm["ttgir"]), float_reductions(fused[1].asm["ttgir"])
    usage = {kernel: _spills(c) for kernel, c in (reference, fused)}
    problems = [f"{kernel} spills {spills} bytes" for kernel, (_, spills) in usage.items() if spills]
    if not want or got != want:
        problems.append(f"float reductions differ: {want} vs {got}")
    regs = ", ".join(f"{kernel} {r} registers" for kernel, (r, _) in usage.items())
    print(f"{'FAIL' if problems else 'ok  '} {label} {name}: {len(want)} float reductions alike; {regs}"
          f"{': ' + '; '.join(problems) if problems else ''}")
    return int(bool(problems))


def check_routing() -> int:
    from loom.layers import moe_routing_triton as rt

    failed = 0
    route_sig = dict(logits_ptr="*bf16", weights_ptr="*bf16", ids_ptr="*i32", T="i32", E="i32", stride_l="i32")
    fused_sig = dict(logits_ptr="*bf16", weights_ptr="*bf16", ids_ptr="*i32", sorted_ptr="*i32",
                     block_expert_ptr="*i32", num_padded_ptr="*i32", T="i32", E="i32", stride_l="i32")
    for experts, k, dtype, wdtype, block_m in ((128, 8, "bf16", "bf16", 16), (8, 2, "fp32", "fp32", 16),
                                               (60, 4, "fp16", "fp16", 16), (512, 10, "fp32", "fp32", 32),
                                               (1024, 4, "bf16", "bf16", 16)):
        rows, block_k, block_e = rt.route_rows(experts), rt._next_pow2(k), rt._block_e(experts)
        consts: dict[str, Any] = dict(K=k, BLOCK_T=rows, BLOCK_K=block_k, BLOCK_E=block_e, RENORMALIZE=True)
        types = dict(logits_ptr=f"*{dtype}", weights_ptr=f"*{wdtype}")
        fused_consts = {**consts, "BLOCK_M": block_m, "CHUNK": min(rt._SORT_CHUNK, block_e),
                        "MAX_BLOCKS": rt._next_pow2(rt._cdiv(rows * block_k, block_m))}
        name = f"E={experts} k={k} {dtype} block_m={block_m}"
        try:
            route = compile_for_hopper(rt._route_kernel, {**route_sig, **types}, consts, rt.ROUTE_WARPS)
            fused = compile_for_hopper(rt._route_sort_kernel, {**fused_sig, **types}, fused_consts, rt.ROUTE_WARPS)
        except Exception as exc:  # reported: the script fails
            failed += 1
            print(f"FAIL routing {name}: {type(exc).__name__}: {exc}")
            continue
        failed += _compare("routing", name, ("route", route), ("route_sort", fused))
    return failed


def check_qk_norm_rotary() -> int:
    from loom.layers import fused_ops

    failed = 0
    for dtype, head_dim in (("bf16", 128), ("bf16", 64), ("fp16", 256), ("fp32", 128)):
        block = fused_ops._next_pow2(head_dim)
        warps = fused_ops.norm_warps(block)
        act = f"*{dtype}"
        norm_sig = dict(x_ptr=act, res_ptr=act, w_ptr=act, out_ptr=act, res_out_ptr=act, ew_ptr=act,
                        stride_xt="i32", stride_xr="i32", stride_rt="i32", stride_rr="i32", R="i32", H="i32",
                        eps="fp32")
        fused_sig = dict(q_ptr=act, k_ptr=act, q_out_ptr=act, k_out_ptr=act, qw_ptr=act, kw_ptr=act,
                         pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", stride_qt="i32", stride_qh="i32",
                         stride_kt="i32", stride_kh="i32", stride_cos="i32", HQ="i32", HKV="i32", D="i32",
                         q_eps="fp32", k_eps="fp32")
        name = f"{dtype} head_dim={head_dim}"
        try:
            norm = compile_for_hopper(fused_ops._add_rms_norm_kernel, norm_sig,
                                      dict(HAS_RESIDUAL=False, BLOCK=block, TOP_K=0), warps)
            fused = compile_for_hopper(fused_ops._qk_norm_rotary_kernel, fused_sig,
                                       dict(HALF=head_dim // 2, BLOCK=block, BLOCK_HALF=block // 2, GEMMA=False),
                                       warps)
        except Exception as exc:  # reported: the script fails
            failed += 1
            print(f"FAIL qk_norm_rotary {name}: {type(exc).__name__}: {exc}")
            continue
        failed += _compare("qk_norm_rotary", name, ("add_rms_norm", norm), ("qk_norm_rotary", fused))
    return failed


def check_rope_store() -> int:
    """The paged backend's RoPE-and-store kernel (``_rope_store_kernel``) with Qwen3's per-head
    norms, against ``_qk_norm_rotary_kernel``: each of its float32 sums of squares (a q head's and
    a K head's) in the layout of the qk-norm kernel's one (so the same normalised heads), at the
    launch ``rope_store`` makes, into a bf16 and an FP8 pool, without spills; and the plain RoPE
    (no norm) compiles too."""
    from loom.layers import fused_ops
    from loom_plugins.attention import triton_kernels as tk

    failed = 0
    for head_dim, fp8 in ((128, False), (128, True), (64, False)):
        block = fused_ops._next_pow2(head_dim)
        warps = fused_ops.norm_warps(block)
        act = "*bf16"
        fused_sig = dict(q_ptr=act, k_ptr=act, q_out_ptr=act, k_out_ptr=act, qw_ptr=act, kw_ptr=act,
                         pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", stride_qt="i32", stride_qh="i32",
                         stride_kt="i32", stride_kh="i32", stride_cos="i32", HQ="i32", HKV="i32", D="i32",
                         q_eps="fp32", k_eps="fp32")
        pool = "*fp8e4nv" if fp8 else act
        store_sig = dict(q_ptr=act, k_ptr=act, v_ptr=act, q_out_ptr=act, qw_ptr=act, kw_ptr=act, pos_ptr="*i64",
                         cos_ptr="*fp32", sin_ptr="*fp32", kc_ptr=pool, vc_ptr=pool, ks_ptr="*fp32" if fp8 else act,
                         vs_ptr="*fp32" if fp8 else act, slot_ptr="*i64",
                         **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                                               "stride_vh", "stride_cos", "stride_kcb", "stride_kcs", "stride_kch",
                                               "stride_vcb", "stride_vcs", "stride_vch", "stride_vcd", "stride_sb",
                                               "stride_ss", "stride_sh", "HQ", "D")},
                         q_eps="fp32", k_eps="fp32")
        name = f"bf16 head_dim={head_dim}{' FP8 pool' if fp8 else ''}"
        consts = dict(HALF=head_dim // 2, BLOCK=block, BLOCK_HALF=block // 2, GEMMA=False)
        try:
            ref = compile_for_hopper(fused_ops._qk_norm_rotary_kernel, fused_sig, consts, warps)
            got = compile_for_hopper(tk._rope_store_kernel, store_sig, dict(**consts, NORM=True, PAGE=16, FP8_KV=fp8),
                                     warps)
            plain = compile_for_hopper(tk._rope_store_kernel, store_sig,
                                       dict(**consts, NORM=False, PAGE=16, FP8_KV=fp8), warps)
        except Exception as exc:  # reported: the script fails
            failed += 1
            print(f"FAIL rope_store {name}: {type(exc).__name__}: {exc}")
            continue
        want = float_reductions(ref.asm["ttgir"])
        sums = [r for r in float_reductions(got.asm["ttgir"]) if r in want]
        spills = {kernel: _spills(c)[1] for kernel, c in (("rope_store", got), ("rope_store plain", plain))}
        ok = len(want) == 1 and len(sums) == 2 and not any(spills.values())
        print(f"{'ok  ' if ok else 'FAIL'} rope_store {name}: {len(sums)} sums of squares in the qk-norm kernel's "
              f"layout; spills {spills}")
        failed += int(not ok)
    return failed


def check_combine_norm() -> int:
    from loom.layers import fused_ops

    failed = 0
    for dtype, wdtype, hidden, k in (("bf16", "bf16", 2048, 8), ("bf16", "fp32", 4096, 2), ("fp32", "fp32", 2048, 8)):
        act = f"*{dtype}"
        sig = dict(x_ptr=act, res_ptr=act, w_ptr=act, out_ptr=act, res_out_ptr=act, ew_ptr=f"*{wdtype}",
                   stride_xt="i32", stride_xr="i32", stride_rt="i32", stride_rr="i32", R="i32", H="i32", eps="fp32")
        block = fused_ops._next_pow2(hidden)
        name = f"{dtype} hidden={hidden} k={k} weights {wdtype}"
        try:
            plain = compile_for_hopper(fused_ops._add_rms_norm_kernel, sig,
                                       dict(HAS_RESIDUAL=True, BLOCK=block, TOP_K=0), fused_ops.norm_warps(block))
            fused = compile_for_hopper(fused_ops._add_rms_norm_kernel, sig,
                                       dict(HAS_RESIDUAL=True, BLOCK=block, TOP_K=k), fused_ops.norm_warps(block))
        except Exception as exc:  # reported: the script fails
            failed += 1
            print(f"FAIL combine_norm {name}: {type(exc).__name__}: {exc}")
            continue
        failed += _compare("combine_norm", name, ("add_rms_norm", plain), ("combine_add_rms_norm", fused))
    return failed


def check_router_epilogue() -> int:
    """``moe_router_gemv._router_route_kernel`` against the dense GEMV (split K, merged by the last
    split) followed by ``_route_kernel``: the split sums then the routing's reductions, alike."""
    from loom.layers import dense_gemv as dg
    from loom.layers import moe_router_gemv as mr
    from loom.layers import moe_routing_triton as rt

    failed = 0
    for experts, k, dtype, wdtype, (bn, bk, split, warps) in (
            (128, 8, "bf16", "bf16", (16, 256, 8, 4)),  # Qwen3-30B-A3B's router plan (H200 table)
            (8, 2, "fp16", "fp32", (16, 256, 4, 4))):  # Mixtral-like: float32 weights
        block_s = rt._next_pow2(split)
        gemv_sig = dict(x_ptr=f"*{dtype}", w_ptr=f"*{dtype}", bias_ptr=f"*{dtype}", out_ptr=f"*{dtype}",
                        part_ptr="*fp32", counter_ptr="*i32", M="i32", N="i32", K="i32", K_SPLIT="i32", SPLIT="i32",
                        stride_xm="i32", stride_wn="i32", stride_om="i32")
        gemv_consts: dict[str, Any] = dict(HAS_BIAS=False, PARTIAL=True, FUSED_REDUCE=True, EVEN_K=True, IEEE=False,
                                           MAX_ROWS=dg.MAX_M, BLOCK_N=bn, BLOCK_K=bk, BLOCK_M=16, BLOCK_S=block_s)
        route_sig = dict(logits_ptr=f"*{dtype}", weights_ptr=f"*{wdtype}", ids_ptr="*i32", T="i32", E="i32",
                         stride_l="i32")
        rows, block_k, block_e = rt.route_rows(experts), rt._next_pow2(k), rt._block_e(experts)
        route_consts: dict[str, Any] = dict(K=k, BLOCK_T=rows, BLOCK_K=block_k, BLOCK_E=block_e, RENORMALIZE=True)
        fused_sig = dict(x_ptr=f"*{dtype}", w_ptr=f"*{dtype}", logits_ptr=f"*{dtype}", part_ptr="*fp32",
                         counter_ptr="*i32", weights_ptr=f"*{wdtype}", ids_ptr="*i32", M="i32", N="i32", K="i32",
                         K_SPLIT="i32", SPLIT="i32", TILES="i32", stride_xm="i32", stride_wn="i32",
                         stride_l="i32")
        fused_consts: dict[str, Any] = dict(EVEN_K=True, IEEE=False, MAX_ROWS=dg.MAX_M, BLOCK_N=bn, BLOCK_K=bk,
                                            BLOCK_M=16, BLOCK_S=block_s, TOP_K=k, ROUTE_T=rows, BLOCK_TK=block_k,
                                            BLOCK_E=block_e, RENORMALIZE=True)
        name = f"E={experts} k={k} {dtype} -> {wdtype} plan {bn}x{bk} split {split}"
        try:
            gemv = compile_for_hopper(dg._dense_gemv_kernel, gemv_sig, gemv_consts, warps)
            route = compile_for_hopper(rt._route_kernel, route_sig, route_consts, rt.ROUTE_WARPS)
            fused = compile_for_hopper(mr._router_route_kernel, fused_sig, fused_consts, warps)
        except Exception as exc:  # reported: the script fails
            failed += 1
            print(f"FAIL router epilogue {name}: {type(exc).__name__}: {exc}")
            continue
        want = float_reductions(gemv.asm["ttgir"]) + float_reductions(route.asm["ttgir"])
        got = float_reductions(fused.asm["ttgir"])
        usage = {kernel: _spills(c) for kernel, c in (("gemv", gemv), ("route", route), ("fused", fused))}
        problems = [f"{kernel} spills {spills} bytes" for kernel, (_, spills) in usage.items() if spills]
        if not want or got != want:
            problems.append(f"float reductions differ: {want} vs {got}")
        regs = ", ".join(f"{kernel} {r} registers" for kernel, (r, _) in usage.items())
        print(f"{'FAIL' if problems else 'ok  '} router epilogue {name}: {len(want)} float reductions alike; {regs}"
              f"{': ' + '; '.join(problems) if problems else ''}")
        failed += int(bool(problems))
    return failed


def _reductions_with_axis(ttgir: str) -> list[str]:
    """Each float32 ``tt.reduce`` of a kernel's TTGIR as ``axis A shape @ layout`` (layouts spelled
    out, slices of another layout included), in program order."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.[^\n]+)$", ttgir, flags=re.M))
    spell = lambda text: re.sub(r"#\w+\b(?!<)", lambda m: aliases.get(m.group(0), m.group(0)), text)  # noqa: E731
    out = []
    for axis, operand in re.findall(r'"tt\.reduce"\([^)]*\) <\{axis = (\d+) : i32\}> \(\{.*?\}\) : \((tensor<[^)]*?)\) ->',
                                    ttgir, flags=re.S):
        first = re.match(r"tensor<([\dx]+xf32), (.*)>$", operand.split(", tensor<")[0])
        if first:
            out.append(f"axis {axis} {first.group(1)} @ {spell(first.group(2))}")
    return out


def _butterflies(ptx: str) -> list[int]:
    return [int(m) for m in re.findall(r"shfl\.sync\.bfly\.b32\s+%r\d+, %r\d+, (\d+),", ptx)]


def _dots(ttgir: str) -> list[str]:
    """The ``tt.dot`` operations' types, layouts spelled out."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.[^\n]+)$", ttgir, flags=re.M))
    out = []
    for types in re.findall(r"tt\.dot [^:]*: (.*?) loc", ttgir):
        out.append(re.sub(r"#\w+", lambda m: aliases.get(m.group(0), m.group(0)), types))
    return out


def _sass_ops(compiled: Any) -> list[str]:
    sys.path.insert(0, str(ROOT / "scripts"))
    from w4a16_sass import disassemble

    sass, _, _ = disassemble(compiled)
    return [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in sass.splitlines()
            if re.match(r"^\s+/\*[0-9a-f]+\*/", line)]


def check_norm_router() -> int:
    """``moe_norm_router._norm_router_route_kernel`` against ``_add_rms_norm_kernel`` and
    ``_router_route_kernel``, each compiled as Triton's launcher specializes it (aligned pointers,
    strides and hidden sizes divisible by 16, the norm's R = 1 a constant, no FMA contraction where
    the launch turns it off)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loom.layers import dense_gemv as dg
    from loom.layers import fused_ops
    from loom.layers import moe_norm_router as nr
    from loom.layers import moe_router_gemv as mr
    from loom.layers import moe_routing_triton as rt

    def build(fn: Any, sig: dict[str, str], consts: dict[str, Any], divisible: tuple[str, ...], warps: int,
              stages: int, fusion: bool) -> Any:
        names = list(fn.arg_names)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig
                 if n.endswith("_ptr") or n.startswith("stride") or n in divisible}
        full = {n: sig.get(n, "constexpr") for n in names}
        return triton.compile(ASTSource(fn, full, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": fusion})

    failed = 0
    for experts, k, dtype, wdtype, hidden, (bn, bk, split, warps, stages) in (
            (128, 8, "bf16", "bf16", 2048, (16, 256, 8, 4, 4)),  # Qwen3-30B-A3B's router plan (H200 table)
            (8, 2, "fp16", "fp32", 4096, (16, 256, 4, 4, 3)),  # Mixtral-like: 16 norm warps, float32 weights
            (60, 4, "bf16", "bf16", 1024, (16, 128, 2, 4, 2))):  # 4 norm warps
        act = f"*{dtype}"
        block = fused_ops._next_pow2(hidden)
        nw = fused_ops.norm_warps(block)
        name = f"E={experts} k={k} {dtype} H={hidden} plan {bn}x{bk} split {split}"
        norm_sig = dict(x_ptr=act, res_ptr=act, w_ptr=act, out_ptr=act, res_out_ptr=act, ew_ptr=act,
                        stride_xt="i32", stride_xr="i32", stride_rt="i32", stride_rr="i32", H="i32", eps="fp32")
        router_sig = dict(x_ptr=act, w_ptr=act, logits_ptr=act, part_ptr="*fp32", counter_ptr="*i32",
                          weights_ptr=f"*{wdtype}", ids_ptr="*i32", M="i32", N="i32", K="i32", K_SPLIT="i32",
                          SPLIT="i32", TILES="i32", stride_xm="i32", stride_wn="i32", stride_l="i32")
        fused_sig = dict(x_ptr=act, res_ptr=act, norm_w_ptr=act, normed_ptr=act, res_out_ptr=act, w_ptr=act,
                         logits_ptr=act, part_ptr="*fp32", counter_ptr="*i32", weights_ptr=f"*{wdtype}",
                         ids_ptr="*i32", M="i32", N="i32", K="i32", K_SPLIT="i32", SPLIT="i32", TILES="i32",
                         stride_xt="i32", stride_rt="i32", stride_wn="i32", stride_l="i32", eps="fp32")
        rows, block_k, block_e = rt.route_rows(experts), rt._next_pow2(k), rt._block_e(experts)
        router_consts: dict[str, Any] = dict(EVEN_K=True, IEEE=False, MAX_ROWS=dg.MAX_M, BLOCK_N=bn, BLOCK_K=bk,
                                             BLOCK_M=16, BLOCK_S=rt._next_pow2(split), TOP_K=k, ROUTE_T=rows,
                                             BLOCK_TK=block_k, BLOCK_E=block_e, RENORMALIZE=True)
        fused_consts = {**router_consts, "NW": nw, "LOG_NW": nw.bit_length() - 1, "WARP_COLS": nr._WARP_COLS,
                        "WARP_SUM": True}
        sizes = ("N", "K", "K_SPLIT", "H")
        try:
            norm = build(fused_ops._add_rms_norm_kernel, norm_sig, dict(R=1, HAS_RESIDUAL=True, BLOCK=block, TOP_K=0),
                         sizes, nw, 3, False)
            router = build(mr._router_route_kernel, router_sig, router_consts, sizes, warps, stages, True)
            router_exact = build(mr._router_route_kernel, router_sig, router_consts, sizes, warps, stages, False)
            fused = build(nr._norm_router_route_kernel, fused_sig, fused_consts, sizes, warps, stages, False)
        except Exception as exc:  # reported: the script fails
            failed += 1
            print(f"FAIL norm router {name}: {type(exc).__name__}: {exc}")
            continue
        problems = []
        norm_red = _reductions_with_axis(norm.asm["ttgir"])
        want_norm = [f"axis 0 {block}xf32 @ #ttg.blocked<{{sizePerThread = [8], threadsPerWarp = [32], "
                     f"warpsPerCTA = [{nw}], order = [0]}}>"]
        if norm_red != want_norm:
            problems.append(f"the norm's layout is not the one the fused sum reproduces: {norm_red}")
        tree = [1 << i for i in range(4, -1, -1)] + [1 << i for i in range(nw.bit_length() - 2, -1, -1)]
        if _butterflies(norm.asm["ptx"]) != tree:
            problems.append(f"the norm's shuffles {_butterflies(norm.asm['ptx'])}, expected {tree}")
        got = _reductions_with_axis(fused.asm["ttgir"])
        per_row = 2 + (nw.bit_length() - 1)  # the warp rows, each pairwise level, the last value
        norm_part, router_part = got[: dg.MAX_M * per_row], got[dg.MAX_M * per_row:]
        warp_rows = (f"axis 1 {nw}x{nr._WARP_COLS}xf32 @ #ttg.blocked<{{sizePerThread = [1, 8], "
                     f"threadsPerWarp = [1, 32], warpsPerCTA = [")
        for r in range(dg.MAX_M):
            row = norm_part[r * per_row:(r + 1) * per_row]
            pairs = row[1:-1]
            if (not row or not row[0].startswith(warp_rows) or ", 1], order = [1, 0]}>" not in row[0]
                    or not all(p.startswith("axis 0 2x") for p in pairs) or not row[-1].startswith("axis 0 1xf32")):
                problems.append(f"row {r}'s sum of squares is not warp rows then pairs: {row}")
        if router_part != _reductions_with_axis(router.asm["ttgir"]):
            problems.append("the router's reductions differ")
        if _dots(fused.asm["ttgir"]) != _dots(router.asm["ttgir"]):
            problems.append(f"the dots differ: {_dots(fused.asm['ttgir'])} vs {_dots(router.asm['ttgir'])}")
        if _sass_ops(router) != _sass_ops(router_exact):
            problems.append("the router's SASS changes without FMA contraction")
        usage = {kernel: _spills(c) for kernel, c in (("norm", norm), ("router", router), ("fused", fused))}
        problems += [f"{kernel} spills {spills} bytes" for kernel, (_, spills) in usage.items() if spills]
        regs = ", ".join(f"{kernel} {r} registers" for kernel, (r, _) in usage.items())
        print(f"{'FAIL' if problems else 'ok  '} norm router {name}: the norm's {nw}-warp sum as warp rows + "
              f"pairs, {len(router_part)} router reductions and the dot alike; {regs}"
              f"{': ' + '; '.join(problems) if problems else ''}")
        failed += int(bool(problems))
    return failed


def check_expert_pipelining() -> int:
    """The MoE expert kernels (``fused_moe_triton``) at the Qwen3-30B-A3B decode tiles, sorted and
    direct, as Triton's launcher specializes them (``stride_wk`` == 1): with whole K tiles
    (``EVEN_K``) the weight loads are software-pipelined (cp.async into shared memory), and no
    variant spills registers."""
    from loom.layers import fused_moe_triton as f

    failed = 0
    cfg = f.block_config(8, 128, torch_bf16())
    # dense experts; FP8 experts (codes, scales per channel, fp16 dots); block-wise FP8 (128 x 128)
    variants = (("bf16", "bf16", {}), ("fp8e4nv", "fp8e4nv", {"W_SCALE": True, "X_F16": True}),
                ("fp8e4nv blocks", "fp8e4nv", {"W_SCALE": True, "X_F16": True, "SCALE_BN": 128, "SCALE_BK": 128}))
    for weights, wtype, fp8 in variants:
        ptrs = dict(w_ptr=f"*{wtype}", out_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
                    num_padded_ptr="*i32", scale_ptr="*fp32")
        kernels = (("gate_up", f._gate_up_kernel,
                    dict(x_ptr="*bf16", **ptrs, N="i32", K="i32", INTER="i32", stride_xt="i32", stride_we="i32",
                         stride_wn="i32", stride_ot="i32", stride_se="i32"), {"TOP_K": 8, **fp8}),
                   ("down", f._down_kernel,
                    dict(a_ptr="*bf16", **ptrs, N="i32", K="i32", H="i32", stride_at="i32", stride_we="i32",
                         stride_wn="i32", stride_ot="i32", stride_se="i32"), fp8))
        failed += _check_expert_kernels(kernels, cfg, weights)
    return failed


def _check_expert_kernels(kernels: Any, cfg: Any, weights: str) -> int:
    failed = 0
    for name, fn, sig, extra in kernels:
        for direct in (False, True):
            consts: dict[str, Any] = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                          PRECISION="tf32", DIRECT=direct, EVEN_K=True, stride_wk=1, **extra)
            label = f"{name} {'direct' if direct else 'sorted'} {weights} weights {cfg}"
            try:
                compiled = compile_for_hopper_staged(fn, sig, consts, cfg.num_warps, cfg.num_stages)
            except Exception as exc:  # reported: the script fails
                failed += 1
                print(f"FAIL experts {label}: {type(exc).__name__}: {exc}")
                continue
            copies = compiled.asm["ttgir"].count("async_copy_global_to_local")
            regs, spills = _spills(compiled)
            ok = copies > 0 and spills == 0
            print(f"{'ok  ' if ok else 'FAIL'} experts {label}: {copies} cp.async in the loop, {regs} registers, "
                  f"{spills} bytes spilled")
            failed += int(not ok)
    return failed


def check_greedy() -> int:
    """The sampler's one-launch greedy pick (``loom.sample.greedy_triton._greedy_kernel``) compiles
    for sm_90 as it is launched, without spills, with its merge guarded by one acquire-release
    atomic and its NaN-free maximum as a tie-to-the-first-index reduction."""
    from loom.sample import greedy_triton as g

    sig = dict(logits_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", part_idx_ptr="*i32",
               part_nan_ptr="*i32", counter_ptr="*i32", token_ptr="*i64", logprob_ptr="*fp32", finite_ptr="*i1",
               V="i32", PIECES="i32", stride_row="i32")
    try:
        compiled = compile_for_hopper(g._greedy_kernel, sig, {"BLOCK": g.BLOCK, "BLOCK_P": g.MAX_PIECES}, 4)
    except Exception as exc:  # reported: the script fails
        print(f"FAIL greedy: {type(exc).__name__}: {exc}")
        return 1
    ptx = compiled.asm["ptx"]
    atomics = len(re.findall(r"atom\.global\.gpu\.acq_rel\.", ptx))
    regs, spills = _spills(compiled)
    ok = spills == 0 and atomics == 1
    print(f"{'ok  ' if ok else 'FAIL'} greedy pick BLOCK={g.BLOCK}: {regs} registers, {spills} bytes spilled, "
          f"{atomics} acquire-release atomic")
    return int(not ok)


def torch_bf16() -> Any:
    import torch

    return torch.bfloat16


def compile_for_hopper_staged(fn: Any, sig: dict[str, str], consts: dict[str, Any], num_warps: int,
                              num_stages: int) -> Any:
    """:func:`compile_for_hopper` with a number of pipeline stages."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)  # positions in the kernel's own argument order
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig if n.endswith("_ptr") or n.startswith("stride")}
    full = {n: sig.get(n, "constexpr") for n in names}
    return triton.compile(ASTSource(fn, full, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def check_quantized_input() -> int:
    """The norm that quantizes for an FP8 layer reduces its sum of squares as the plain norm does
    (the float reductions of the plain kernel are the fused one's first), and the SiLU-and-quantize
    launches of the rule compile without spills."""
    from loom.layers import fused_ops

    failed = 0
    for dtype, hidden in (("bf16", 4096), ("fp16", 576), ("bf16", 2048)):
        block = fused_ops._next_pow2(hidden)
        warps = fused_ops.norm_warps(block)
        act = f"*{dtype}"
        norm_sig = dict(x_ptr=act, res_ptr=act, w_ptr=act, out_ptr=act, res_out_ptr=act, ew_ptr=act,
                        stride_xt="i32", stride_xr="i32", stride_rt="i32", stride_rr="i32", R="i32", H="i32",
                        eps="fp32")
        quant_sig = dict(x_ptr=act, res_ptr=act, w_ptr=act, q_ptr="*fp8e4nv", scale_ptr="*fp32", res_out_ptr=act,
                         static_ptr="*fp32", stride_xt="i32", stride_rt="i32", H="i32", eps="fp32")
        name = f"norm {dtype} H={hidden}"
        try:
            norm = compile_for_hopper(fused_ops._add_rms_norm_kernel, norm_sig,
                                      dict(HAS_RESIDUAL=True, BLOCK=block, TOP_K=0), warps)
            quant = compile_for_hopper(fused_ops._add_rms_norm_quant_kernel, quant_sig,
                                       dict(HAS_RESIDUAL=True, STATIC=False, BLOCK=block), warps)
        except Exception as exc:  # reported: the script fails
            failed += 1
            print(f"FAIL quantized_input {name}: {type(exc).__name__}: {exc}")
            continue
        want, got = float_reductions(norm.asm["ttgir"]), float_reductions(quant.asm["ttgir"])
        (norm_regs, norm_spills), (regs, spills) = _spills(norm), _spills(quant)
        problems = [f"spills {spills} bytes"] if spills or norm_spills else []
        if not want or got[: len(want)] != want:
            problems.append(f"the sum of squares is reduced otherwise: {want} vs {got}")
        print(f"{'FAIL' if problems else 'ok  '} quantized_input {name}: reductions {got}; {regs} registers "
              f"(the plain norm {norm_regs}){': ' + '; '.join(problems) if problems else ''}")
        failed += int(bool(problems))
    silu_sig = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32", static_ptr="*fp32", stride_xt="i32",
                    INTER="i32")
    for inter in (1536, 14336):
        block = min(fused_ops._SILU_QUANT_BLOCK, fused_ops._next_pow2(inter))
        warps = min(fused_ops._SILU_QUANT_WARPS, fused_ops.norm_warps(block))
        name = f"silu bf16 I={inter} block {block} {'one pass' if block >= inter else 'two passes'} {warps} warps"
        try:
            compiled = compile_for_hopper(fused_ops._silu_and_mul_quant_kernel, silu_sig,
                                          dict(STATIC=False, BLOCK=block, ONE_PASS=block >= inter), warps)
        except Exception as exc:  # reported: the script fails
            failed += 1
            print(f"FAIL quantized_input {name}: {type(exc).__name__}: {exc}")
            continue
        regs, spills = _spills(compiled)
        print(f"{'FAIL' if spills else 'ok  '} quantized_input {name}: {regs} registers"
              f"{f': spills {spills} bytes' if spills else ''}")
        failed += int(bool(spills))
    return failed


def main(group: str) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    checks = {"routing": check_routing, "qk_norm_rotary": check_qk_norm_rotary, "combine_norm": check_combine_norm,
              "router_epilogue": check_router_epilogue, "norm_router": check_norm_router,
              "expert_pipelining": check_expert_pipelining, "quantized_input": check_quantized_input,
              "greedy": check_greedy, "rope_store": check_rope_store}
    if group not in checks:
        raise SystemExit(f"unknown group {group!r}: one of {', '.join(checks)}")
    return 1 if checks[group]() else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "routing"))
