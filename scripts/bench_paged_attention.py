"""Microbenchmark of the ``paged`` backend's Triton kernels on a CUDA GPU.

Decode attention is memory-bound: each step reads every cached K and V byte once, so the figure
of merit is achieved bandwidth (K/V bytes + q + out over kernel time) against the device's copy
bandwidth (measured here with a large device-to-device copy, bytes read + written).

    PYTHONPATH=service python scripts/bench_paged_attention.py [--kv-cache-dtype fp8] [--out results.json]

With ``--kv-cache-dtype fp8`` every decode and prefill shape also runs over the packed FP8 pool
(the same values quantized), through the FP8 kernel and through the generic kernel's FP8 path;
an FP8 row's GB/s counts the bytes it reads (codes and scales, about half of bf16's).

Prints a table; ``--out`` writes every number as JSON. See docs/gpu-kernels.md for results.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _import_plugins() -> None:
    """``loom`` and ``loom_plugins`` from the source tree when they are not installed."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()


def bench_ms(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def decode_case(batch: int, ctx: int, hq: int, hkv: int, d: int, page: int = 16, seed: int = 0,
                fp8: bool = False) -> dict[str, Any]:
    """Tensors of one pure-decode step; every sequence has ``ctx`` tokens (the new one included).
    ``fp8``: the pool is the packed FP8 one (``--kv-cache-dtype fp8``), the same values quantized."""
    from loom.layers.attention import AttentionMetadata

    rng = random.Random(seed)
    per_seq = -(-ctx // page)
    num_blocks = batch * per_seq + 8
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.tensor(ids[: batch * per_seq], dtype=torch.int32).view(batch, per_seq).cuda()
    cache = torch.randn(2, num_blocks, page, hkv, d, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    slots = (tables[:, (ctx - 1) // page].long() * page + (ctx - 1) % page)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        slot_mapping=slots, block_tables=tables, query_lens_cpu=[1] * batch, seq_lens_cpu=[ctx] * batch,
        max_query_len=1, max_seq_len=ctx, block_size=page)
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    if fp8:
        from loom.plugin_api import kv_fp8

        packed = kv_fp8.allocate(num_blocks, page, hkv, d, cache.device)
        views = kv_fp8.views(packed)
        for codes, scales, x in ((views.k_codes, views.k_scales, cache[0]), (views.v_codes, views.v_scales, cache[1])):
            c, sc = kv_fp8.quantize(x)
            codes.copy_(c)
            scales.copy_(sc)
        cache = packed
        kv_bytes = 2 * batch * ctx * hkv * (d + kv_fp8.SCALE_BYTES)
    io_bytes = 2 * batch * hq * d * 2 + tables.numel() * 4
    return dict(q=q, cache=cache, meta=meta, bytes=kv_bytes + io_bytes)


HQ, HKV, D = 32, 8, 128  # Llama-3-8B attention
SCALE = D**-0.5


def decode_rows(batch: int, ctx: int, num_sms: int, fp8: str | None = None) -> list[dict[str, Any]]:
    """``fp8``: None (a bf16 pool), "fp8_kernel" (the FP8 pool through triton_fp8_attention.py)
    or "generic" (the FP8 pool through the generic kernel's FP8 path, LOOM_FP8_KV_KERNEL=0)."""
    from loom import kernel_switches
    from loom_plugins.attention.paged_triton import PagedAttentionBackend, choose_num_splits
    from loom_plugins.attention.torch_backend import TorchAttentionBackend
    from loom_plugins.attention.triton_fp8_attention import paged_attention_fp8
    from loom_plugins.attention.triton_kernels import paged_attention

    case = decode_case(batch, ctx, HQ, HKV, D, fp8=fp8 is not None)
    q, cache, meta = case["q"], case["cache"], case["meta"]
    out = torch.empty_like(q)
    splits = choose_num_splits(batch, HKV, ctx, num_sms)
    attend = paged_attention_fp8 if fp8 == "fp8_kernel" else paged_attention
    pool = "bf16" if fp8 is None else f"fp8 ({fp8.replace('_', ' ')})"
    # (block_n, num_warps, splits); None: the launcher's own choice
    variants: list[tuple[int | None, int | None, int]] = [(None, None, splits)]
    if fp8 == "fp8_kernel":
        variants += [(32, None, 1), (128, None, 1), (64, 2, 1)] if batch >= 64 else [(None, None, 1)]
    elif fp8 is None:
        variants += [(32, 4, 1), (128, 4, 1), (64, 8, 1), (128, 8, 1)] if batch >= 64 else [(64, 4, 1)]
    rows: list[dict[str, Any]] = []
    for block_n, warps, n_splits in variants:
        def call(block_n: int | None = block_n, warps: int | None = warps, n_splits: int = n_splits) -> None:
            attend(q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                   num_seqs=batch, seq_ids=None, max_query_len=1, scale=SCALE,
                   sliding_window=None, num_splits=n_splits, block_n=block_n, num_warps=warps)
        ms = bench_ms(call)
        rows.append(dict(kernel="paged decode", pool=pool, batch=batch, ctx=ctx, block_n=block_n or "auto",
                         num_warps=warps or "auto", splits=n_splits, us=ms * 1e3,
                         GBps=case["bytes"] / (ms * 1e-3) / 1e9))
    k_new = torch.randn(batch, HKV, D, dtype=torch.bfloat16, device="cuda")
    backends: list[tuple[str, Any]] = [("paged", PagedAttentionBackend)]
    if fp8 is None:
        backends.insert(0, ("torch", TorchAttentionBackend))
    before = kernel_switches.fp8_kv_kernel
    kernel_switches.fp8_kv_kernel = fp8 != "generic"
    try:
        for name, cls in backends:
            backend = cls(HQ, HKV, D, torch.bfloat16, torch.device("cuda"))
            if fp8 is not None:
                backend.use_fp8_kv_cache()
            plan = backend.prepare(meta)
            ms = bench_ms(lambda backend=backend, plan=plan: backend.forward(q, k_new, k_new, cache, meta, plan,
                                                                             SCALE, None))
            rows.append(dict(kernel=f"{name} backend decode (incl. K/V write)", pool=pool, batch=batch, ctx=ctx,
                             us=ms * 1e3, GBps=case["bytes"] / (ms * 1e-3) / 1e9))
    finally:
        kernel_switches.fp8_kv_kernel = before
    return rows


def store_rows(tokens: int) -> list[dict[str, Any]]:
    """K/V write: one Triton launch against two index_copy_ launches."""
    from loom_plugins.attention.triton_kernels import store_kv

    cache = torch.randn(2, 4096, 16, HKV, D, dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device="cuda")
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(tokens, HKV, D)  # strided, as the model hands it over
    v = qkv[:, (HQ + HKV) * D :].view(tokens, HKV, D)
    slots = torch.randperm(4096 * 16, device="cuda")[:tokens]
    flat_k, flat_v = cache[0].view(-1, HKV, D), cache[1].view(-1, HKV, D)

    def two_copies() -> None:
        flat_k.index_copy_(0, slots, k)
        flat_v.index_copy_(0, slots, v)

    return [dict(kernel="store_kv (triton)", tokens=tokens, us=bench_ms(lambda: store_kv(k, v, cache, slots)) * 1e3),
            dict(kernel="index_copy_ x2 (torch)", tokens=tokens, us=bench_ms(two_copies) * 1e3)]


def prefill_rows(ctx: int, qlen: int, fp8: bool = False) -> list[dict[str, Any]]:
    from loom.layers.attention import AttentionMetadata
    from loom.plugin_api import kv_fp8
    from loom_plugins.attention.triton_fp8_attention import paged_attention_fp8
    from loom_plugins.attention.triton_kernels import paged_attention

    L, page = ctx + qlen, 16
    blocks = torch.randperm(L // page + 4, device="cuda")[: L // page].int()
    cache = torch.randn(2, L // page + 4, page, HKV, D, dtype=torch.bfloat16, device="cuda")
    if fp8:
        packed = kv_fp8.allocate(L // page + 4, page, HKV, D, cache.device)
        views = kv_fp8.views(packed)
        for codes, scales, x in ((views.k_codes, views.k_scales, cache[0]), (views.v_codes, views.v_scales, cache[1])):
            c, sc = kv_fp8.quantize(x)
            codes.copy_(c)
            scales.copy_(sc)
        cache = packed
    q = torch.randn(qlen, HQ, D, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, qlen], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([L], dtype=torch.int32, device="cuda"),
        slot_mapping=torch.zeros(qlen, dtype=torch.int64, device="cuda"),
        block_tables=blocks[None], query_lens_cpu=[qlen], seq_lens_cpu=[L], max_query_len=qlen,
        max_seq_len=L, block_size=page)
    flops = 4 * HQ * D * (qlen * ctx + qlen * (qlen + 1) / 2)  # QK^T and PV over visible pairs
    kernels = [("paged prefill", paged_attention)]
    if fp8:
        kernels = [("paged prefill, fp8 kernel", paged_attention_fp8), ("paged prefill, generic kernel", paged_attention)]
    rows = []
    for name, attend in kernels:
        ms = bench_ms(lambda attend=attend: attend(q, cache, out, meta.query_start_loc, meta.seq_lens,
                                                   meta.block_tables, num_seqs=1, seq_ids=None, max_query_len=qlen,
                                                   scale=SCALE, sliding_window=None))
        rows.append(dict(kernel=name, pool="fp8" if fp8 else "bf16", ctx=ctx, query_len=qlen, us=ms * 1e3,
                         TFLOPs=flops / (ms * 1e-3) / 1e12))
    if ctx == 0 and not fp8:
        qs = q.transpose(0, 1)[None]  # [1, Hq, L, D]
        ks = torch.randn(1, HKV, L, D, dtype=torch.bfloat16, device="cuda")
        ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, ks, is_causal=True,
                                                                               enable_gqa=True))
        rows.append(dict(kernel="torch SDPA prefill (contiguous K/V, reference)", ctx=0, query_len=qlen,
                         us=ms * 1e3, TFLOPs=flops / (ms * 1e-3) / 1e12))
    return rows


def run(out_path: str | None, kv_cache_dtype: str = "auto") -> None:
    _import_plugins()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {"device": props.name, "torch": torch.__version__, "sms": props.multi_processor_count}
    bw = copy_bandwidth()
    results["copy_bandwidth_GBps"] = bw / 1e9
    print(f"{props.name}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    rows: list[dict[str, Any]] = []
    for batch, ctx in ((64, 600), (256, 600), (4, 4096), (1, 4096)):
        rows += decode_rows(batch, ctx, props.multi_processor_count)
        if kv_cache_dtype == "fp8":
            rows += decode_rows(batch, ctx, props.multi_processor_count, fp8="fp8_kernel")
            rows += decode_rows(batch, ctx, props.multi_processor_count, fp8="generic")
    for tokens in (256, 4096):
        rows += store_rows(tokens)
    for ctx, qlen in ((0, 2048), (1536, 512)):
        rows += prefill_rows(ctx, qlen)
        if kv_cache_dtype == "fp8":
            rows += prefill_rows(ctx, qlen, fp8=True)
    results["rows"] = rows
    print(f"{'kernel':48} {'shape':56} {'us':>9} {'GB/s':>8} {'% copy':>7} {'% 4.3TB/s':>9} {'TFLOP/s':>8}")
    for r in rows:
        shape = " ".join(f"{k}={r[k]}" for k in ("pool", "batch", "ctx", "tokens", "query_len", "block_n",
                                                  "num_warps", "splits") if k in r)
        gbps = r.get("GBps")
        extra = (f"{gbps:8.0f} {100 * gbps * 1e9 / bw:6.1f}% {100 * gbps / 4300:8.1f}%" if gbps is not None
                 else f"{'':8} {'':7} {'':9}")
        tf = f"{r['TFLOPs']:8.1f}" if "TFLOPs" in r else ""
        print(f"{r['kernel']:48} {shape:56} {r['us']:9.1f} {extra} {tf}")
    if out_path:
        Path(out_path).write_text(json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: also decode and prefill over the FP8 pool (both kernels) beside each bf16 row")
    args = parser.parse_args()
    run(args.out, args.kv_cache_dtype)


if __name__ == "__main__":
    main()
