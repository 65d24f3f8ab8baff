"""`loom bench`: run workloads for Loom and, with ``--peer hf``, for transformers in the same run.

C0-C2 (CPU, SmolLM2): Loom against transformers' ``generate()``.
W1, W2 (GPU; on CPU for smoke tests): Loom, then, after Loom's engine process has exited and freed
the device, the physical limits measured on the same device and the peer of
../shared/bench/hf_peer.py; each workload reports Loom, the peer, the ratio to the peer
(``ratio``) and the ratio to the physical limit (``ratio_to_limit``).
W3: serving through gRPC against a ``loom serve`` child process, and the same requests against
the in-process engine client (``grpc_overhead``).

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from loom import __version__
from loom.cli import parse_key_value
from loom.config import ConfigError, EngineConfig
from loom.process_tuning import freeze_startup_objects

from .workloads import Workload, cpu_workload, gpu_workload, serving_w3, w2_requests_for

CPU_WORKLOADS = ("C0", "C1", "C2")
MODEL_WORKLOADS = ("W1", "W2")
SERVING_WORKLOADS = ("W3",)
PREFIX_WORKLOADS = ("W4",)
STRUCTURED_WORKLOADS = ("S1",)
LORA_WORKLOADS = ("L1",)
SPECULATION_WORKLOADS = ("C3", "W5")


def add_bench_command(sub: Any) -> None:
    p = sub.add_parser("bench", help="run benchmark workloads (C0-C2 on CPU, W1-W3) against a peer")
    p.add_argument("--workloads", default="C0,C1,C2",
                   help="comma-separated: C0,C1,C2 (CPU, SmolLM2), W1,W2 (decode latency, offline "
                        "throughput), W3 (serving through gRPC), W4 (prefix cache), C3 (speculation on copy-heavy "
                        "chat requests, SmolLM2; --device cuda --dtype bfloat16 makes it W5 a), S1 (structured output), "
                        "L1 (W2 over 8 LoRA adapters and the base model), W5 (W5 b and c: a draft model at "
                        "batch 1 for k = 2..6, the verification cost curve; needs --speculator-option "
                        "model_id=...)")
    p.add_argument("--peer", choices=["none", "hf"], default="none", help="also run this peer in the same run")
    p.add_argument("--peer-static-batches", default=None,
                   help="GPU peer: the static generate() batch sizes, comma-separated, or none; unset: 64 "
                        "(64,128 for llama-1b; 2 with --quick)")
    p.add_argument("--peer-w2-timeout-s", type=float, default=None,
                   help="GPU peer: run its W2 in a process of its own and stop it after this many seconds "
                        "from W2's start; unfinished, it reports the bound on its throughput (W2 tokens / "
                        "seconds) and the bench the lower bound of Loom's ratio")
    p.add_argument("--model-id", default=None,
                   help="model dir, .gguf or random:NAME (random:llama-8b, random:llama-1b, ...); "
                        "default: embedded SmolLM2")
    p.add_argument("--threads", type=int, default=2, help="torch threads for Loom and the peer on CPU")
    p.add_argument("--quantize", default="auto",
                   help="the engine's --quantize: auto (GGUF blocks on the CPU), none, or a quantizer plugin")
    p.add_argument("--quick", action="store_true", help="tiny workloads: checks the harness, not speed")
    p.add_argument("--out", default=None, help="write the JSON result here (e.g. bench/results/cpu.json)")
    g = p.add_argument_group("W1-W3 engine (C0-C2 always run on CPU with their own settings)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    g.add_argument("--attention-backend", default=None, help="attention plugin; unset: the best available")
    g.add_argument("--max-step-latency-ms", type=float, default=None,
                   help="the engine's --max-step-latency-ms (a target for steps that carry decodes)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="the engine's --kv-cache-dtype (the W1 / W2 limits count its KV bytes)")
    g.add_argument("--max-batch-prefill-tokens", type=int, default=None,
                   help="prompt tokens per engine step; unset: 16384 on GPU, 4096 on CPU")
    g.add_argument("--max-total-tokens", type=int, default=2048, help="prompt + new tokens per request")
    g.add_argument("--max-batch-total-tokens", type=int, default=None, help="KV pool in tokens; unset: sized")
    g.add_argument("--cuda-memory-fraction", type=float, default=None, help="share of free GPU memory for KV")
    g.add_argument("--cuda-graphs", default=None,
                   help="passed to the engine's cuda_graphs setting when the engine has one (e.g. 1,2,4,8 or 0)")
    g.add_argument("--async-scheduling", default=None, choices=("auto", "on", "off"),
                   help="the engine's async_scheduling setting (default: auto, on for CUDA)")
    g.add_argument("--grammar-process", default=None, choices=("auto", "on", "off"),
                   help="the engine's grammar_process setting (S1; default: auto, on with async scheduling)")
    g.add_argument("--grammar-processes", type=int, default=None,
                   help="the engine's grammar_processes setting (S1; default: 1)")
    g = p.add_argument_group("workload sizes")
    g.add_argument("--w2-requests", type=int, default=None,
                   help="W2 request count; unset: 512 for llama-1b, else 256 (16 with --quick)")
    g.add_argument("--w3-requests", type=int, default=None,
                   help="W3 request count; unset: W2's on GPU, 16 on CPU (4 with --quick)")
    g.add_argument("--w3-new-tokens", type=int, default=None,
                   help="W3 new tokens per request; unset: 256 on GPU, 64 on CPU (8 with --quick)")
    g.add_argument("--w4-requests", type=int, default=None,
                   help="W4 request count; unset: 128 on GPU, 16 on CPU (4 with --quick)")
    g.add_argument("--w4-prefix", type=int, default=None,
                   help="W4 shared prefix tokens; unset: 2048 on GPU, 512 on CPU (32 with --quick)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="W3 Poisson arrival rate in requests/s; inf (default): all at once")
    g.add_argument("--seed", type=int, default=0, help="W3 arrival seed")
    g.add_argument("--s1-requests", type=int, default=None, help="S1 request count; unset: 64 (8 with --quick)")
    g.add_argument("--s1-new-tokens", type=int, default=None,
                   help="S1 most new tokens per request; unset: 128 (16 with --quick)")
    g.add_argument("--s1-variants", type=int, default=None,
                   help="S1 renamed copies of each schema compiled cold; unset: 8 (2 with --quick)")
    g.add_argument("--s1-shared-prompts", action="store_true",
                   help="S1: the requests of one schema share one prompt (so their greedy outputs are "
                        "identical), as S1 ran before 2026-12-03; default: each request its own prompt")
    g.add_argument("--s1-repeats", type=int, default=1,
                   help="S1: time the with/without-grammar pair this many times (after an untimed pair)")
    g.add_argument("--speculate", type=int, default=None,
                   help="draft tokens per step (n-gram): C3's speculating run (default 4); W1/W2 with it set "
                        "run the engine with --speculate (default: off)")
    g.add_argument("--speculator", default=None,
                   help="the speculator plugin for W1/W2 with --speculate (default: the engine's, ngram); "
                        "W5 b: draft with --speculator-option model_id=random:llama-8b "
                        "--speculator-option quantize=gptq")
    g.add_argument("--speculator-option", type=parse_key_value, action="append", default=[],
                   help="KEY=VALUE for the speculator (repeatable), as loom serve takes it")
    g.add_argument("--w5-ks", default="2,3,4,5,6",
                   help="W5 b: the draft counts k to time, comma-separated (each after an untimed run)")
    g.add_argument("--w5-cost-batches", default="1,16,64",
                   help="W5 c: the batch sizes of the verification cost curve, comma-separated")
    g.add_argument("--w3-repeats", type=int, default=1,
                   help="W3: run the gRPC / in-process pair this many times in alternating order "
                        "and compare the means (use >= 2 on a noisy machine)")
    p.set_defaults(func=run_bench)


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def software_info(device: torch.device) -> dict[str, Any]:
    """The versions and the accelerator a W1-W3 figure depends on."""
    info: dict[str, Any] = {}
    for module in ("transformers", "triton", "grpc", "flash_attn"):
        try:
            info[module] = __import__(module).__version__
        except Exception:
            info[module] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpu_multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    return info


async def _run_loom(cfg: EngineConfig, workloads: list[Workload], full_warmup: bool = False,
                    adapters: Sequence[str] = ()) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    from loom.engine.core_process import AsyncEngineClient

    from .run_loom import run_engine_workload

    client = AsyncEngineClient(cfg)
    info = await client.start()
    freeze_startup_objects()  # as the server's front end does once started
    try:
        results = {w.name: await run_engine_workload(client, w, full_warmup=full_warmup, adapters=adapters)
                   for w in workloads}
    finally:
        await client.shutdown()
    return results, dataclasses.asdict(info)


# -- C0-C2 ---------------------------------------------------------------------------------------------------


def cpu_pool_tokens(workloads: list[Workload], block_size: int = 16) -> int:
    """A CPU KV pool that holds every request of the largest workload at once, in whole blocks:
    the figures measure batching, not preemption (the engine's default CPU pool holds only four
    full-length sequences)."""
    return max(sum(-(-(len(p) + n) // block_size) * block_size for p, n in w.requests) for w in workloads)


def _run_cpu_workloads(args: argparse.Namespace, names: list[str], result: dict[str, Any]) -> None:
    from loom.model_loader import resolve_model_dir

    workloads = [cpu_workload(n, quick=args.quick) for n in names]
    model_dir = resolve_model_dir(args.model_id)
    max_total = max(len(p) + n for w in workloads for p, n in w.requests)
    cfg = EngineConfig(model_id=str(model_dir), device="cpu", num_threads=args.threads, quantize=args.quantize,
                       max_total_tokens=max(max_total, 1024), max_batch_prefill_tokens=4096,
                       max_batch_total_tokens=max(cpu_pool_tokens(workloads), max_total, 1024))
    loom, info = asyncio.run(_run_loom(cfg, workloads))
    result["cpu_engine"] = {"plugins": info["plugins"], "attention_backend": info["attention_backend"],
                            "dtype": info["dtype"]}
    peer: dict[str, dict[str, float]] = {}
    if args.peer == "hf":
        from .peer_hf import load_peer, run_peer

        model = load_peer(model_dir)
        for w in workloads:
            peer[w.name] = run_peer(model, w, per_batch=8 if w.name == "C2" else None)
    for w in workloads:
        entry: dict[str, Any] = {"description": w.description, "loom": loom[w.name]}
        if w.name in peer:
            entry["peer"] = {"name": "hf-generate", **peer[w.name]}
            entry["ratio"] = loom[w.name]["out_tok_s"] / peer[w.name]["out_tok_s"]
        result["workloads"][w.name] = entry
        line = f"{w.name}: loom {loom[w.name]['out_tok_s']:.1f} out tok/s"
        if w.name in peer:
            line += f", peer {peer[w.name]['out_tok_s']:.1f} out tok/s, ratio {entry['ratio']:.2f}x"
        print(line, flush=True)


# -- W1, W2 and W3 ---------------------------------------------------------------------------------------------


def _parse_setting(text: str, default: Any) -> Any:
    """A command-line string as the type of the EngineConfig field's default."""
    if isinstance(default, bool):
        from loom.cli import parse_bool

        return parse_bool(text)
    if isinstance(default, (tuple, list)):
        return tuple(int(x) for x in text.split(",") if x.strip())
    if isinstance(default, int):
        return int(text)
    return text


