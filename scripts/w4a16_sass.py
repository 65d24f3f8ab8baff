"""Instructions a weight in the W4A16 kernels' main loops, compiled for Hopper on a machine without a GPU.

A batch-1 GEMV over 4-bit weights must unpack, convert and multiply about 9.6 T weights a second to
keep up with the H200's ~4.8 TB/s, against ~33 T FP32 lanes a second: above about 3.5 instructions
a weight the kernel is bound by its ALUs, not by the bytes it reads. This script compiles the
kernels of ``plugins/quant/w4a16_triton.py`` through Triton's compiler and the ptxas it bundles
(``GPUTarget("cuda", 90, 32)``, the argument specialization Triton's launcher gives llama-8b's
aligned tensors), disassembles the cubin with the bundled ``nvdisasm``, finds the K loop (the
largest block closed by a backward branch) and divides its instructions by the weights one thread
handles per iteration. It also reads the registers a thread uses and whether anything spills.

    PYTHONPATH=service:plugins/.. python scripts/w4a16_sass.py [--out FILE]

No launch, no GPU: a static count, which says how much ALU work a weight costs, not how fast the
kernel runs (``scripts/bench_w4a16_plans.py`` times them on a GPU).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z0-9_]+)", re.M)


@dataclass(frozen=True)
class Case:
    kernel: str  # "gemv" (the general one), "gemv-int", "gemm" or "gemm-t" (the transposed GEMM)
    dtype: str  # "bf16" or "fp16"
    bits: int
    group: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    act_order: bool = False
    block_m: int = 1
    packed: bool = False  # gemm-t: 4-bit codes dequantized two to a 32-bit operation (_int_tile_t_x2)
    even_k: bool = False  # gemm-t: K a multiple of the tile, loads without predicates (EVEN_K)

    @property
    def label(self) -> str:
        extra = (" act-order" if self.act_order else "") + (" packed" if self.packed else "") + (
            " even-k" if self.even_k else "")
        m = f"{self.block_m}x" if self.kernel.startswith("gemm") else ""
        return (f"{self.kernel} {self.dtype} {self.bits}-bit g{self.group} {m}{self.block_k}x{self.block_n} "
                f"w{self.num_warps}{extra}")


def _import() -> Any:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    from loom_plugins.quant import w4a16_triton as wt

    return wt


def _compile(wt: Any, case: Case) -> tuple[bytes, str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    f = 32 // case.bits
    act = "*" + case.dtype
    common = dict(x_ptr=act, perm_ptr="*i32", qw_ptr="*i32", s_ptr=act, z_ptr=act)
    tail = dict(N="i32", K="i32", K_SPLIT="i32", stride_qk="i32", stride_sk="i32", stride_os="i32")
    plain: tuple[str, ...]  # integer arguments the launcher does not see as multiples of 16
    consts: dict[str, Any] = dict(GROUP=case.group, BITS=case.bits, F=f, WORDS=case.block_k // f,
                                  HAS_PERM=case.act_order, HAS_BIAS=False, PARTIAL=True, BLOCK_N=case.block_n,
                                  BLOCK_K=case.block_k)
    if case.kernel in ("gemm", "gemm-t"):
        fn = wt._gemm_kernel if case.kernel == "gemm" else wt._gemm_t_kernel
        sig = {**common, "lut_ptr": "*fp32", "bias_ptr": act, "out_ptr": "*fp32", **dict(
            M="i32", N="i32", K="i32", K_SPLIT="i32", stride_xm="i32", stride_qk="i32", stride_sk="i32",
            stride_om="i32", stride_os="i32")}
        consts.update(LUT=False, ONE_GROUP=case.group % case.block_k == 0, BLOCK_M=case.block_m)
        if case.kernel == "gemm":
            consts.update(IEEE=False)
        else:  # the magic number arrives as a run-time argument (see _int_tile_t)
            sig["MAGIC"] = "i32"
            consts.update(INT_CODES=case.group % case.block_k == 0,
                          PACKED_BASE=(128 if case.dtype == "bf16" else 1024) if case.packed else 0,
                          EVEN_K=case.even_k)
        # K_SPLIT is a multiple of 16 in every launch (whole K tiles), so the launcher specialises
        # it as one: marked plain, the loop's loads compiled as 16-bit LDGs, not cp.async
        plain = ("M", "MAGIC")
    elif case.kernel == "gemv-int":
        fn = wt._gemv_int_kernel
        sig = {**common, "bias_ptr": act, "out_ptr": "*fp32", **tail, "MAGIC": "i32", "HI_SHIFT": "i32"}
        consts.update(EVEN_K=True, X_PAIRS=case.dtype == "bf16" and not case.act_order)
        plain = ("K_SPLIT", "MAGIC", "HI_SHIFT")
    else:
        fn = wt._gemv_kernel
        sig = {**common, "lut_ptr": "*fp32", "bias_ptr": act, "out_ptr": "*fp32", **tail}
        consts.update(LUT=False, ONE_GROUP=case.group % case.block_k == 0)
        plain = ("K_SPLIT",)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in plain}
    full = {**sig, **{c: "constexpr" for c in consts}}
    compiled = triton.compile(ASTSource(fn, full, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": case.num_warps, "num_stages": case.num_stages})
    sass, regs, spills = disassemble(compiled)
    return compiled.asm["cubin"], sass + "\n" + f"// registers {regs} spills {spills}"


def disassemble(compiled: Any) -> tuple[str, int, int]:
    """(SASS, registers a thread, stack bytes: spills) of a kernel ``triton.compile`` built for a
    GPU target, through the nvdisasm and cuobjdump Triton bundles (-1 where not reported)."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
        tmp.write(compiled.asm["cubin"])
        tmp.flush()
        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", tmp.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(bin_dir / "cuobjdump"), "--dump-resource-usage", tmp.name], capture_output=True,
                               text=True, check=True).stdout
    regs, spills = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return sass, int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def _k_loop(sass: str) -> str:
    """The largest block of instructions closed by a branch back to a label above it."""
    lines = sass.splitlines()
    labels = {line.split(":")[0]: i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:", line)}
    best: tuple[int, int] = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i + 1)
    return "\n".join(lines[best[0]:best[1]])


