"""The FP8 kernel's decode plans on CUDA (``fp8_decode_plans``): every tile (block_n, warps,
stages, register cap) the sweep (scripts/bench_fp8_decode_plans.py) may put in its table, unsplit
and (the 32-key tiles) split, on the two head layouts it measures, against the float32 reference over what the pool
holds within tests/gpu/test_paged_attention.py's FP8 bounds, and within a few ulps of today's
launch at the same split count (a tile moves where partial sums are taken, not the numerics);
run to run bit for bit (no atomics: each output is written by one program, or merged in one
fixed order)."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from helpers.fp8_kv_cases import pack, reference
from helpers.paged_cases import make_step

from loom_plugins.attention.paged_triton import PagedAttentionBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_fp8_decode_plans import TILES, Tile  # noqa: E402

LAYOUTS = [(8, 4, 128), (4, 8, 128)]  # KV heads, query heads each, head size: llama-8b, Qwen3-30B-A3B


@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize(("hkv", "group", "d"), LAYOUTS)
def test_every_swept_tile_matches_the_reference_and_todays_launch(tile: Tile, hkv: int, group: int, d: int) -> None:
    rng = random.Random(f"fp8plan{tile}{hkv}")
    seqs = [(rng.choice([0, 15, 16, 100, 511, 777, 2047]), 1) for _ in range(24)]
    hq = hkv * group
    step = make_step(seqs, num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, device=CUDA,
                     seed=rng.randint(0, 1000))
    expected, _ = reference(step, d**-0.5, None)
    backend = PagedAttentionBackend(hq, hkv, d, torch.bfloat16, CUDA)
    backend.use_fp8_kv_cache()
    base = backend.prepare(step.meta)
    block_n, warps, stages, max_registers, prefetch = tile
    # split-K with today's and the 32-key tiles (the likely choices; every tile splits in the
    # interpreter's cases): each variant compiles for the GPU, a second or two each
    for splits in (1, 4) if block_n in (None, 32) else (1,):
        outs = []
        for plan in (dataclasses.replace(base, num_splits=splits, block_n=block_n, num_warps=warps,
                                         num_stages=stages, max_registers=max_registers, prefetch_table=prefetch),
                     dataclasses.replace(base, num_splits=splits)):
            runs = []
            for _ in range(2):
                pool = pack(step.kv_cache.float())
                runs.append(backend.forward(step.q, step.k, step.v, pool, step.meta, plan, d**-0.5, None).float())
            assert torch.equal(runs[0], runs[1]), "run to run"
            outs.append(runs[0])
        rel = ((outs[0] - expected).norm() / expected.norm()).item()
        assert rel < 1e-2, f"splits {splits}: relative error {rel:.2e} against the float32 reference"
        torch.testing.assert_close(outs[0], expected, atol=4e-2, rtol=2e-2)
        torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
