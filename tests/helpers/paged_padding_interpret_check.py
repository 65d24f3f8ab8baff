"""The ``paged`` backend on a draft's catch-up laid out at a graph width, through Triton's
interpreter: bit for bit the step as it is.

A catch-up of ``T`` new tokens on ``c`` cached ones is laid out at width ``Q`` by starting
``Q - T`` positions early (``loom_plugins.speculative.draft_catch_up``): those rows carry slot
-1 and K/V that differ from what the pool holds at their positions (a write would show), and
their queries are random. The real rows must come out exactly as in the step of ``T`` rows
(their query tiles start elsewhere, so they walk other key tiles: the extra ones are masked for
them and must add exact zeros), and the pool must hold exactly what that step wrote.

Run as a script in its own process (``tests/unit/test_draft_catch_up.py`` does); prints one line
per case and exits non-zero on a difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()
    triton_interpret.row_invariant_dots()  # as a GPU's MMA: a row's sums do not depend on its place in the tile


# (sequences as (cached tokens, new tokens), width Q, Hq, Hkv, D, dtype, page)
CASES: list[tuple[list[tuple[int, int]], int, int, int, int, str, int]] = [
    ([(40, 5)], 16, 8, 2, 32, "float32", 16),  # W5 b's first catch-up, GQA 4 as llama-8b
    ([(150, 65)], 128, 8, 2, 32, "float32", 16),  # 65 tokens: five query tiles become eight
    ([(90, 17)], 32, 8, 2, 32, "float16", 16),
    ([(100, 9), (60, 3), (200, 30)], 32, 8, 2, 32, "float32", 16),  # a batch, several widths' worth
    ([(33, 2), (70, 16)], 16, 4, 4, 16, "float16", 8),  # MHA, a sequence already at the width
]


def run_case(seqs: list[tuple[int, int]], width: int, hq: int, hkv: int, d: int, dtype_name: str,
             page: int) -> tuple[bool, bool]:
    """(real rows' outputs equal, pools equal) between the step as it is and laid out at ``width``."""
    import torch

    from loom.layers.attention import AttentionMetadata
    from loom_plugins.attention.paged_triton import PagedAttentionBackend

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(sum(c + t for c, t in seqs) + width)
    lens = [c + t for c, t in seqs]
    need = [-(-n // page) for n in lens]
    pool = torch.randn(2, sum(need) + 3, page, hkv, d, generator=gen).to(dtype)  # finite stale data
    order = torch.randperm(pool.shape[1], generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(need) + 2, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)

    def slot(i: int, p: int) -> int:
        return int(tables[i, p // page]) * page + p % page

    total = sum(t for _, t in seqs)
    real = [torch.randn(total, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]  # q, k, v rows

    def step(laid_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
        qs, ks, vs, slots, qlens, rows = [], [], [], [], [], []
        at = 0
        row = 0
        for i, (c, t) in enumerate(seqs):
            pad = width - t if laid_out else 0
            junk = [torch.randn(pad, h, d, generator=torch.Generator().manual_seed(i)).to(dtype)
                    for h in (hq, hkv, hkv)]
            qs += [junk[0], real[0][at : at + t]]
            ks += [junk[1], real[1][at : at + t]]
            vs += [junk[2], real[2][at : at + t]]
            slots += [-1] * pad + [slot(i, p) for p in range(c, c + t)]
            qlens.append(pad + t)
            rows += range(row + pad, row + pad + t)
            row += pad + t
            at += t
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables, query_lens_cpu=qlens,
            seq_lens_cpu=lens, max_query_len=max(qlens), max_seq_len=max(lens), block_size=page)
        cache = pool.clone()
        backend = PagedAttentionBackend(hq, hkv, d, dtype, torch.device("cpu"))
        out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, backend.prepare(meta),
                              d**-0.5, None)
        return out[torch.tensor(rows)], cache

    out_a, pool_a = step(False)
    out_b, pool_b = step(True)
    return torch.equal(out_a, out_b), torch.equal(pool_a, pool_b)


def main() -> int:
    _setup()
    failed = 0
    for seqs, width, hq, hkv, d, dtype_name, page in CASES:
        same_out, same_pool = run_case(seqs, width, hq, hkv, d, dtype_name, page)
        ok = same_out and same_pool
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {seqs} at width {width} Hq={hq} Hkv={hkv} D={d} {dtype_name} "
              f"page={page}: outputs {'equal' if same_out else 'differ'}, pool {'equal' if same_pool else 'differs'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
