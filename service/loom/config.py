"""Engine configuration: one frozen dataclass, validated in one place.

Flag names follow TGI's launcher where the concept is the same; every flag can also be set by a
``LOOM_<FLAG>`` environment variable (see :mod:`loom.cli`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# --kv-cache-dtype values: auto keeps the model's dtype; fp8 is e4m3 (loom/layers/kv_fp8.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# A LoRA adapter's name (its adapter_id on requests): what a metric label and a log field can hold.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ConfigError(ValueError):
    """A configuration a user must change; the message names the flag."""


@dataclass(frozen=True)
class EngineConfig:
    model_id: str | None = None  # HF model dir or .gguf file; None = the embedded SmolLM2 default
    dtype: str = "auto"  # auto: fp32 on CPU, the checkpoint's bf16/fp16 on GPU
    device: str = "auto"  # auto: cuda if available else cpu
    attention_backend: str | None = None  # None: the available backend of highest priority
    # auto: a quantizer whose format the checkpoint carries, where it can run (a GGUF file's
    # blocks on the CPU); none: dense weights; or a quantizer plugin's name
    quantize: str = "auto"
    block_size: int = 16
    # The KV pool's element type (TGI's --kv-cache-dtype): auto keeps the model's dtype; fp8
    # (= fp8_e4m3) stores e4m3 codes with a scale per token and head (loom/layers/kv_fp8.py).
    kv_cache_dtype: str = "auto"
    # KV pool size in tokens; None: sized from memory (GPU) or from the limits (CPU, see below).
    max_batch_total_tokens: int | None = None
    max_input_tokens: int | None = None  # None: max_total_tokens - 1
    max_total_tokens: int | None = None  # None: min(model's max positions, 4096)
    max_batch_prefill_tokens: int = 4096
    # A target for steps that carry decodes (engine/step_latency.py): they prefill only as many
    # prompt tokens as a model of step time fitted online allows. None: no target.
    max_step_latency_ms: float | None = None
    max_batch_size: int | None = None  # running sequences at once; None: unbounded (KV bounds it)
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    enable_prefix_caching: bool = True  # --prefix-caching / LOOM_PREFIX_CACHING
    enable_chunked_prefill: bool = True  # --prefill-chunking / LOOM_PREFILL_CHUNKING
    max_queue_age_s: float = 60.0  # older requests outrank every priority (no starvation)
    # decode batch sizes captured as CUDA graphs (TGI's --cuda-graphs); empty disables
    # Up to 512: past 256 sequences an eager llama-1b step is bound by host Python (launches).
    cuda_graphs: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512)
    # Prepare step N+1 on the host while the device runs step N ("auto": on CUDA only; on the
    # CPU the forward runs on the host anyway, so it would only delay outputs by a step).
    async_scheduling: str = "auto"  # auto | on | off
    # The CPU pool when max_batch_total_tokens is unset (loom/engine/kv_pool_sizing.py): this many
    # sequences of max_total_tokens (fewer with a smaller max_batch_size), within this share of
    # the memory available at start, and never less than one sequence of max_total_tokens.
    cpu_kv_cache_sequences: int = 4
    cpu_kv_memory_fraction: float = 0.25
    cuda_memory_fraction: float = 0.9
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    warmup: bool = True  # run one request through every path before serving (sizes the GPU pool)
    fault_injection: bool = False  # tests only: requests named inject-fault*/inject-nan* fail on purpose
    # Seeds the engine's draws of seeds for sampled requests that bring none (each request's
    # seed is reported back); None: from the operating system, different at every start.
    seed: int | None = None
    # Structured output (loom.structured): a constrained request whose grammar has not compiled
    # this many seconds after it arrived is refused (INVALID_ARGUMENT); compiled grammars are
    # cached up to this many MiB.
    grammar_compile_timeout: float = 10.0
    grammar_cache_mib: int = 256
    # auto | on | off: the grammar matchers in a process of their own (loom.structured.grammar_process),
    # which fills a step's token masks while the engine finishes the step before; auto: with
    # asynchronous scheduling on one shard.
    grammar_process: str = "auto"
    # With a grammar process: this many of them, each holding a share of the constrained
    # sequences and filling its rows of a step side by side with the others
    # (loom.structured.grammar_group); 1: one process.
    grammar_processes: int = 1
    # Speculative decoding (loom/spec/): up to this many draft tokens per sequence and step
    # (TGI's --speculate); 0 is off. The proposer is a speculative-decoder plugin by name.
    speculate: int = 0
    speculator: str = "ngram"
    speculator_options: tuple[tuple[str, str], ...] = ()  # --speculator-option KEY=VALUE
    # Above this many running sequences the engine decodes without drafts: a step of that many
    # rows is compute-bound, so the extra verification rows cost more than the accepted tokens
    # save (docs/speculative.md).
    speculate_max_batch_size: int = 32
    # Tensor parallelism (docs/scaling.md): the model's layers split over this many ranks, one
    # process each (the engine's own worker is rank 0); gloo on the CPU, NCCL on GPUs (one per rank).
    num_shard: int = 1
    # A sharded step every rank has not finished after this many seconds ends the server, naming
    # the ranks behind (a hung rank); start-up (loading, warm-up) gets shard_start_timeout.
    shard_step_timeout: float = 120.0
    shard_start_timeout: float = 900.0
    # LoRA adapters (loom/lora/): loaded at start (--lora-adapters NAME=DIR,...); at most
    # max_loras resident at once (None: 4, or as many as given at start if more; 0 turns LoRA
    # off), each of rank at most max_lora_rank (the slot tables are sized by both).
    lora_adapters: tuple[tuple[str, str], ...] = ()
    max_loras: int | None = None
    max_lora_rank: int = 16

    @property
    def num_lora_slots(self) -> int:
        """Adapters resident at once (the device's slot tables, slot 0 the base model aside)."""
        if self.max_loras is not None:
            return self.max_loras
        return max(4, len(self.lora_adapters)) if self.lora_adapters else 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.max_batch_prefill_tokens <= 0:
            raise ConfigError("--max-batch-prefill-tokens must be positive")
        if not self.waiting_served_ratio >= 0.0:
            raise ConfigError("--waiting-served-ratio must be >= 0")
        if self.max_waiting_tokens < 0:
            raise ConfigError("--max-waiting-tokens must be >= 0")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(f"--dtype must be one of auto, float32, float16, bfloat16; got {self.dtype!r}")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError(f"--async-scheduling must be auto, on or off; got {self.async_scheduling!r}")
        if not 0 <= self.speculate <= 16:
            raise ConfigError(f"--speculate must be between 0 (off) and 16 draft tokens, got {self.speculate}")
        if self.speculate_max_batch_size < 1:
            raise ConfigError("--speculate-max-batch-size must be >= 1")
        if any(b <= 0 for b in self.cuda_graphs):
            raise ConfigError("--cuda-graphs sizes must be positive (use 0 alone to disable)")
        if self.max_batch_size is not None and self.max_batch_size <= 0:
            raise ConfigError("--max-batch-size must be positive")
        if not 0.0 < self.cuda_memory_fraction <= 1.0:
            raise ConfigError("--cuda-memory-fraction must be in (0, 1]")
        # Unset is None; 0 is not a way to say "unset" (it was once silently taken as one).
        for flag, value in (("--max-total-tokens", self.max_total_tokens),
                            ("--max-input-tokens", self.max_input_tokens),
                            ("--max-batch-total-tokens", self.max_batch_total_tokens),
                            ("--num-threads", self.num_threads)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be at least 1 (leave it unset for the default), got {value}")
        if (self.max_input_tokens is not None and self.max_total_tokens is not None
                and self.max_input_tokens >= self.max_total_tokens):
            raise ConfigError(f"--max-input-tokens ({self.max_input_tokens}) must be below --max-total-tokens "
                              f"({self.max_total_tokens}): a request needs room for at least one new token")
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if not self.quantize.strip():
            raise ConfigError("--quantize must be auto, none or a quantizer plugin's name; got an empty value")
        if self.attention_backend is not None and not self.attention_backend.strip():
            raise ConfigError("--attention-backend must be an attention plugin's name; got an empty value")
        if not (self.grammar_compile_timeout > 0 and self.grammar_compile_timeout < float("inf")):
            raise ConfigError(f"--grammar-compile-timeout must be a positive number of seconds, got "
                              f"{self.grammar_compile_timeout}")
        if self.grammar_cache_mib < 0:
            raise ConfigError(f"--grammar-cache-mib must be at least 0, got {self.grammar_cache_mib}")
        if self.grammar_process not in ("auto", "on", "off"):
            raise ConfigError(f"--grammar-process must be auto, on or off; got {self.grammar_process!r}")
        if not 1 <= self.grammar_processes <= 16:
            raise ConfigError(f"--grammar-processes must be 1 to 16, got {self.grammar_processes}")
        self._check_lora()
        if self.max_step_latency_ms is not None and not 0 < self.max_step_latency_ms < float("inf"):
            raise ConfigError(f"--max-step-latency-ms must be a positive number of milliseconds, got "
                              f"{self.max_step_latency_ms}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if not 1 <= self.num_shard <= 64:
            raise ConfigError(f"--num-shard must be between 1 and 64, got {self.num_shard}")
        if self.num_shard > 1 and self.num_lora_slots:
            raise ConfigError(f"LoRA adapters (--lora-adapters, --max-loras) are not served with --num-shard "
                              f"{self.num_shard} yet: use one shard, or no adapters")
        for flag, seconds in (("--shard-step-timeout", self.shard_step_timeout),
                              ("--shard-start-timeout", self.shard_start_timeout)):
            if not 0 < seconds < float("inf"):
                raise ConfigError(f"{flag} must be a positive number of seconds, got {seconds}")
        if self.cpu_kv_cache_sequences < 1:
            raise ConfigError("cpu_kv_cache_sequences must be at least 1")
        if not 0.0 < self.cpu_kv_memory_fraction <= 1.0:
            raise ConfigError("cpu_kv_memory_fraction must be in (0, 1]")

    def _check_lora(self) -> None:
        if self.max_loras is not None and not 0 <= self.max_loras <= 256:
            raise ConfigError(f"--max-loras must be between 0 (LoRA off) and 256, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ConfigError(f"--max-lora-rank must be between 1 and 512, got {self.max_lora_rank}")
        names = [name for name, _ in self.lora_adapters]
        for name, path in self.lora_adapters:
            if not ADAPTER_NAME.fullmatch(name):
                raise ConfigError(f"--lora-adapters: {name!r} is not an adapter name (letters, digits, '.', '_', "
                                  "'-', at most 128, starting with a letter or digit)")
            if not path:
                raise ConfigError(f"--lora-adapters: {name}= names no directory (NAME=DIR)")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"--lora-adapters: {', '.join(dupes)} given more than once")
        if len(names) > self.num_lora_slots:
            raise ConfigError(f"--lora-adapters gives {len(names)} adapters, more than --max-loras "
                              f"{self.num_lora_slots}")