def engine_config(args: argparse.Namespace, device: torch.device, workloads: list[Workload]) -> EngineConfig:
    """The engine the W workloads run on: the same for Loom's W1/W2, the gRPC server and W3's
    in-process comparison."""
    on_gpu = device.type == "cuda"
    needed = max(len(p) + n for w in workloads for p, n in w.requests)
    kwargs: dict[str, Any] = dict(
        model_id=args.model_id, device=str(device), dtype=args.dtype, attention_backend=args.attention_backend,
        quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype, max_step_latency_ms=args.max_step_latency_ms,
        max_total_tokens=max(args.max_total_tokens, needed),
        max_batch_prefill_tokens=args.max_batch_prefill_tokens or (16384 if on_gpu else 4096),
        max_batch_total_tokens=args.max_batch_total_tokens or (None if on_gpu else max(
            cpu_pool_tokens(workloads), args.max_total_tokens, needed)),
    )
    if not on_gpu:
        kwargs["num_threads"] = args.threads
    if args.cuda_memory_fraction is not None:
        kwargs["cuda_memory_fraction"] = args.cuda_memory_fraction
    if args.async_scheduling is not None:
        kwargs["async_scheduling"] = args.async_scheduling
    if getattr(args, "grammar_process", None) is not None:
        kwargs["grammar_process"] = args.grammar_process
    if getattr(args, "grammar_processes", None) is not None:
        kwargs["grammar_processes"] = args.grammar_processes
    if getattr(args, "speculate", None):
        kwargs["speculate"] = args.speculate
        if getattr(args, "speculator", None):
            kwargs["speculator"] = args.speculator
        if getattr(args, "speculator_option", None):
            kwargs["speculator_options"] = tuple(args.speculator_option)
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    if args.cuda_graphs is not None:
        # CUDA graphs may not exist in this engine yet: pass the setting only when it does.
        if "cuda_graphs" in fields:
            kwargs["cuda_graphs"] = _parse_setting(args.cuda_graphs, EngineConfig().cuda_graphs)
        else:
            print("loom bench: this engine has no cuda_graphs setting; --cuda-graphs ignored", file=sys.stderr)
    return EngineConfig(**kwargs)


