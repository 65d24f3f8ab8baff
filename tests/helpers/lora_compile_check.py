"""The LoRA Triton kernels (``plugins/lora/sgmv_triton.py``) compiled for Hopper (sm_90) on a
machine without a GPU: Triton's front end, its GPU passes and the ptxas it bundles, no launch. It
catches what the interpreter cannot (a construct the compiler refuses, a ``tl.dot`` shape or
layout it cannot lower) and reports whether the loads that matter are vectorized and the shrink's
K loop pipelined (``cp.async``). Run as a script in its own process, without ``TRITON_INTERPRET``
(``tests/unit/test_lora_kernels.py`` runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loom_plugins.lora import sgmv_triton as kernels

    target = GPUTarget("cuda", 90, 32)
    # Pointers 16-byte aligned and sizes / strides multiples of 16 (llama-1b's, bf16), as Triton's
    # launcher specializes them at run time; T and SPLIT are never specialized.
    shrink_sig = dict(x_ptr="*bf16", a_ptr="*bf16", slots_ptr="*i32", order_ptr="*i64", h_ptr="*fp32", T="i32",
                      K="i32", W="i32", K_PER_SPLIT="i32", stride_xt="i32", stride_xk="constexpr", stride_as="i32",
                      stride_aw="i32", stride_ak="constexpr", stride_hs="i32", stride_ht="i32")
    expand_sig = dict(h_ptr="*fp32", b_ptr="*bf16", slots_ptr="*i32", order_ptr="*i64", out_ptr="*bf16", T="i32",
                      N="i32", R="i32", E0="i32", E1="i32", E2="i32", SPLIT="i32", stride_hs="i32", stride_ht="i32",
                      stride_bs="i32", stride_bn="i32", stride_bw="constexpr", stride_ot="i32", stride_on="constexpr")
    failed = 0
    for block_m in (16, 32, 64):
        for fn, sig, consts, expect in (
                (kernels._shrink_kernel, shrink_sig, dict(stride_xk=1, stride_ak=1, BLOCK_W=64, BLOCK_K=64),
                 ("cp.async",)),
                (kernels._expand_kernel, expand_sig, dict(stride_bw=1, stride_on=1, BLOCK_N=128, BLOCK_R=16),
                 ("ld.global.v4", "st.global.v4"))):
            names = list(sig)
            aligned = [n for n, t in sig.items() if t.startswith("*") or n not in ("T", "SPLIT", "E2")]
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
            constexprs = {**consts, "ORDERED": True, "PRECISION": "tf32", "BLOCK_M": block_m}
            full = {**sig, **{k: "constexpr" for k in constexprs}}
            try:
                ptx = triton.compile(ASTSource(fn, full, constexprs, attrs), target=target,
                                     options={"num_warps": 4}).asm["ptx"]
                missing = [e for e in expect if e not in ptx]
                ok, why = not missing, f"missing {missing}" if missing else "compiled"
            except Exception as exc:  # reported: the script fails
                ok, why = False, f"{type(exc).__name__}: {exc}"
            failed += not ok
            print(f"{'ok' if ok else 'FAIL'} {fn.__name__} BLOCK_M={block_m} sm_90: {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
