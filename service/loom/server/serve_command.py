"""``loom serve``: flags (TGI's names where the concept is the same) -> ServerSettings -> server."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from loom.cli import add_env_argument, env_name, parse_key_value

# (flag, type, help); the default of each comes from EngineConfig / ServerSettings.
_ENGINE_FLAGS: list[tuple[str, Any, str]] = [
    ("--model-id", str, "Hugging Face model directory or .gguf file; unset: the embedded SmolLM2-135M-Instruct"),
    ("--dtype", str, "auto, float32, float16 or bfloat16"),
    ("--device", str, "auto, cpu, cuda or cuda:N"),
    ("--attention-backend", str, "attention plugin name; unset: the best available one"),
    ("--quantize", str, "auto (the checkpoint's own format where a kernel runs it), none, or a quantizer plugin"),
    ("--block-size", int, "tokens per KV-cache block"),
    ("--kv-cache-dtype", str, "auto (the model's dtype) or fp8 (e4m3 with a scale per token and head: ~1.9x the tokens)"),
    ("--max-input-tokens", int, "most prompt tokens of a request; unset: max-total-tokens - 1"),
    ("--max-total-tokens", int, "most prompt + generated tokens of a request; unset: min(model positions, 4096)"),
    ("--max-batch-prefill-tokens", int, "most prompt tokens processed in one engine step"),
    ("--max-step-latency-ms", float,
     "target for steps with decodes: they prefill only what a fitted model of step time allows; unset: none"),
    ("--max-batch-total-tokens", int, "KV-cache size in tokens; unset: sized from memory"),
    ("--max-batch-size", int, "most sequences running at once; unset: bounded by the KV cache"),
    ("--waiting-served-ratio", float, "admit new prefills when waiting >= ratio x running"),
    ("--max-waiting-tokens", int, "decode steps before waiting requests are forced in"),
    ("--cuda-memory-fraction", float, "share of free GPU memory the KV cache may take"),
    ("--num-threads", int, "torch intra-op threads on CPU; unset: torch's default"),
    ("--seed", int, "seeds the seeds drawn for sampled requests that give none; unset: random at each start"),
    ("--grammar-compile-timeout", float,
     "seconds a constrained request's grammar may take to compile; then it fails with INVALID_ARGUMENT"),
    ("--grammar-cache-mib", int, "compiled grammars kept for reuse, in MiB (least recently used dropped first)"),
    ("--grammar-process", str, "auto, on or off: grammar matchers in a process of their own, filling token masks "
     "while the engine finishes the step before (auto: with asynchronous scheduling on one shard)"),
    ("--grammar-processes", int, "with a grammar process: this many, each filling the token masks of its share "
     "of the constrained requests side by side with the others"),
    ("--speculate", int, "speculative decoding: up to N draft tokens per sequence and step; 0 is off"),
    ("--speculator", str, "the speculative-decoder plugin that proposes drafts (loom plugins lists them)"),
    ("--speculate-max-batch-size", int, "above this many running sequences, decode without drafts"),
    ("--num-shard", int, "tensor parallelism: split the model over N ranks (one GPU each; gloo ranks on CPU)"),
    ("--shard-step-timeout", float, "seconds a sharded step may take before the server ends, naming the hung rank"),
    ("--shard-start-timeout", float, "seconds the ranks may take to load and warm up before the server ends"),
    ("--max-loras", int, "LoRA adapters loaded at once (slots on the device); unset: 4 (or as many as "
                         "--lora-adapters gives) when --lora-adapters is set, else 0: LoRA off"),
    ("--max-lora-rank", int, "highest rank of a LoRA adapter (sizes each slot)"),
]
_SERVER_FLAGS: list[tuple[str, Any, str]] = [
    ("--host", str, "address to listen on"),
    ("--port", int, "port to listen on"),
    ("--max-concurrent-requests", int, "generation requests in the engine at once; more wait in the queue"),
    ("--max-queue", int, "requests waiting for a slot; more get RESOURCE_EXHAUSTED (0: no queue)"),
    ("--max-stop-sequences", int, "most stop_sequences per request"),
    ("--max-top-n-tokens", int, "most top_n_tokens per request"),
    ("--max-best-of", int, "most best_of (and n) per request"),
    ("--default-max-new-tokens", int, "max_new_tokens of a request that leaves it unset (never above its budget)"),
    ("--graceful-termination-timeout", float, "seconds in-flight requests get to finish on SIGTERM"),
    ("--log-level", str, "DEBUG, INFO, WARNING or ERROR"),
]
_SECURITY_FLAGS: list[tuple[str, Any, str]] = [
    ("--tls-cert", str, "server certificate chain (PEM); with --tls-key the port speaks TLS only"),
    ("--tls-key", str, "private key of --tls-cert (PEM)"),
    ("--tls-client-ca", str, "CA bundle (PEM) client certificates must chain to: mutual TLS"),
    ("--max-request-bytes", int, "largest request message accepted; larger get RESOURCE_EXHAUSTED"),
    ("--max-input-chars", int, "most characters of text or chat input per request"),
]
_OBSERVABILITY_FLAGS: list[tuple[str, Any, str]] = [
    ("--prometheus-port", int, "port of the Prometheus /metrics endpoint (plain HTTP on --host); 0 disables it"),
    ("--otlp-endpoint", str, "OTLP/gRPC collector for traces, e.g. http://localhost:4317; unset: no tracing"),
    ("--otlp-service-name", str, "service.name of the exported traces"),
]


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_serve_command(subparsers: Any) -> None:
    from loom.config import EngineConfig

    from .settings import ServerSettings

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="serve a model over gRPC", description="Serve a model over gRPC (loom.v1.GenerationService).")
    engine_defaults, server_defaults = EngineConfig(), ServerSettings()
    group = parser.add_argument_group("model and engine")
    for flag, type_, help_ in _ENGINE_FLAGS:
        add_env_argument(group, flag, type=type_, default=getattr(engine_defaults, _dest(flag)), help=help_)
    group = parser.add_argument_group("server")
    for flag, type_, help_ in _SERVER_FLAGS:
        add_env_argument(group, flag, type=type_, default=getattr(server_defaults, _dest(flag)), help=help_)
    add_env_argument(group, "--json-output", flag_is_switch=True, default=False,
                     help="log JSON lines instead of text")
    add_env_argument(group, "--warmup", flag_is_switch=True, default=True,
                     help="run one short generation before reporting SERVING")
    add_env_argument(group, "--fault-injection", flag_is_switch=True, default=False,
                     help="TESTS ONLY: requests whose id starts with inject-fault / inject-nan fail on purpose")
    group = parser.add_argument_group("security and limits")
    # Not add_env_argument: its help text would show the key whenever LOOM_API_KEY is set.
    group.add_argument("--api-key", default=os.environ.get(env_name("--api-key")) or None,
                       help="require 'authorization: Bearer <KEY>' metadata on every RPC but health "
                            f"(prefer the environment: command lines are visible to other users) [env {env_name('--api-key')}]")
    for flag, type_, help_ in _SECURITY_FLAGS:
        add_env_argument(group, flag, type=type_, default=getattr(server_defaults, _dest(flag)), help=help_)
    group = parser.add_argument_group("observability")
    for flag, type_, help_ in _OBSERVABILITY_FLAGS:
        add_env_argument(group, flag, type=type_, default=getattr(server_defaults, _dest(flag)), help=help_)
    group = parser.add_argument_group("scheduling")
    add_env_argument(group, "--prefix-caching", flag_is_switch=True, default=True,
                     help="reuse the KV blocks of prompts that share a prefix")
    add_env_argument(group, "--prefill-chunking", flag_is_switch=True, default=True,
                     help="split long prompts so prefill chunks and decodes share each step")
    add_env_argument(group, "--cuda-graphs", type=_parse_sizes, default=engine_defaults.cuda_graphs,
                     help="decode batch sizes captured as CUDA graphs, e.g. 1,2,4,8; 0 disables")
    add_env_argument(group, "--async-scheduling", type=str,
                     default=engine_defaults.async_scheduling,
                     help="auto, on or off: prepare the next step while the device runs this one (auto: on CUDA)")
    add_env_argument(group, "--lora-adapters", type=_parse_adapters, default=(),
                     help="LoRA adapters loaded at start: NAME=DIR,NAME=DIR (PEFT directories); requests "
                          "name them in adapter_id (docs/lora.md)")
    group.add_argument("--speculator-option", type=parse_key_value, action="append", default=[],
                       help="KEY=VALUE for the speculator plugin (repeatable), e.g. max_n=3 for ngram")
    parser.set_defaults(func=run_serve)


def _parse_adapters(text: str) -> tuple[tuple[str, str], ...]:
    """``NAME=DIR,NAME=DIR`` -> ((NAME, DIR), ...); names are checked by EngineConfig."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {item!r}")
        out.append((name.strip(), path.strip()))
    return tuple(out)