def count(wt: Any, case: Case) -> dict[str, Any]:
    _, sass = _compile(wt, case)
    ops = collections.Counter(_OP.findall(_k_loop(sass)))
    regs, spills = (int(v) for v in re.findall(r"// registers (\d+) spills (\d+)", sass)[0])
    weights = case.block_k * case.block_n // (32 * case.num_warps)  # a thread's weights an iteration (a tile of M)
    total = sum(ops.values())
    return {"case": case.label, "kernel": case.kernel, "loop_instructions": total, "weights_per_thread": weights,
            "instructions_per_weight": round(total / weights, 2), "registers": regs, "spills": spills,
            "conversions": sum(v for k, v in ops.items() if k.startswith(("I2F", "F2F", "F2I"))),
            "by_opcode": dict(ops.most_common())}


def cases() -> list[Case]:
    """The one-token plans of llama-8b's layers (128 x 64 tiles) and the K tile of a group of 128."""
    out = []
    for kernel in ("gemv", "gemv-int"):
        out += [Case(kernel, "bf16", 4, 128, 128, 64), Case(kernel, "bf16", 4, 128, 128, 128),
                Case(kernel, "fp16", 4, 128, 128, 64), Case(kernel, "bf16", 8, 128, 128, 64),
                Case(kernel, "bf16", 4, 128, 128, 64, act_order=True)]
    # the GEMM of 2..1023 tokens, per weight of one tile of M: the plans of M <= 16 and of M > 64
    out += [Case("gemm", "bf16", 4, 128, 64, 128, 4, 4, block_m=16), Case("gemm", "bf16", 4, 128, 128, 128, 8, 3,
                                                                          block_m=128)]
    # the wide plan of 129+ tokens (float32 activations, or the dense path moved up), and the
    # transposed GEMM (weights in wgmma's register operand) of 16-bit activations: its plans of
    # 2-16, 65-128 and 129-256 tokens (the last with the dense path moved up)
    out += [Case("gemm", "bf16", 4, 128, 64, 64, 4, 3, block_m=256),
            Case("gemm-t", "bf16", 4, 128, 64, 64, 4, 4, block_m=16),
            Case("gemm-t", "bf16", 4, 128, 64, 64, 4, 3, block_m=128),
            Case("gemm-t", "bf16", 4, 128, 64, 64, 4, 3, block_m=256)]
    # the same plans with the 4-bit tile dequantized two weights to a 32-bit operation and whole K
    # tiles loaded without predicates (LOOM_W4A16_PACKED=1), and fp16's 128-token plan both ways
    out += [Case("gemm-t", "bf16", 4, 128, 64, 64, 4, 4, block_m=16, packed=True, even_k=True),
            Case("gemm-t", "bf16", 4, 128, 64, 64, 4, 3, block_m=128, packed=True, even_k=True),
            Case("gemm-t", "bf16", 4, 128, 64, 64, 4, 3, block_m=256, packed=True, even_k=True),
            Case("gemm-t", "fp16", 4, 128, 64, 64, 4, 3, block_m=128),
            Case("gemm-t", "fp16", 4, 128, 64, 64, 4, 3, block_m=128, packed=True, even_k=True)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the counts as JSON here")
    args = parser.parse_args()
    wt = _import()
    results = [count(wt, c) for c in cases()]
    for r in results:
        print(f"{r['case']:<44} {r['instructions_per_weight']:5.2f} instructions a weight "
              f"({r['loop_instructions']} for {r['weights_per_thread']}), {r['conversions']} conversions, "
              f"{r['registers']} registers, {r['spills']} spills", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"target": "sm_90 (triton 3.6, bundled ptxas)", "results": results},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
