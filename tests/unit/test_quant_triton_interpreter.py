"""The quantizers' Triton kernels (W4A16 GEMV / GEMM / dequantize for GPTQ, AWQ and NF4; the FP8
activation quantizer) checked on the CPU through Triton's interpreter.

Skipped where triton is not installed. The check runs in a child process: the interpreter is
chosen when the kernels are defined, and must not leak into a process that compiles them for a
GPU. The cases and the error bound are in tests/helpers/quant_interpret_check.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.triton_interpret import run_interpreted

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_quant_kernels_match_reference_in_interpreter() -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "quant_interpret_check.py"))
    assert "FAIL" not in stdout
    assert "cases passed" in stdout, stdout


@pytest.fixture(scope="module")
def sass_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """``scripts/w4a16_sass.py``'s counts, by case: the W4A16 kernels compiled through Triton's
    compiler for sm_90 (no GPU, no launch)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path_factory.mktemp("sass") / "sass.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "w4a16_sass.py"), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {r["case"]: r for r in json.loads(out.read_text())["results"]}


def test_integer_code_gemv_compiles_for_hopper_to_few_instructions_a_weight(
        sass_rows: dict[str, dict[str, Any]]) -> None:
    """The one-token GEMV of integer codes: no integer-to-float conversion and no spill in its K
    loop, and at most 0.6x the general GEMV's instructions a weight for the same plan (4.8
    against 13.4 for llama-8b's 4-bit plan when written), so that it can keep up with the
    weights' bytes."""
    fast = [r for r in sass_rows.values() if r["kernel"] == "gemv-int"]
    assert len(fast) == 5
    for r in fast:
        general = sass_rows[r["case"].replace("gemv-int", "gemv", 1)]
        assert r["conversions"] == 0 and r["spills"] == 0, r
        assert r["instructions_per_weight"] <= 0.6 * general["instructions_per_weight"], (r, general)


def test_packed_4bit_tile_compiles_to_two_wide_instructions(sass_rows: dict[str, dict[str, Any]]) -> None:
    """The transposed GEMM with ``LOOM_W4A16_PACKED``'s tile (two weights a 32-bit operation, K
    tiles loaded without predicates): its K loop has two-wide 16-bit adds and multiplies (HADD2,
    HMUL2: one of each for two weights), no conversion and no spill, and at most 0.8x the float32
    tile's instructions a weight at the same plan (7.34 against 11.25 at 256 tokens when
    written)."""
    packed = [r for r in sass_rows.values() if r["case"].endswith(" packed even-k")]
    assert len(packed) == 4
    for r in packed:
        plain = sass_rows[r["case"].removesuffix(" packed even-k")]
        assert r["conversions"] == 0 and r["spills"] == 0, r
        ops = r["by_opcode"]
        assert ops.get("HMUL2", 0) >= r["weights_per_thread"] // 2 and ops.get("HADD2", 0) >= ops["HMUL2"], r
        assert ops.get("FMUL", 0) == 0 and ops.get("FADD", 0) == 0, r
        assert r["instructions_per_weight"] <= 0.8 * plain["instructions_per_weight"], (r, plain)


def test_packed_tile_arithmetic_emulated_on_the_cpu() -> None:
    """``_int_tile_t_x2``'s arithmetic step by step in torch, on random words: ``(w >> 4j) &
    0x000F000F | MAGIC2`` read as two 16-bit floats is ``BASE + code`` (codes j and j + 4), the
    16-bit subtract of ``BASE + zero`` and multiply by the scale (each rounded once, as PTX's
    ``.rn``; bf16's FMAs by 1 and with -0 added are the same operations) give the bits of
    ``((code - zero) * scale)`` in float32 rounded once, and the tile's order (``r * 8 + h * 4 +
    j``) is the inputs' order."""
    import torch

    g = torch.Generator().manual_seed(0)
    for dtype, base, magic2 in ((torch.bfloat16, 128, 0x43004300), (torch.float16, 1024, 0x64006400)):
        words = torch.randint(-(2**31), 2**31, (8, 64), generator=g, dtype=torch.int64).to(torch.int32)  # [WORDS, N]
        scale = (torch.rand(64, generator=g) * 0.02 + 1e-4).to(dtype)
        zero = torch.randint(0, 16, (64,), generator=g).to(dtype)
        codes = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=1).reshape(64, 64)  # [K, N]
        want = ((codes.float() - zero.float()) * scale.float()).to(dtype)
        zb = (zero.float() + base).to(dtype)
        halves = []
        for h in range(2):
            per_j = []
            for j in range(4):
                pair = ((words >> (4 * j)) & 0x000F000F) | magic2
                half = ((pair >> (16 * h)) & 0xFFFF).to(torch.int16).view(dtype)  # BASE + code j + 4h
                assert torch.equal(half.float(), codes[torch.arange(8) * 8 + h * 4 + j].float() + base)
                per_j.append((half - zb) * scale)
            halves.append(torch.stack(per_j, dim=1))  # [WORDS, 4, N]
        tile = torch.stack(halves, dim=1).reshape(64, 64)  # [WORDS, 2, 4, N] -> [K, N]
        assert torch.equal(tile.view(torch.int16), want.view(torch.int16)), dtype
