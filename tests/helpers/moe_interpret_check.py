"""The fused MoE layer's Triton kernels on the CPU, through Triton's interpreter.

Run as a script in its own process (``TRITON_INTERPRET`` must be set before the kernels are
defined, and must not leak into a process that compiles them for a GPU).
``tests/unit/test_fused_moe.py`` runs it; so can a developer:
``python tests/helpers/moe_interpret_check.py``. Exits non-zero on a mismatch.

Checked: the sort by expert (``align_rows_by_expert``) gives exactly the layout of its torch
model (``expected_layout`` below: every expert's rows in increasing order from a block-aligned
offset, padded with the sentinel, each block's expert), for routings with idle experts, one
expert taking every row, and more rows than a program's tile; and the grouped GEMMs
(``fused_experts_triton``) equal the torch path within float32 rounding (fp16 within its own);
the router's softmax and top-k in one kernel (``route``) choose the torch path's experts; and
the decode path's routing and sort in one launch (``route_and_sort``) gives exactly what
``route`` then ``align_rows_by_expert`` give (weights bit for bit, ids, the layout), over random
logits with and without ties; and the one-token experts indexed straight from the routing's ids
(``direct_experts``: no sort) give the sorted layout's bits; the router's GEMV with the routing
in its epilogue (``moe_router_gemv``) gives the dense GEMV then ``route``'s bits; FP8 experts
(e4m3 codes with per-channel scales) equal the torch path on their dequantized weights.
bf16 dense experts are left to the GPU tests: the interpreter of triton 3.6 computes bf16 dots wrongly.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()


def expected_layout(topk_ids: list[list[int]], num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """(sorted row ids up to the padded total, each block's expert) in plain Python."""
    flat = [e for row in topk_ids for e in row]
    n = len(flat)
    sorted_ids: list[int] = []
    blocks: list[int] = []
    for e in range(num_experts):
        rows = [i for i, x in enumerate(flat) if x == e]
        padded = -(-len(rows) // block_m) * block_m
        sorted_ids += rows + [n] * (padded - len(rows))
        blocks += [e] * (padded // block_m)
    return sorted_ids, blocks


def check_alignment() -> list[str]:
    import torch

    from loom.layers.moe_routing_triton import align_rows_by_expert, num_blocks_bound

    errors: list[str] = []
    gen = torch.Generator().manual_seed(0)
    cases = [  # (T, k, E, block_m, routing)
        (5, 2, 8, 16, "random"),
        (1, 8, 128, 16, "random"),  # a decode step of the Qwen3-30B-A3B shape
        (40, 3, 8, 16, "random"),
        (33, 2, 4, 32, "one"),  # every token's first choice is expert 3
        (700, 2, 6, 64, "random"),  # more rows than one tile of the sort's programs
    ]
    for T, k, E, bm, routing in cases:
        scores = torch.rand(T, E, generator=gen)
        if routing == "one":
            scores[:, 3] += 2.0
        ids = scores.topk(k, dim=-1).indices.to(torch.int32)
        sorted_ids, block_expert, num_padded = align_rows_by_expert(ids, E, bm)
        want_ids, want_blocks = expected_layout(ids.tolist(), E, bm)
        total = int(num_padded.item())
        name = f"T={T} k={k} E={E} block_m={bm} {routing}"
        if total != len(want_ids):
            errors.append(f"{name}: num_padded {total}, expected {len(want_ids)}")
            continue
        if sorted_ids[:total].tolist() != want_ids:
            errors.append(f"{name}: sorted ids differ")
        if block_expert[: total // bm].tolist() != want_blocks:
            errors.append(f"{name}: block experts differ")
        if block_expert.shape[0] != num_blocks_bound(T * k, E, bm) or total > block_expert.shape[0] * bm:
            errors.append(f"{name}: the static bound {block_expert.shape[0]} blocks does not hold {total} rows")
    return errors


def check_experts() -> list[str]:
    import torch

    from loom.layers.fused_moe import fused_experts_torch, select_experts
    from loom.layers.fused_moe_triton import MoeBlockConfig, fused_experts_triton

    errors: list[str] = []
    gen = torch.Generator().manual_seed(1)
    cases = [  # (T, H, I, E, k, dtype, block config or None)
        (3, 64, 48, 8, 2, torch.float32, None),
        (9, 40, 24, 4, 3, torch.float32, MoeBlockConfig(16, 16, 16, 4, 1)),  # ragged tiles on every side
        (20, 64, 32, 8, 2, torch.float16, MoeBlockConfig(32, 32, 32, 4, 1)),
        (1, 32, 16, 16, 4, torch.float32, None),  # a decode step: most experts idle
    ]
    for T, H, inter, E, k, dtype, cfg in cases:
        x = torch.randn(T, H, generator=gen).to(dtype)
        w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H**0.5).to(dtype)
        w2 = (torch.randn(E, H, inter, generator=gen) / inter**0.5).to(dtype)
        weights, ids = select_experts(torch.randn(T, E, generator=gen), k, renormalize=True)
        ref = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
        got = fused_experts_triton(x, w13, w2, weights, ids, cfg).float()
        err = (got - ref).abs().max().item()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        name = f"T={T} H={H} I={inter} E={E} k={k} {dtype} {cfg}"
        print(f"{'ok  ' if err <= tol else 'FAIL'} experts {name}: max err {err:.2e}")
        if err > tol:
            errors.append(f"{name}: max error {err:.2e} > {tol}")
    return errors


def check_direct_experts() -> list[str]:
    """The experts run straight from the routing's ids (no sort: ``direct``) against the sorted
    layout: the same bits at one token (the layouts hold the same blocks), and within float32
    rounding of the torch path past it (where a shared expert is read once a row); the default
    takes the direct path at one token only, and without the switch never."""
    import torch

    from loom import kernel_switches
    from loom.layers import fused_moe_triton
    from loom.layers.fused_moe import fused_experts_torch, select_experts
    from loom.layers.fused_moe_triton import MoeBlockConfig, fused_experts_triton

    errors: list[str] = []
    gen = torch.Generator().manual_seed(5)
    cases = [  # (T, H, I, E, k, dtype, block config or None)
        (1, 64, 48, 16, 4, torch.float32, None),  # a decode step
        (1, 40, 24, 8, 3, torch.float16, MoeBlockConfig(16, 16, 16, 4, 1)),  # ragged tiles
        (3, 32, 16, 4, 3, torch.float32, None),  # forced past one token: experts shared by rows
    ]
    for T, H, inter, E, k, dtype, cfg in cases:
        x = torch.randn(T, H, generator=gen).to(dtype)
        w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H**0.5).to(dtype)
        w2 = (torch.randn(E, H, inter, generator=gen) / inter**0.5).to(dtype)
        weights, ids = select_experts(torch.randn(T, E, generator=gen), k, renormalize=True)
        ref = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
        sorted_rows = fused_moe_triton.expert_outputs_triton(x, w13, w2, weights, ids, cfg, direct=False).rows
        direct_rows = fused_moe_triton.expert_outputs_triton(x, w13, w2, weights, ids, cfg, direct=True).rows
        got = fused_experts_triton(x, w13, w2, weights, ids, cfg, direct=True).float()
        err = (got - ref).abs().max().item()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        same = torch.equal(direct_rows, sorted_rows)
        ok = err <= tol and (same or T > 1)
        print(f"{'ok  ' if ok else 'FAIL'} direct experts T={T} E={E} k={k} {dtype}: max err {err:.2e}, "
              f"{'same bits as' if same else 'differs from'} the sorted layout")
        if not ok:
            errors.append(f"direct experts T={T}: max err {err:.2e}, same bits {same}")
    before = kernel_switches.moe_direct_experts
    try:
        default = [fused_moe_triton.direct_experts(t) for t in (0, 1, 2, 8)]
        kernel_switches.moe_direct_experts = False
        off = fused_moe_triton.direct_experts(1)
    finally:
        kernel_switches.moe_direct_experts = before
    ok = default == [False, True, False, False] and not off
    print(f"{'ok  ' if ok else 'FAIL'} direct experts at one token only ({default}), off with the switch ({off})")
    if not ok:
        errors.append(f"direct_experts: {default} for 0, 1, 2, 8 tokens; switched off: {off}")
    return errors


def check_fp8_experts() -> list[str]:
    """FP8 experts (e4m3 codes, a float32 scale per output channel: ``W_SCALE``; bf16 activations
    dotted in fp16 after a power-of-two scaling per row: ``X_F16``) against the float32 torch path
    on the dequantized weights, sorted and direct; at one token the two layouts give the same bits."""
    import torch

    from loom.layers import fused_moe_triton
    from loom.layers.fused_moe import fused_experts_torch, select_experts
    from loom.layers.fused_moe_triton import MoeBlockConfig

    errors: list[str] = []
    gen = torch.Generator().manual_seed(11)
    cases = [  # (T, H, I, E, k, activations, block config or None)
        (5, 64, 48, 8, 2, torch.float32, None),
        (7, 40, 24, 4, 3, torch.float16, MoeBlockConfig(16, 16, 16, 4, 1)),  # ragged tiles
        (6, 64, 32, 8, 2, torch.bfloat16, MoeBlockConfig(16, 32, 32, 4, 1)),  # fp16 dots, rows scaled
        (1, 64, 48, 16, 4, torch.bfloat16, None),  # a decode step, direct
    ]
    for T, H, inter, E, k, dtype, cfg in cases:
        # rows of x far apart in magnitude (each row's power of two is its own); fp16 activations
        # within a decade of 1, where its products neither overflow nor fall into subnormals
        lo, hi = (-1, 1) if dtype == torch.float16 else (-3, 3)
        x = (torch.randn(T, H, generator=gen) * torch.logspace(lo, hi, T)[:, None]).to(dtype)
        w13 = torch.randn(E, 2 * inter, H, generator=gen) / H**0.5
        w2 = torch.randn(E, H, inter, generator=gen) / inter**0.5
        s13 = w13.abs().amax(-1) / 448
        s2 = w2.abs().amax(-1) / 448
        c13 = (w13 / s13[..., None]).to(torch.float8_e4m3fn)
        c2 = (w2 / s2[..., None]).to(torch.float8_e4m3fn)
        weights, ids = select_experts(torch.randn(T, E, generator=gen), k, renormalize=True)
        ref = fused_experts_torch(x.float(), c13.float() * s13[..., None], c2.float() * s2[..., None], weights, ids)
        sorted_rows = fused_moe_triton.expert_outputs_triton(x, c13, c2, weights, ids, cfg, direct=False,
                                                             w13_scale=s13, w2_scale=s2)
        got = sorted_rows.combine().float()
        scale = ref.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        err = ((got - ref).abs() / scale).max().item()  # per token, relative to its largest output
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        same = True
        if T == 1:
            direct_rows = fused_moe_triton.expert_outputs_triton(x, c13, c2, weights, ids, cfg, direct=True,
                                                                 w13_scale=s13, w2_scale=s2)
            same = torch.equal(direct_rows.rows, sorted_rows.rows)
        ok = err <= tol and same
        name = f"T={T} H={H} I={inter} E={E} k={k} {dtype}"
        print(f"{'ok  ' if ok else 'FAIL'} fp8 experts {name}: max err {err:.2e} of each token's largest"
              f"{', direct = sorted bits' if T == 1 and same else ''}")
        if not ok:
            errors.append(f"fp8 experts {name}: max err {err:.2e}, direct same bits {same}")
    try:  # codes without scales, or scales of the wrong shape, are refused before any launch
        fused_moe_triton.expert_outputs_triton(x, c13, c2, weights, ids, None, w13_scale=s13[:, :3], w2_scale=s2)
        errors.append("fp8 experts: a scale of the wrong shape was accepted")
    except ValueError:
        pass
    return errors


def check_fp8_block_experts() -> list[str]:
    """Block-wise FP8 experts (one scale per block of bn rows x bk inputs: ``SCALE_BN`` /
    ``SCALE_BK``, each K tile's sums scaled by its blocks) against the float32 torch path on the
    dequantized weights; blocks smaller than the kernels' K tile make the tile shrink to fit."""
    import torch

    from loom.layers import fused_moe_triton
    from loom.layers.fused_moe import dequantize_expert, fused_experts_torch, select_experts
    from loom.layers.fused_moe_triton import MoeBlockConfig

    errors: list[str] = []
    gen = torch.Generator().manual_seed(13)
    cases = [  # (T, H, I, E, k, activations, block, block config or None)
        (5, 64, 48, 8, 2, torch.float32, (16, 32), None),
        (6, 64, 32, 8, 2, torch.bfloat16, (32, 32), MoeBlockConfig(16, 32, 64, 4, 1)),  # K tile 64 -> 32
        (1, 96, 64, 16, 4, torch.bfloat16, (32, 64), None),  # a decode step, direct; H a partial block of 64
    ]
    for T, H, inter, E, k, dtype, block, cfg in cases:
        bn, bk = block
        x = (torch.randn(T, H, generator=gen) * torch.logspace(-2, 2, T)[:, None]).to(dtype)
        scales, codes = [], []
        for rows, cols in ((2 * inter, H), (H, inter)):
            w = torch.randn(E, rows, cols, generator=gen) / cols**0.5
            grid = torch.rand(E, -(-rows // bn), -(-cols // bk), generator=gen) * 2e-3 + 1e-4
            full = grid.repeat_interleave(bn, 1)[:, :rows].repeat_interleave(bk, 2)[:, :, :cols]
            codes.append((w / full).clamp(-448, 448).to(torch.float8_e4m3fn))
            scales.append(grid)
        deq = [torch.stack([dequantize_expert(c[e], s[e], torch.float32, block) for e in range(E)])
               for c, s in zip(codes, scales, strict=True)]
        weights, ids = select_experts(torch.randn(T, E, generator=gen), k, renormalize=True)
        ref = fused_experts_torch(x.float(), deq[0], deq[1], weights, ids)
        direct = T == 1
        got = fused_moe_triton.expert_outputs_triton(x, codes[0], codes[1], weights, ids, cfg, direct=direct,
                                                     w13_scale=scales[0], w2_scale=scales[1],
                                                     scale_block=block).combine().float()
        torch_path = fused_experts_torch(x.float(), codes[0], codes[1], weights, ids, scales[0], scales[1], block)
        err = ((got - ref).abs() / ref.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)).max().item()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        ok = err <= tol and torch.allclose(torch_path, ref, atol=1e-6, rtol=1e-6)
        name = f"T={T} H={H} I={inter} E={E} k={k} {dtype} blocks {bn}x{bk}"
        print(f"{'ok  ' if ok else 'FAIL'} fp8 block experts {name}: max err {err:.2e} of each token's largest")
        if not ok:
            errors.append(f"fp8 block experts {name}: max err {err:.2e}")
    return errors


def check_router_epilogue() -> list[str]:
    """The router's GEMV with the routing in its epilogue (``moe_router_gemv.route_from_hidden``,
    one launch) against the dense GEMV with the same plan then ``route`` (two): the same weights
    bit for bit and the same ids, the split-K counters left zero; ragged K, several tokens,
    every expert chosen."""
    import torch

    from loom.layers import dense_gemv
    from loom.layers.dense_gemv import GemvPlan
    from loom.layers.moe_router_gemv import fused_router_supported, route_from_hidden
    from loom.layers.moe_routing_triton import route
    from loom.layers.split_k import counters

    errors: list[str] = []
    gen = torch.Generator().manual_seed(6)
    cases = [  # (T, H, E, k, renormalize, dtype, weights dtype, plan)
        (1, 256, 128, 8, True, torch.float32, None, GemvPlan(16, 64, 4, 4, 2, True)),  # Qwen3-30B-A3B-like
        (3, 200, 60, 4, False, torch.float16, torch.float16, GemvPlan(16, 64, 4, 4, 1, True)),  # ragged K and E
        (4, 128, 16, 16, True, torch.float32, None, GemvPlan(16, 32, 2, 4, 2, True)),  # every expert chosen
    ]
    for T, H, E, k, renorm, dtype, wdtype, plan in cases:
        name = f"T={T} H={H} E={E} k={k} renormalize={renorm} {dtype} -> {wdtype} {plan}"
        x = torch.randn(T, H, generator=gen).to(dtype)
        w = (torch.randn(E, H, generator=gen) / H**0.5).to(dtype)
        if not fused_router_supported(x, w, k, plan):
            errors.append(f"{name}: not served")
            continue
        want_w, want_ids = route(dense_gemv.dense_gemv(x, w, None, plan), k, renorm, wdtype)
        got_w, got_ids = route_from_hidden(x, w, k, renorm, wdtype, plan)
        ctr = counters(x.device)
        ok = (got_w.dtype == want_w.dtype and torch.equal(got_w, want_w) and torch.equal(got_ids, want_ids)
              and ctr is not None and int(ctr.abs().sum()) == 0)
        print(f"{'ok  ' if ok else 'FAIL'} router epilogue {name}")
        if not ok:
            errors.append(f"{name}: weights equal {torch.equal(got_w, want_w)}, ids equal "
                          f"{torch.equal(got_ids, want_ids)}")
    no_split = GemvPlan(16, 256, 1, 4, 2, True)
    if fused_router_supported(torch.zeros(1, 256), torch.zeros(128, 256), 8, no_split):
        errors.append("a plan without split K is served (the routing rides on the split merge)")
    print(f"{'FAIL' if errors else 'ok  '} router epilogue: plans without split K refused")
    return errors


def check_routing() -> list[str]:
    """``route`` against ``select_experts``' torch path: the same experts in the same order (the
    logits are distinct), the weights within float32 rounding; equal logits: lowest expert first."""
    import torch

    from loom.layers.fused_moe import select_experts
    from loom.layers.moe_routing_triton import route

    errors: list[str] = []
    gen = torch.Generator().manual_seed(2)
    cases = [  # (T, E, k, renormalize, logits dtype, weights dtype)
        (1, 128, 8, True, torch.bfloat16, torch.bfloat16),  # Qwen3-30B-A3B's decode row
        (7, 8, 2, True, torch.float32, None),  # Mixtral: float32 weights
        (13, 128, 8, True, torch.bfloat16, torch.bfloat16),  # two programs of 8 tokens, the second part full
        (5, 60, 4, False, torch.float16, torch.float16),  # E not a power of two, no renormalisation
        (3, 512, 10, True, torch.float32, None),  # k not a power of two, four warps
    ]
    for T, E, k, renorm, dtype, wdtype in cases:
        # distinct logits (a permutation of a grid exact in every dtype): no ties to break
        logits = torch.stack([torch.randperm(E, generator=gen) for _ in range(T)]).float().mul(2.0**-4).to(dtype)
        want_w, want_ids = select_experts(logits, k, renorm, wdtype)
        got_w, got_ids = route(logits, k, renorm, wdtype)
        name = f"T={T} E={E} k={k} renormalize={renorm} {dtype} -> {wdtype}"
        err = (got_w.float() - want_w.float()).abs().max().item()
        tol = 2e-7 if (wdtype or torch.float32) == torch.float32 else 2.0 ** -8
        ok = torch.equal(got_ids.long(), want_ids) and got_w.dtype == want_w.dtype and err <= tol
        print(f"{'ok  ' if ok else 'FAIL'} routing {name}: max weight err {err:.2e}")
        if not ok:
            errors.append(f"{name}: ids equal {torch.equal(got_ids.long(), want_ids)}, weight err {err:.2e}")
    tied = torch.zeros(1, 16)
    tied[0, [3, 9, 12]] = 1.0
    w, ids = route(tied, 2, True)
    if ids.tolist() != [[3, 9]] or not torch.allclose(w, torch.tensor([[0.5, 0.5]])):
        errors.append(f"ties: {ids.tolist()} {w.tolist()}, expected [[3, 9]] and halves")
    print(f"{'FAIL' if errors else 'ok  '} routing ties: lowest expert first")
    return errors


def check_fused_routing() -> list[str]:
    """``route_and_sort`` (one launch) against ``route`` + ``align_rows_by_expert`` (three): the
    same weights bit for bit, the same ids, and the same layout up to ``num_padded``, which is
    also ``expected_layout``'s. Logits drawn from a coarse grid tie often (equal logits: lowest
    expert first); a few cases draw every token's logits from two values only."""
    import torch

    from loom.layers.moe_routing_triton import (
        align_rows_by_expert,
        fused_route_supported,
        num_blocks_bound,
        route,
        route_and_sort,
        route_rows,
    )

    errors: list[str] = []
    gen = torch.Generator().manual_seed(3)
    cases = [  # (T, E, k, renormalize, logits dtype, weights dtype, block_m, logits)
        (1, 128, 8, True, torch.bfloat16, torch.bfloat16, 16, "normal"),  # Qwen3-30B-A3B's decode step
        (8, 128, 8, True, torch.bfloat16, torch.bfloat16, 16, "ties"),  # the largest fused batch
        (4, 128, 8, False, torch.bfloat16, torch.bfloat16, 16, "two values"),  # ties everywhere
        (5, 8, 2, True, torch.float32, None, 16, "ties"),  # Mixtral: float32 weights
        (3, 60, 4, False, torch.float16, torch.float16, 16, "normal"),  # E not a multiple of the chunk
        (7, 512, 10, True, torch.float32, None, 32, "ties"),  # k not a power of two, 16 chunks
        (2, 1024, 4, True, torch.bfloat16, torch.bfloat16, 16, "normal"),  # a 4-token tile
        (6, 16, 16, True, torch.float32, None, 16, "ties"),  # every expert chosen by every token
    ]
    for T, E, k, renorm, dtype, wdtype, bm, kind in cases:
        name = f"T={T} E={E} k={k} renormalize={renorm} {dtype} -> {wdtype} block_m={bm} {kind}"
        if kind == "normal":
            logits = torch.randn(T, E, generator=gen)
        elif kind == "ties":
            logits = torch.randint(0, 6, (T, E), generator=gen).float() * 0.5
        else:
            logits = torch.randint(0, 2, (T, E), generator=gen).float()
        logits = logits.to(dtype)
        if not fused_route_supported(logits, k):
            errors.append(f"{name}: not served (rows {route_rows(E)})")
            continue
        want_w, want_ids = route(logits, k, renorm, wdtype)
        want_sorted, want_blocks, want_total = align_rows_by_expert(want_ids, E, bm)
        got_w, got_ids, layout = route_and_sort(logits, k, renorm, bm, wdtype)
        total = int(want_total.item())
        py_ids, py_blocks = expected_layout(want_ids.tolist(), E, bm)
        problems = [what for what, ok in (
            ("weights", got_w.dtype == want_w.dtype and torch.equal(got_w, want_w)),
            ("ids", torch.equal(got_ids, want_ids)),
            ("num_padded", int(layout.num_padded.item()) == total == len(py_ids)),
            ("sorted ids", torch.equal(layout.sorted_ids[:total], want_sorted[:total])
             and layout.sorted_ids[:total].tolist() == py_ids),
            ("block experts", torch.equal(layout.block_expert[: total // bm], want_blocks[: total // bm])
             and layout.block_expert[: total // bm].tolist() == py_blocks),
            ("buffers", layout.block_expert.shape[0] == num_blocks_bound(T * k, E, bm) and layout.block_m == bm),
        ) if not ok]
        print(f"{'FAIL' if problems else 'ok  '} fused routing {name}{': ' + ', '.join(problems) if problems else ''}")
        if problems:
            errors.append(f"{name}: {', '.join(problems)} differ")
    return errors


def check_block() -> list[str]:
    """``SparseMoeBlock`` taking the Triton path on these CPU tensors (as it does on CUDA): a
    decode-sized batch routes and sorts in one launch and hands the layout to the experts, a
    larger one takes the three launches; both within float32 rounding of the torch path. Its
    uncombined output (the experts' rows) through the next residual add + norm gives the same
    bits as its output through that norm."""
    import torch

    from loom import kernel_switches
    from loom.layers import fused_moe, fused_moe_triton, fused_ops, moe_routing_triton
    from loom.layers.fused_moe_triton import ExpertOutputs
    from loom.layers.norm import RMSNorm

    errors: list[str] = []
    torch.manual_seed(4)
    block = fused_moe.SparseMoeBlock(16, 4, 64, 32, renormalize=True)
    for p in block.parameters():
        p.data.normal_(0, 0.1)
    norm = RMSNorm(64)
    norm.weight.data = 1 + 0.3 * torch.randn(64)
    calls = {"route_and_sort": 0, "align_rows_by_expert": 0}
    originals = {"route_and_sort": moe_routing_triton.route_and_sort,
                 "align_rows_by_expert": fused_moe_triton.align_rows_by_expert}

    def counting(name: str) -> object:
        def call(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return originals[name](*args, **kwargs)  # type: ignore[operator]
        return call

    fused_moe.triton_experts_supported = lambda x: kernel_switches.fused_kernels  # type: ignore[assignment]
    fused_ops.enabled = lambda x: kernel_switches.fused_kernels  # type: ignore[assignment]
    moe_routing_triton.route_and_sort = counting("route_and_sort")  # type: ignore[assignment]
    fused_moe_triton.align_rows_by_expert = counting("align_rows_by_expert")  # type: ignore[assignment]
    moe_routing_triton.ONE_LAUNCH_ROUTING = True  # (off by default: measured slower on the H200)
    # (T, routed and sorted in one launch, sorted by the three launches' last two); one token:
    # neither, the experts index the routing's ids (direct_experts); then the same with that off.
    for T, fused, sorts, direct in ((1, False, False, True), (8, True, False, True), (9, False, True, True),
                                    (1, True, False, False)):
        kernel_switches.moe_direct_experts = direct
        x, residual = torch.randn(T, 64), torch.randn(T, 64)
        calls["route_and_sort"] = calls["align_rows_by_expert"] = 0
        with torch.no_grad():
            got = block(x)
            rows = block.forward_uncombined(x)
            folded = norm.forward_with_residual(rows, residual)
            separate = norm.forward_with_residual(got, residual)
            with kernel_switches.fused_kernels_off():
                want = block(x)
        err = (got - want).abs().max().item()
        same = isinstance(rows, ExpertOutputs) and all(torch.equal(a, b) for a, b in zip(folded, separate, strict=True))
        ok = (err <= 1e-5 and calls["route_and_sort"] == 2 * int(fused)
              and calls["align_rows_by_expert"] == 2 * int(sorts) and same)
        print(f"{'ok  ' if ok else 'FAIL'} block T={T} (routing and sort in one launch: {fused}, sorted apart: "
              f"{sorts}, direct switch {direct}): max err {err:.2e}, "
              f"combine folded into the norm: {'same bits' if same else 'DIFFERENT'}")
        if not ok:
            errors.append(f"block T={T}: max err {err:.2e}, calls {calls}, folded combine the same: {same}")
    kernel_switches.moe_direct_experts = True
    return errors


def check_model() -> list[str]:
    """A tiny Qwen3-MoE (float32: the interpreter's bf16 dots are wrong) on the Triton kernels:
    every MoE layer's combine is folded into the norm after it (no combine launch; one folded
    norm a sparse layer), and the logits are the torch path's within float32 rounding."""
    import shutil
    import tempfile

    import torch

    import loom_plugins.models
    from helpers.reference_attention import ModelHarness
    from helpers.tiny_models import save_tiny_model
    from loom import kernel_switches
    from loom.layers import fused_moe, fused_moe_triton, fused_ops
    from loom.model_loader import load_model
    from loom.plugin_api import PluginRegistry

    registry = PluginRegistry()
    registry.register(loom_plugins.models, "loom-models", "loom-server")
    tmp = Path(tempfile.mkdtemp(prefix="loom-moe-"))
    try:
        loaded = load_model(save_tiny_model("qwen3-moe", tmp / "m"), torch.float32, torch.device("cpu"), registry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fused_moe.triton_experts_supported = lambda x: kernel_switches.fused_kernels  # type: ignore[assignment]
    fused_ops.enabled = lambda x: kernel_switches.fused_kernels  # type: ignore[assignment]
    calls = {"combine_rows": 0, "fused_combine_add_rms_norm": 0}
    originals = {"combine_rows": fused_moe_triton.combine_rows,
                 "fused_combine_add_rms_norm": fused_ops.fused_combine_add_rms_norm}

    def counting(name: str) -> object:
        def call(*args: object) -> object:
            calls[name] += 1
            return originals[name](*args)  # type: ignore[operator]
        return call

    fused_moe_triton.combine_rows = counting("combine_rows")  # type: ignore[assignment]
    fused_ops.fused_combine_add_rms_norm = counting("fused_combine_add_rms_norm")  # type: ignore[assignment]
    prompt = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5]

    def logits() -> torch.Tensor:
        return ModelHarness(loaded.model, loaded.hf_config, dtype=torch.float32, device="cpu").prefill(prompt)

    got = logits()
    with kernel_switches.fused_kernels_off():
        want = logits()
    err = (got - want).abs().max().item()
    sparse = 2  # layers 0 and 2 (helpers/tiny_models.py)
    ok = err <= 1e-4 and calls == {"combine_rows": 0, "fused_combine_add_rms_norm": sparse}
    print(f"{'ok  ' if ok else 'FAIL'} model qwen3-moe float32: max logit err {err:.2e}, launches {calls}")
    return [] if ok else [f"model: max logit err {err:.2e}, launches {calls}"]


def main() -> int:
    _setup()
    routing_errors = check_routing() + check_fused_routing() + check_router_epilogue()
    errors = check_alignment()
    print(f"{'FAIL' if errors else 'ok  '} sort by expert: {'; '.join(errors) or 'as expected'}")
    expert_errors = (check_experts() + check_direct_experts() + check_fp8_experts() + check_fp8_block_experts()
                     + check_block() + check_model())
    return 1 if errors or expert_errors or routing_errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