def _limit_line(entry: dict[str, Any]) -> str:
    parts = []
    peer = entry.get("peer", {})
    if "ratio" in entry:
        parts.append(f"peer {peer['out_tok_s']:.1f} ({entry['ratio']:.2f}x)")
    elif "ratio_at_least" in entry:
        parts.append(f"peer unfinished after {peer['s_at_least']:.0f} s, under {peer['out_tok_s_at_most']:.1f} "
                     f"(>= {entry['ratio_at_least']:.2f}x)")
    elif "error" in peer:
        parts.append("peer failed")
    if "limit" in entry:
        parts.append(f"limit {entry['limit']['max_out_tok_s']:.1f} ({100 * entry['ratio_to_limit']:.1f}%)")
    return ", ".join(parts)


def _run_model_workloads(args: argparse.Namespace, names: list[str], device: torch.device,
                         result: dict[str, Any]) -> None:
    from loom.model_loader import resolve_model_dir
    from loom.worker.worker import _DTYPES

    from .limits import measure_hardware, model_cost, served_cost, w1_limit, w2_limit, weight_read_limit
    from .weight_memory import measure_weight_memory

    workloads = [gpu_workload(n, args.model_id, args.quick, args.w2_requests) for n in names]
    model_dir = resolve_model_dir(args.model_id)
    cfg = engine_config(args, device, workloads)
    result["engine_config"] = dataclasses.asdict(cfg)
    loom, info = asyncio.run(_run_loom(cfg, workloads, full_warmup=True))
    result["engine"] = info
    # Loom's figures first, on their own line: they survive a peer that runs out of time.
    print(json.dumps({"partial": "loom", "workloads": loom, "engine": info}), flush=True)
    # Loom's engine process has exited: the device is free for the limits and the peer.
    dtype = _DTYPES[info["dtype"]]
    hw = measure_hardware(device, dtype, quick=args.quick)
    cost = model_cost(model_dir, dtype, args.kv_cache_dtype)
    # W6: the weights as the engine served them (quantized or not) and the KV pool they left
    memory = measure_weight_memory(model_dir, dtype, device, args.quantize)
    pool_tokens = int(info["max_batch_total_tokens"])
    result["memory"] = {"weights": memory, "kv_pool": {
        "tokens": pool_tokens, "blocks": int(info["num_blocks"]), "bytes": pool_tokens * cost.kv_bytes_per_token}}
    served = served_cost(cost, int(memory["weight_bytes"]),
                         int(memory["expert_bytes"]) if cost.num_experts else None)
    quantized = memory["quantization"] is not None
    result["limits"] = {"hardware": hw.as_dict(), "model": cost.as_dict(),
                        # what a batch-1 decode step reads (an MoE model: its chosen experts only)
                        "weight_read": weight_read_limit(int(served.step_weight_bytes(1)), hw),
                        "dense_weight_read": weight_read_limit(int(cost.step_weight_bytes(1)), hw)}
    print(f"weights {served.weight_bytes / 2**30:.2f} GiB ({memory['quantization'] or 'dense'}), KV pool "
          f"{pool_tokens} tokens ({pool_tokens * cost.kv_bytes_per_token / 2**30:.2f} GiB); weight-read limit "
          f"{result['limits']['weight_read']['max_decode_tok_s']:.0f} decode steps/s", flush=True)
    peer: dict[str, Any] = {}
    if args.peer == "hf":
        from .peer_hf import run_gpu_peer

        big = w2_requests_for(args.model_id) == 512  # hf_peer.py: batches 64 and 128 for llama-1b
        batches = [2] if args.quick else ([64, 128] if big else [64])
        if args.peer_static_batches is not None:
            batches = [] if args.peer_static_batches == "none" else list(
                _int_list(args.peer_static_batches, "--peer-static-batches"))
        static_new = workloads[0].requests[0][1] if args.quick else 256
        peer = run_gpu_peer(model_dir, dtype, device, workloads, batches, static_new, args.peer_w2_timeout_s)
        result["peer"] = {"transformers": peer["transformers"], "static_generate": peer["static"]}
    for w in workloads:
        figures = loom[w.name]
        # the limit of the weights as served: for int4 weights, the int4 weight-read limit
        limit = w1_limit(served, hw, w) if w.name == "W1" else w2_limit(served, hw, w)
        entry: dict[str, Any] = {"description": w.description, "loom": figures, "limit": limit,
                                 "ratio_to_limit": figures["out_tok_s"] / limit["max_out_tok_s"]}
        if quantized:  # for comparison: the same workload's limit with the dense weights
            entry["limit_dense_weights"] = w1_limit(cost, hw, w) if w.name == "W1" else w2_limit(cost, hw, w)
        if w.name in peer:
            entry["peer"] = peer[w.name]
            if peer[w.name].get("out_tok_s"):
                entry["ratio"] = figures["out_tok_s"] / peer[w.name]["out_tok_s"]
            elif peer[w.name].get("timed_out"):  # the peer ran out of time: only a bound
                entry["ratio_at_least"] = figures["out_tok_s"] / peer[w.name]["out_tok_s_at_most"]
        result["workloads"][w.name] = entry
        detail = (f"ITL mean {1e3 * figures['itl_mean_s']:.2f} ms, p99 {1e3 * figures['itl_p99_s']:.2f} ms"
                  if w.name == "W1" else f"{figures['total_tok_s']:.1f} total tok/s in {figures['s']:.2f} s")
        spec: Any = figures.get("speculation")
        if spec:
            detail += f"; drafts accepted {spec['accepted_tokens']} of {spec['draft_tokens']} ({spec['acceptance']:.2f})"
        print(f"{w.name}: loom {figures['out_tok_s']:.1f} out tok/s ({detail}); {_limit_line(entry)}", flush=True)


