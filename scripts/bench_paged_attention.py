"""Microbenchmark of the ``paged`` backend's Triton kernels on a CUDA GPU.

Decode attention is memory-bound: each step reads every cached K and V byte once, so the figure
of merit is achieved bandwidth (K/V bytes + q + out over kernel time) against the device's copy
bandwidth (measured here with a large device-to-device copy, bytes read + written).

    PYTHONPATH=service python scripts/bench_paged_attention.py [--out results.json]

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


def decode_case(batch: int, ctx: int, hq: int, hkv: int, d: int, page: int = 16, seed: int = 0) -> dict[str, Any]:
    """Tensors of one pure-decode step; every sequence has ``ctx`` tokens (the new one included)."""
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
    io_bytes = 2 * batch * hq * d * 2 + tables.numel() * 4
    return dict(q=q, cache=cache, meta=meta, bytes=kv_bytes + io_bytes)


HQ, HKV, D = 32, 8, 128  # Llama-3-8B attention
SCALE = D**-0.5


def decode_rows(batch: int, ctx: int, num_sms: int) -> list[dict[str, Any]]:
    from loom_plugins.attention.paged_triton import PagedAttentionBackend, choose_num_splits
    from loom_plugins.attention.torch_backend import TorchAttentionBackend
    from loom_plugins.attention.triton_kernels import paged_attention

    case = decode_case(batch, ctx, HQ, HKV, D)
    q, cache, meta = case["q"], case["cache"], case["meta"]
    out = torch.empty_like(q)
    variants = [(64, 4, choose_num_splits(batch, HKV, ctx, num_sms))]
    if batch >= 64:  # tile and warp count sweep
        variants += [(32, 4, 1), (128, 4, 1), (64, 8, 1), (128, 8, 1)]
    else:  # split-K (the first variant) against none
        variants += [(64, 4, 1)]
    rows: list[dict[str, Any]] = []
    for block_n, warps, splits in variants:
        def call(block_n: int = block_n, warps: int = warps, splits: int = splits) -> None:
            paged_attention(q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                            num_seqs=batch, seq_ids=None, max_query_len=1, scale=SCALE,
                            sliding_window=None, num_splits=splits, block_n=block_n, num_warps=warps)
        ms = bench_ms(call)
        rows.append(dict(kernel="paged decode", batch=batch, ctx=ctx, block_n=block_n, num_warps=warps,
                         splits=splits, us=ms * 1e3, GBps=case["bytes"] / (ms * 1e-3) / 1e9))
    k_new = torch.randn(batch, HKV, D, dtype=torch.bfloat16, device="cuda")
    for name, cls in (("torch", TorchAttentionBackend), ("paged", PagedAttentionBackend)):
        backend = cls(HQ, HKV, D, torch.bfloat16, torch.device("cuda"))
        plan = backend.prepare(meta)
        ms = bench_ms(lambda backend=backend, plan=plan: backend.forward(q, k_new, k_new, cache, meta, plan, SCALE,
                                                                         None))
        rows.append(dict(kernel=f"{name} backend decode (incl. K/V write)", batch=batch, ctx=ctx, us=ms * 1e3,
                         GBps=case["bytes"] / (ms * 1e-3) / 1e9))
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


def prefill_rows(ctx: int, qlen: int) -> list[dict[str, Any]]:
    from loom.layers.attention import AttentionMetadata
    from loom_plugins.attention.triton_kernels import paged_attention

    L, page = ctx + qlen, 16
    blocks = torch.randperm(L // page + 4, device="cuda")[: L // page].int()
    cache = torch.randn(2, L // page + 4, page, HKV, D, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(qlen, HQ, D, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, qlen], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([L], dtype=torch.int32, device="cuda"),
        slot_mapping=torch.zeros(qlen, dtype=torch.int64, device="cuda"),
        block_tables=blocks[None], query_lens_cpu=[qlen], seq_lens_cpu=[L], max_query_len=qlen,
        max_seq_len=L, block_size=page)
    ms = bench_ms(lambda: paged_attention(q, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                          num_seqs=1, seq_ids=None, max_query_len=qlen, scale=SCALE,
                                          sliding_window=None))
    flops = 4 * HQ * D * (qlen * ctx + qlen * (qlen + 1) / 2)  # QK^T and PV over visible pairs
    rows = [dict(kernel="paged prefill", ctx=ctx, query_len=qlen, us=ms * 1e3, TFLOPs=flops / (ms * 1e-3) / 1e12)]
    if ctx == 0:
        qs = q.transpose(0, 1)[None]  # [1, Hq, L, D]
        ks = torch.randn(1, HKV, L, D, dtype=torch.bfloat16, device="cuda")
        ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, ks, is_causal=True,
                                                                               enable_gqa=True))
        rows.append(dict(kernel="torch SDPA prefill (contiguous K/V, reference)", ctx=0, query_len=qlen,
                         us=ms * 1e3, TFLOPs=flops / (ms * 1e-3) / 1e12))
    return rows


def run(out_path: str | None) -> None:
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
    for tokens in (256, 4096):
        rows += store_rows(tokens)
    for ctx, qlen in ((0, 2048), (1536, 512)):
        rows += prefill_rows(ctx, qlen)
    results["rows"] = rows
    print(f"{'kernel':48} {'shape':40} {'us':>9} {'GB/s':>8} {'% copy':>7} {'% 4.3TB/s':>9} {'TFLOP/s':>8}")
    for r in rows:
        shape = " ".join(f"{k}={r[k]}" for k in ("batch", "ctx", "tokens", "query_len", "block_n", "num_warps",
                                                  "splits") if k in r)
        gbps = r.get("GBps")
        extra = (f"{gbps:8.0f} {100 * gbps * 1e9 / bw:6.1f}% {100 * gbps / 4300:8.1f}%" if gbps is not None
                 else f"{'':8} {'':7} {'':9}")
        tf = f"{r['TFLOPs']:8.1f}" if "TFLOPs" in r else ""
        print(f"{r['kernel']:48} {shape:40} {r['us']:9.1f} {extra} {tf}")
    if out_path:
        Path(out_path).write_text(json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    run(args.out)


if __name__ == "__main__":
    main()