def _parse_sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    return () if sizes in ((), (0,)) else sizes


def settings_from_args(args: argparse.Namespace) -> Any:
    from loom.config import EngineConfig

    from .settings import ServerSettings

    engine = EngineConfig(**{_dest(f): getattr(args, _dest(f)) for f, _, _ in _ENGINE_FLAGS},
                          enable_prefix_caching=args.prefix_caching,
                          enable_chunked_prefill=args.prefill_chunking,
                          cuda_graphs=tuple(args.cuda_graphs),
                          async_scheduling=args.async_scheduling,
                          speculator_options=tuple(args.speculator_option or ()),
                          lora_adapters=tuple(args.lora_adapters or ()),
                          fault_injection=args.fault_injection)
    server = {_dest(f): getattr(args, _dest(f))
              for f, _, _ in (*_SERVER_FLAGS, *_SECURITY_FLAGS, *_OBSERVABILITY_FLAGS)}
    return ServerSettings(engine=engine, json_output=args.json_output, warmup=args.warmup, api_key=args.api_key,
                          **server)


def run_serve(args: argparse.Namespace) -> int:
    from loom.config import ConfigError
    from loom.preflight import check_engine_config

    try:
        settings = settings_from_args(args)
        check_engine_config(settings.engine)  # before anything loads: one line, exit 2
    except ConfigError as exc:
        print(f"loom serve: {exc}", file=sys.stderr)
        return 2
    from .app import serve

    return serve(settings)