def _run_serving(args: argparse.Namespace, device: torch.device, result: dict[str, Any]) -> None:
    from .serving import run_w3

    on_gpu = device.type == "cuda"
    count = args.w3_requests or (4 if args.quick else (w2_requests_for(args.model_id) if on_gpu else 16))
    new = args.w3_new_tokens or (8 if args.quick else (256 if on_gpu else 64))
    w = serving_w3(count, new)
    cfg = engine_config(args, device, [w])
    result.setdefault("engine_config", dataclasses.asdict(cfg))
    entry = asyncio.run(run_w3(cfg, w, args.request_rate, args.seed, args.w3_repeats))
    result["workloads"]["W3"] = entry
    g, e = entry["grpc"], entry["engine"]
    print(f"W3: grpc {g['out_tok_s']:.1f} out tok/s, {g['request_s']:.2f} req/s, TTFT p50 "
          f"{1e3 * g['ttft_s']['p50']:.0f} ms p99 {1e3 * g['ttft_s']['p99']:.0f} ms, TPOT mean "
          f"{1e3 * g['tpot_s']['mean']:.1f} ms; engine {e['out_tok_s']:.1f} out tok/s; "
          f"gRPC overhead {100 * entry['grpc_overhead']:.1f}% (means over {len(entry['runs'])} "
          f"pair(s): grpc {entry['grpc_mean_out_tok_s']:.1f}, engine {entry['engine_mean_out_tok_s']:.1f})"
          + (f"; sustained {g['sustained']['served_out_tok_s']:.1f} of {g['sustained']['offered_out_tok_s']:.1f} "
             f"offered out tok/s ({g['sustained']['share']:.3f})" if g.get("sustained") else ""),
          flush=True)


