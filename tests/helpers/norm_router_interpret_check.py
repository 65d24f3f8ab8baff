"""The residual norm and the MoE router in one launch (``loom.layers.moe_norm_router``) on the CPU,
through Triton's interpreter, against the two launches it replaces.

Run as a script in its own process (``TRITON_INTERPRET`` must be set before the kernels are
defined); ``tests/unit/test_moe_norm_router.py`` runs it. Exits non-zero on a mismatch.

Checked, float32 and fp16 (the interpreter of triton 3.6 computes bf16 dots wrongly):
``norm_route`` gives ``fused_add_rms_norm`` then ``route_from_hidden``'s bits (the normed rows,
the new residual, the routing weights and ids) for 1 to 4 tokens, rows of 1024, 1008 (ragged K
and a masked block) and 2048 columns, the split-K counters left zero; and the GPU's order of the
sum of squares (``WARP_SUM``) adds the warps' sums pairwise as the norm kernel's butterfly does
(w + NW/2 first), against a numpy model of that tree.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()


def check_norm_route() -> list[str]:
    import torch

    from loom.layers import fused_ops
    from loom.layers.dense_gemv import GemvPlan
    from loom.layers.moe_norm_router import norm_route, norm_router_supported
    from loom.layers.moe_router_gemv import route_from_hidden
    from loom.layers.split_k import counters

    errors: list[str] = []
    gen = torch.Generator().manual_seed(22)
    cases = [  # (T, H, E, k, renormalize, dtype, weights dtype, plan)
        (1, 1024, 128, 8, True, torch.float32, None, GemvPlan(16, 64, 4, 4, 2, True)),  # four norm warps
        (3, 1008, 60, 4, False, torch.float16, torch.float16, GemvPlan(16, 64, 4, 4, 1, True)),  # ragged K and E
        (4, 2048, 16, 16, True, torch.float32, None, GemvPlan(16, 256, 8, 4, 4, True)),  # the H200 router plan
        (2, 2048, 128, 8, True, torch.float16, torch.float16, GemvPlan(16, 256, 8, 4, 4, True)),
    ]
    for T, H, E, k, renorm, dtype, wdtype, plan in cases:
        name = f"T={T} H={H} E={E} k={k} renormalize={renorm} {dtype} -> {wdtype} {plan}"
        x = torch.randn(T, H, generator=gen).to(dtype)
        residual = torch.randn(T, H, generator=gen).to(dtype)
        norm_w = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
        router_w = (torch.randn(E, H, generator=gen) / H**0.5).to(dtype)
        if not norm_router_supported(x, residual, norm_w, router_w, k, plan):
            errors.append(f"{name}: not served")
            continue
        want_n, want_h = fused_ops.fused_add_rms_norm(x, residual, norm_w, 1e-6)
        want_w, want_ids = route_from_hidden(want_n, router_w, k, renorm, wdtype, plan)
        got_n, got_h, got_w, got_ids = norm_route(x, residual, norm_w, 1e-6, router_w, k, renorm, wdtype, plan)
        ctr = counters(x.device)
        same = {"normed": torch.equal(got_n, want_n), "residual": torch.equal(got_h, want_h),
                "weights": got_w.dtype == want_w.dtype and torch.equal(got_w, want_w),
                "ids": torch.equal(got_ids, want_ids)}
        ok = all(same.values()) and ctr is not None and int(ctr.abs().sum()) == 0
        print(f"{'ok  ' if ok else 'FAIL'} norm + router {name}")
        if not ok:
            errors.append(f"{name}: equal {same}")
    x = torch.zeros(1, 2048)
    refused = {"unaligned": norm_router_supported(torch.zeros(1, 2049)[:, 1:], x, torch.zeros(2048),
                                                  torch.zeros(128, 2048), 8, GemvPlan(16, 256, 8, 4, 4, True)),
               "512 columns": norm_router_supported(torch.zeros(1, 512), torch.zeros(1, 512), torch.zeros(512),
                                                    torch.zeros(128, 512), 8, GemvPlan(16, 128, 2, 4, 2, True)),
               "8192 columns": norm_router_supported(torch.zeros(1, 8192), torch.zeros(1, 8192), torch.zeros(8192),
                                                     torch.zeros(128, 8192), 8, GemvPlan(16, 256, 8, 4, 4, True))}
    if any(refused.values()):
        errors.append(f"served where it must not be: {refused}")
    print(f"{'FAIL' if any(refused.values()) else 'ok  '} norm + router refused: {', '.join(refused)}")
    return errors


def check_warp_sum() -> list[str]:
    """``_sum_squares`` with ``WARP_SUM`` against numpy: each warp row summed (numpy's order in the
    interpreter, the lanes' on a GPU), then warp w + n/2 added to warp w, n = NW, NW/2, ... 2."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    from loom.layers.moe_norm_router import _sum_squares

    globals()["_sum_squares"] = _sum_squares  # the probe's global, as a kernel module's helper is

    @triton.jit
    def probe(x_ptr, out_ptr, NW: tl.constexpr, LOG_NW: tl.constexpr, WARP_COLS: tl.constexpr):
        cols = tl.arange(0, NW)[:, None] * WARP_COLS + tl.arange(0, WARP_COLS)[None, :]
        tl.store(out_ptr, _sum_squares(tl.load(x_ptr + cols), NW, LOG_NW, WARP_COLS, True))

    errors: list[str] = []
    gen = torch.Generator().manual_seed(3)
    for nw in (1, 2, 8, 16):
        x = (torch.randn(nw * 256, generator=gen) * torch.logspace(-3, 3, nw * 256)).float()
        out = torch.zeros(1)
        probe[(1,)](x, out, NW=nw, LOG_NW=nw.bit_length() - 1, WARP_COLS=256)
        s = x.numpy().reshape(nw, 256).sum(axis=1, dtype=np.float32)
        while s.shape[0] > 1:
            s = (s[: s.shape[0] // 2] + s[s.shape[0] // 2:]).astype(np.float32)
        ok = out.numpy()[0].tobytes() == s[0].tobytes()
        print(f"{'ok  ' if ok else 'FAIL'} warp-ordered sum of squares, {nw} warps: {out.item()!r} vs {float(s[0])!r}")
        if not ok:
            errors.append(f"warp sum {nw} warps: {out.item()!r} != {float(s[0])!r}")
    return errors


def main() -> int:
    _setup()
    errors = check_norm_route() + check_warp_sum()
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
