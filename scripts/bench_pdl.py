"""Programmatic Dependent Launch (``LOOM_PDL``) on a chain of batch-1 decode layers: the kernels a
decode step launches, for N layers captured in one CUDA graph and replayed, with PDL off and on.

Two layer shapes, each as the engine runs it at one token (bf16, the measured GEMV and decode
attention tables where this GPU has entries, else cuBLAS and the rule):

- ``qwen3-30b-a3b``: [combine +] add + RMSNorm, qkv GEMV, q/k norm + RoPE, K/V store, paged decode
  attention (and its merge), o_proj GEMV, add + RMSNorm, router GEMV with the routing in its
  epilogue (or GEMV + route), the experts' gate/up and down (direct: no sort). Every one is a
  Triton kernel, so every boundary can overlap.
- ``llama-8b``: add + RMSNorm, qkv GEMV, RoPE, K/V store, attention, o_proj GEMV, add + RMSNorm,
  gate_up (cuBLAS), SiLU-and-mul, down (cuBLAS): a cuBLAS kernel is not launched with PDL, so the
  kernel after it cannot start early (and it cannot start before a PDL kernel ends).

Each layer has its own weights (random, small), so a replay reads them from HBM as a step does.
Reports microseconds a layer (graph replay time over replays and layers) off and on, the saving,
and the outputs' equality (PDL changes no arithmetic: the same bits).

    PYTHONPATH=service:plugins/.. python scripts/bench_pdl.py [--layers 16] [--ctx 512] [--out FILE]

``tests/gpu/test_pdl_gpu.py`` runs the same chain (``build_chain``) at a small shape to compare bits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class LayerShape:
    name: str
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    inter: int  # the MLP's (dense) or each expert's intermediate size
    experts: int = 0  # 0: a dense MLP
    top_k: int = 0
    qk_norm: bool = False


SHAPES = {
    "qwen3-30b-a3b": LayerShape("qwen3-30b-a3b", 2048, 32, 4, 128, 768, experts=128, top_k=8, qk_norm=True),
    "llama-8b": LayerShape("llama-8b", 4096, 32, 8, 128, 14336),
    # small ones for the GPU test
    "tiny-moe": LayerShape("tiny-moe", 256, 8, 2, 64, 128, experts=16, top_k=4, qk_norm=True),
    "tiny-dense": LayerShape("tiny-dense", 256, 8, 2, 64, 512),
}
PAGE = 16


def _import() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()


def build_chain(shape: LayerShape, layers: int, ctx: int, device: torch.device, seed: int = 0,
                max_seq_len: int = 4096, dtype: torch.dtype = torch.bfloat16,
                ) -> tuple[Callable[[], torch.Tensor], dict[str, Any]]:
    """``step()``: one token through ``layers`` decode layers of ``shape`` at position ``ctx``
    (``ctx`` keys already in each layer's pool, the new one stored at slot ``ctx``); returns the
    final hidden state ``[1, H]`` (a new tensor each call, static inside a graph). Also returns
    what it allocated, for the caller to keep alive. ``dtype``: the activations' and weights'
    (float32 for a check of the chain's code on the CPU, in Triton's interpreter)."""
    _import()
    from loom.layers import dense_gemv as dg
    from loom.layers import fused_moe_triton as fm
    from loom.layers import fused_ops as fo
    from loom.layers import moe_router_gemv as mr
    from loom.layers import moe_routing_triton as rt
    from loom.layers.split_k import counters
    from loom_plugins.attention.decode_plans import plan_decode
    from loom_plugins.attention.triton_kernels import paged_attention, store_kv

    dt = dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    h, hq, hkv, d = shape.hidden, shape.q_heads, shape.kv_heads, shape.head_dim

    def rand(*size: int, scale: float) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dt)

    blocks = -(-(ctx + 1) // PAGE)
    # (a CPU device runs the chain in Triton's interpreter: a check of the chain's code, no timing)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    plan = plan_decode(1, hkv, hq // hkv, d, max_seq_len, sms)
    ctr = counters(device)  # allocated here, outside any capture
    layer_w = []
    for _ in range(layers):
        w: dict[str, torch.Tensor] = {
            "ln1": 1.0 + rand(h, scale=0.1), "ln2": 1.0 + rand(h, scale=0.1),
            "qkv": rand((hq + 2 * hkv) * d, h, scale=h ** -0.5), "o": rand(h, hq * d, scale=(hq * d) ** -0.5),
            "kv": rand(2, blocks, PAGE, hkv, d, scale=1.0),
        }
        if shape.qk_norm:
            w["qn"], w["kn"] = 1.0 + rand(d, scale=0.1), 1.0 + rand(d, scale=0.1)
        if shape.experts:
            w["router"] = rand(shape.experts, h, scale=h ** -0.5)
            w["w13"] = rand(shape.experts, 2 * shape.inter, h, scale=h ** -0.5)
            w["w2"] = rand(shape.experts, h, shape.inter, scale=shape.inter ** -0.5)
        else:
            w["gate_up"] = rand(2 * shape.inter, h, scale=h ** -0.5)
            w["down"] = rand(h, shape.inter, scale=shape.inter ** -0.5)
        layer_w.append(w)
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    block_tables = perm.view(1, blocks).to(device)
    seq_lens = torch.tensor([ctx + 1], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    slot = torch.tensor([int(perm[ctx // PAGE]) * PAGE + ctx % PAGE], dtype=torch.int64, device=device)
    positions = torch.tensor([ctx], dtype=torch.int64, device=device)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    angles = torch.arange(max_seq_len, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = angles.cos(), angles.sin()  # [P, d / 2] float32
    x0 = rand(1, h, scale=1.0)
    residual0 = rand(1, h, scale=1.0)

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        p = dg.plan_for(x, weight)
        return dg.dense_gemv(x, weight, None, p) if p is not None else F.linear(x, weight)

    def step() -> torch.Tensor:
        hidden: Any = x0
        residual = residual0
        for w in layer_w:
            if isinstance(hidden, fm.ExpertOutputs):
                normed, residual = fo.fused_combine_add_rms_norm(hidden.rows, hidden.weights, residual, w["ln1"],
                                                                 1e-6)
            else:
                normed, residual = fo.fused_add_rms_norm(hidden, residual, w["ln1"], 1e-6)
            qkv = linear(normed, w["qkv"])  # [1, (hq + 2 hkv) d]
            q = qkv[:, : hq * d].view(1, hq, d)
            k = qkv[:, hq * d: (hq + hkv) * d].view(1, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(1, hkv, d)
            if shape.qk_norm:
                q, k = fo.qk_norm_rotary(positions, q, k, w["qn"], w["kn"], 1e-6, 1e-6, cos, sin)
            else:
                q, k = fo.rotary(positions, q, k, cos, sin)
            store_kv(k, v, w["kv"], slot)
            attn = torch.empty(1, hq, d, dtype=dt, device=device)
            fused = plan.fused_combine and plan.num_splits > 1
            paged_attention(q, w["kv"], attn, qsl, seq_lens, block_tables, num_seqs=1, seq_ids=None,
                            max_query_len=1, scale=d ** -0.5, sliding_window=None, num_splits=plan.num_splits,
                            block_n=plan.block_n, num_warps=plan.num_warps, num_stages=plan.num_stages,
                            min_keys=plan.min_keys, counters=ctr if fused else None)
            o = linear(attn.view(1, hq * d), w["o"])
            normed, residual = fo.fused_add_rms_norm(o, residual, w["ln2"], 1e-6)
            if shape.experts:
                rplan = mr.fused_router_plan(normed, w["router"], shape.top_k)
                if rplan is not None:
                    weights, ids = mr.route_from_hidden(normed, w["router"], shape.top_k, True, dt, rplan)
                else:
                    weights, ids = rt.route(linear(normed, w["router"]), shape.top_k, True, dt)
                hidden = fm.expert_outputs_triton(normed, w["w13"], w["w2"], weights, ids)
            else:
                hidden = linear(fo.silu_and_mul(linear(normed, w["gate_up"])), w["down"])
        if isinstance(hidden, fm.ExpertOutputs):
            hidden = hidden.combine()
        return torch.cat([hidden, residual])  # [2, H]: both streams, every layer's result in them

    return step, {"weights": layer_w, "plan": plan}


def capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``step`` run twice on a side stream (compiles, cuBLAS plans), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    return graph, out


def with_pdl(on: bool, fn: Callable[[], Any]) -> Any:
    """``fn()`` with ``kernel_switches.pdl`` set to ``on`` (launches read it each time)."""
    from loom import kernel_switches

    before = kernel_switches.pdl
    kernel_switches.pdl = on
    try:
        return fn()
    finally:
        kernel_switches.pdl = before


def time_graph(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Microseconds a replay, the median of five runs of ``replays`` replays."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1000.0 / replays)
    return sorted(runs)[len(runs) // 2]


def _compile_task(task: tuple[str, bool, int]) -> int:
    """In a spawned process: one layer of ``task``'s shape run once with PDL off or on, so its
    kernels land in Triton's on-disk cache before the timing process needs them."""
    name, on, ctx = task
    step, _ = build_chain(SHAPES[name], 1, ctx, torch.device("cuda"))
    with_pdl(on, step)
    torch.cuda.synchronize()
    return 1


def bench(shape: LayerShape, layers: int, ctx: int, replays: int) -> dict[str, Any]:
    _import()
    from loom.layers.triton_jit import pdl_enabled

    device = torch.device("cuda")
    t0 = time.perf_counter()
    step, keep = build_chain(shape, layers, ctx, device)
    result: dict[str, Any] = {"shape": shape.name, "layers": layers, "ctx": ctx, "replays": replays,
                              "pdl_available": with_pdl(True, lambda: pdl_enabled(device)),
                              "attention_plan": repr(keep["plan"])}
    outs = {}
    for on in (False, True):
        graph, out = with_pdl(on, lambda: capture(step))
        graph.replay()
        torch.cuda.synchronize()
        outs[on] = out.clone()
        us = time_graph(graph, replays)
        result[f"us_per_step_{'on' if on else 'off'}"] = round(us, 2)
        result[f"us_per_layer_{'on' if on else 'off'}"] = round(us / layers, 3)
        del graph
    result["us_per_layer_saved"] = round(result["us_per_layer_off"] - result["us_per_layer_on"], 3)
    result["same_bits"] = bool(torch.equal(outs[False], outs[True]))
    result["finite"] = bool(torch.isfinite(outs[True]).all())
    result["seconds"] = round(time.perf_counter() - t0, 1)
    del keep
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,llama-8b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=512, help="keys already in the pool (W1's are ~512-900)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=4, help="processes compiling the kernels ahead (1: none)")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    sys.path.insert(0, str(ROOT / "scripts"))
    from sweep_common import Compiler

    t0 = time.perf_counter()
    compiler = Compiler(args.jobs)
    names = args.shapes.split(",")
    compiled, failed = compiler.wait(compiler.submit(_compile_task, [(n, on, args.ctx) for n in names
                                                                     for on in (False, True)]))
    compiler.close()
    print(f"compiled ahead: {compiled} tasks ({failed} failed) in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for name in names:
        row = bench(SHAPES[name], args.layers, args.ctx, args.replays)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    if not all(r["same_bits"] and r["finite"] for r in rows):
        raise SystemExit("PDL changed the outputs")


if __name__ == "__main__":
    main()