def _run_prefix_cache(args: argparse.Namespace, device: torch.device, result: dict[str, Any]) -> None:
    """W4: the same shared-prefix requests, all at once, with the prefix cache on and then off."""
    from .workloads import shared_prefix_w4

    on_gpu = device.type == "cuda"
    n_req = args.w4_requests or (4 if args.quick else 128 if on_gpu else 16)
    prefix = args.w4_prefix or (32 if args.quick else 2048 if on_gpu else 512)
    w = shared_prefix_w4(n_req, prefix, unique=8 if args.quick else 64, new=4 if args.quick else 64 if on_gpu else 16)
    cfg = engine_config(args, device, [w])
    runs: dict[str, Any] = {}
    for label, enabled in (("cache_on", True), ("cache_off", False)):
        # No workload-shaped warm-up here: it would fill the prefix cache before the timed run.
        figures, _ = asyncio.run(_run_loom(dataclasses.replace(cfg, enable_prefix_caching=enabled), [w]))
        runs[label] = figures["W4"]
    on, off = runs["cache_on"], runs["cache_off"]
    entry = {"description": w.description, **runs,
             "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
             "throughput_ratio": on["out_tok_s"] / off["out_tok_s"],
             "engine_config": dataclasses.asdict(cfg)}
    result["workloads"]["W4"] = entry
    print(f"W4: TTFT p50 {1e3 * on['ttft_p50_s']:.0f} ms with the prefix cache, {1e3 * off['ttft_p50_s']:.0f} ms "
          f"without ({entry['ttft_p50_speedup']:.1f}x); output tok/s {on['out_tok_s']:.1f} vs "
          f"{off['out_tok_s']:.1f}", flush=True)


def _run_structured(args: argparse.Namespace, device: torch.device, result: dict[str, Any]) -> None:
    """S1: grammar compile times (cold, cached), the mask's cost, tok/s with grammars against without."""
    from .structured import run_s1

    requests = args.s1_requests or (8 if args.quick else 64)
    new = args.s1_new_tokens or (16 if args.quick else 128)
    variants = args.s1_variants or (2 if args.quick else 8)
    placeholder = Workload("S1", [([0] * 80, new)] * requests, "")  # sizes the pool for 80-token prompts
    cfg = engine_config(args, device, [placeholder])
    entry = run_s1(cfg, requests, new, variants, args.s1_repeats, shared_prompts=args.s1_shared_prompts)
    entry["engine_config"] = dataclasses.asdict(cfg)
    result["workloads"]["S1"] = entry
    c, t, v = entry["compile"], entry["throughput"], entry["validity"]
    print(f"S1: compile cold p50 {c['cold']['p50_ms']:.2f} ms p99 {c['cold']['p99_ms']:.2f} ms "
          f"(10 optional properties: p50 {c['optional10_cold']['p50_ms']:.2f} ms), cached p50 "
          f"{c['cached']['p50_us']:.1f} us; 64-row mask fill {c['mask_64_rows']['fill_us_median']:.0f} us, apply "
          f"{c['mask_64_rows']['apply_us_median']:.0f} us; out tok/s with grammars "
          f"{t['with_grammar_out_tok_s_mean']:.1f} vs without {t['without_out_tok_s_mean']:.1f} "
          f"(mean of pairs {t['ratio_mean']:.3f}x, median {t['ratio_median']:.3f}x, all pairs' time "
          f"{t['ratio_total']:.3f}x); {v['valid_of_eos']}/{v['ended_by_eos']} outputs ended by EOS are valid",
          flush=True)
def _run_lora(args: argparse.Namespace, device: torch.device, result: dict[str, Any]) -> None:
    """L1: W2 spread round-robin over 8 LoRA adapters of rank 16 and the base model, against W2
    on the base model alone (loom/bench/lora.py). On the CPU (SmolLM2) W2 is shrunk to 16
    requests of 32 new tokens (4 of 8 with --quick): a harness check, not the GPU figure."""
    from .lora import run_l1
    from .workloads import serving_w2

    if device.type == "cuda":
        w2 = gpu_workload("W2", args.model_id, args.quick, args.w2_requests)
    else:
        w2 = serving_w2(args.w2_requests or (4 if args.quick else 16), new=8 if args.quick else 32)
    cfg = engine_config(args, device, [w2])
    entry = run_l1(cfg, w2)
    result["workloads"]["L1"] = entry
    print(f"L1: {entry['adapters']['out_tok_s']:.1f} out tok/s over 8 adapters and the base, "
          f"{entry['base_alone']['out_tok_s']:.1f} on the base alone: {entry['ratio']:.3f}x (target >= 0.8x)",
          flush=True)


def _run_speculation(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """C3 (CPU) / W5 (a) (with --device cuda --dtype bfloat16): the same copy-heavy requests
    with and without --speculate, batch 1 and all at once (loom/bench/speculation.py)."""
    from loom.worker.worker import resolve_device

    from .speculation import run_c3

    device = resolve_device(args.device)
    if device.type == "cuda":
        result["machine"].update(software_info(device))
    base = EngineConfig(model_id=args.model_id, device=str(device), dtype=args.dtype, quantize=args.quantize,
                        max_total_tokens=1024, max_batch_total_tokens=16 * 1024 if device.type == "cpu" else None,
                        num_threads=args.threads if device.type == "cpu" else None)
    k = args.speculate or 4
    entry = run_c3(base, k, quick=args.quick)
    result["workloads"]["C3"] = entry
    for batch in (1, 16):
        e = entry[f"batch_{batch}"]
        spec = e["speculate"]
        print(f"C3 batch {batch}: plain {e['plain']['out_tok_s']:.1f} out tok/s, --speculate {k} "
              f"{spec['out_tok_s']:.1f} ({e['speedup']:.2f}x), acceptance {spec.get('acceptance', 0):.2f}, "
              f"{spec.get('tokens_per_verification', 0):.2f} tokens per verifying step, "
              f"identical outputs: {e['identical_outputs']}", file=sys.stderr)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} takes comma-separated integers >= 1, got {text!r}")
    return values


def _run_draft_speculation(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """W5 b and c: W1's request with a draft model for k = 2..6 against none, the verification
    cost curve, and the cost model's prediction for each run (loom/bench/speculation_cost.py)."""
    from loom.worker.worker import resolve_device

    from .speculation_cost import run_w5

    options = tuple(args.speculator_option)
    if not any(key == "model_id" for key, _ in options):
        raise ConfigError("W5 needs the draft model: --speculator-option model_id=... (e.g. random:llama-8b "
                          "with --speculator-option quantize=gptq, its int4 copy)")
    device = resolve_device(args.device)
    if device.type == "cuda":
        result["machine"].update(software_info(device))
    base = EngineConfig(model_id=args.model_id, device=str(device), dtype=args.dtype, quantize=args.quantize,
                        max_total_tokens=args.max_total_tokens, cuda_graphs=(1, 2, 4, 8, 16, 32, 64),
                        max_batch_total_tokens=args.max_batch_total_tokens or (16 * 1024 if device.type == "cpu"
                                                                                else None),
                        num_threads=args.threads if device.type == "cpu" else None)
    if args.cuda_memory_fraction is not None:  # leave room for the draft model and its pool
        base = dataclasses.replace(base, cuda_memory_fraction=args.cuda_memory_fraction)
    entry = run_w5(base, options, ks=_int_list(args.w5_ks, "--w5-ks"),
                   cost_batches=_int_list(args.w5_cost_batches, "--w5-cost-batches"), quick=args.quick)
    result["workloads"]["W5"] = entry
    for key, run in entry["runs"].items():
        print(f"W5 b {key}: {run['out_tok_s']:.1f} out tok/s against {run['plain_out_tok_s']:.1f} "
              f"({run['speedup']:.2f}x; the cost model predicts {run['predicted_speedup']:.2f}x, engine efficiency "
              f"{run['engine_efficiency']:.2f}); acceptance {run['acceptance']:.2f}, by position "
              f"{[round(a, 2) for a in run['acceptance_at']]}", file=sys.stderr)
        t = run["time"]
        print(f"  time: {t['verifying_steps']} verifying steps {t['verifying_s'] * 1e3:.0f} ms (draft "
              f"{t['draft_s'] * 1e3:.0f} ms, of which {t['draft_graph_steps']} graphed steps "
              f"{t['draft_graph_s'] * 1e3:.0f} ms, catch-ups among them [tokens, ms] "
              f"{t['draft_graph_catch_ups_tokens_ms']}; eager [tokens, ms] {t['draft_eager_steps_tokens_ms']}), "
              f"{t['after_verifying_steps']} after them {t['after_verifying_s'] * 1e3:.0f} ms, "
              f"{t['overlapped_steps']} overlapped {t['overlapped_s'] * 1e3:.0f} ms, "
              f"{t['other_sync_steps']} other synchronous {t['other_sync_s'] * 1e3:.0f} ms", file=sys.stderr)
    print(f"W5 b: best k {entry['best_k']} ({entry['best_speedup']:.2f}x); draft decode step "
          f"{entry['draft_decode_step_s'] * 1e3:.2f} ms", file=sys.stderr)
    for name, row in entry["cost_curve_relative"].items():
        print(f"W5 c {name}: step time for 1 + k rows against a decode step: "
              f"{', '.join(f'{key}={v:.2f}' for key, v in row.items())}", file=sys.stderr)


def run_bench(args: argparse.Namespace) -> int:
    from loom.worker.worker import resolve_device

    torch.set_num_threads(args.threads)
    names = [n.strip().upper() for n in args.workloads.split(",") if n.strip()]
    known = (CPU_WORKLOADS + MODEL_WORKLOADS + SERVING_WORKLOADS + PREFIX_WORKLOADS + SPECULATION_WORKLOADS
             + STRUCTURED_WORKLOADS + LORA_WORKLOADS)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"loom bench: unknown workload(s) {', '.join(unknown)}; choose from {', '.join(known)}",
              file=sys.stderr)
        return 2
    if args.peer_w2_timeout_s is not None and not args.peer_w2_timeout_s > 0:
        print(f"loom bench: --peer-w2-timeout-s takes seconds > 0, got {args.peer_w2_timeout_s:g}", file=sys.stderr)
        return 2
    if args.peer_static_batches not in (None, "none"):
        try:  # refused here, not after Loom's own runs
            _int_list(args.peer_static_batches, "--peer-static-batches")
        except ConfigError as exc:
            print(f"loom bench: {exc}", file=sys.stderr)
            return 2
    result: dict[str, Any] = {
        "command": "loom bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "loom_version": __version__,
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": str(args.model_id or "SmolLM2-135M-Instruct (embedded GGUF, fp32)"),
        "threads": args.threads,
        "quick": args.quick,
        "workloads": {},
    }
    cpu_names = [n for n in names if n in CPU_WORKLOADS]
    model_names = [n for n in names if n in MODEL_WORKLOADS]
    try:
        if cpu_names:
            _run_cpu_workloads(args, cpu_names, result)
        if model_names or "W3" in names or "W4" in names or "S1" in names or "L1" in names:
            device = resolve_device(args.device)
            result["machine"].update(software_info(device))
            if model_names:
                _run_model_workloads(args, model_names, device, result)
            if "W3" in names:
                _run_serving(args, device, result)
            if "W4" in names:
                _run_prefix_cache(args, device, result)
            if "S1" in names:
                _run_structured(args, device, result)
            if "L1" in names:
                _run_lora(args, device, result)
        if "C3" in names:
            _run_speculation(args, result)
        if "W5" in names:
            _run_draft_speculation(args, result)
    except ConfigError as exc:
        print(f"loom bench: {exc}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return 0
