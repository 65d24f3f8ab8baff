"""The engine core: requests, scheduling, the step loop, output processing, failure isolation.

``LLMEngine`` is synchronous and single-threaded: ``add_request`` / ``abort`` / ``step``. A step
goes one way: the scheduler picks the sequences and their tokens, the planner turns them into a
picklable step plan, the worker (device, model, KV pool, runner, CUDA graphs) runs it and returns
the sampled tokens, and the output processor applies them to the sequences and checks stops.
The server never calls the engine directly; :mod:`loom.engine.core_process` runs it in its own
process so the step loop never shares an interpreter lock with request handling.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TextIO

import structlog
import torch

from loom import kernel_switches
from loom.config import ConfigError, EngineConfig
from loom.distributed.errors import ShardLostError
from loom.distributed.parallel_state import tensor_parallel_as
from loom.plugin_api import DraftRequest, PluginRegistry, Proposer, ProposerContext, default_registry
from loom.spec.speculator import Speculator
from loom.worker.model_runner import ForwardedStep, LaunchedStep, ModelRunner, StagedForward
from loom.worker.sharded_worker import ShardedWorker
from loom.worker.worker import Worker

from .block_manager import BlockManager
from .kv_pool_sizing import KvPoolSize, available_memory_bytes, size_cpu_kv_pool
from .output_processor import OutputProcessor
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import PENDING_TOKEN, Sequence, SequenceStatus
from .step_latency import StepLatencyModel
from .step_planner import PlannedStep, plan_step
from .types import (
    AdapterCommand,
    AdapterReply,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    Rejection,
    SamplingParams,
    StoppingParams,
)

if TYPE_CHECKING:
    from loom.lora.manager import AdapterManager
    from loom.structured.driver import StructuredOutput
    from loom.structured.grammar_group import GrammarProcessGroup
    from loom.structured.grammar_process import GrammarProcess

log = structlog.get_logger(__name__)


def _needs_host_tokens(seq: Sequence) -> bool:
    """Penalties read the output so far and prompt logprobs are read back at once: such a
    sequence's next step cannot be prepared while its last token is still on the device. (A
    grammar's matcher also needs the last token, but only before the sampling: see _sample.)"""
    sp = seq.sampling
    return (sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
            or (sp.prompt_logprobs and not seq.prompt_logprobs_sent))


class RequestRejected(ValueError):
    """A request refused before it is queued, for its own sake (an adapter_id not loaded)."""

    def __init__(self, message: str, rejection: Rejection) -> None:
        super().__init__(message)
        self.rejection = rejection


class _RepeatLastToken(Proposer):
    """Warm-up drafts: the last token, as many times as allowed."""

    @classmethod
    def check_options(cls, options: dict[str, str]) -> None:
        """It runs with the real proposer's context, whatever options that one takes."""

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        return [[r.token_ids[-1]] * r.max_drafts for r in requests]


@dataclass
class _Launched:
    sched: SchedulerOutput
    planned: PlannedStep
    step: LaunchedStep | ForwardedStep  # ForwardedStep: its grammar rows and sampling are still due
    positions: list[int]  # where each sampled sequence's first new token goes in its token_ids
    guesses: list[list[int]] | None = None  # each sampled sequence's drafts, for its grammar rows
    # requests failed when its sampling was queued at the next step's launch (returned with its outputs)
    early: list[EngineOutput] = field(default_factory=list)
    # its sampling was queued before its grammar rows were written (the device waits for them):
    # the grammar process's reply is read before its tokens are (LOOM_GRAMMAR_DEVICE_WAIT)
    awaiting_rows: bool = False


class LLMEngine:
    def __init__(self, config: EngineConfig, registry: PluginRegistry | None = None, *,
                 on_shard_failure: Callable[[str], None] | None = None) -> None:
        """``on_shard_failure``: with ``num_shard`` > 1, called (from a watchdog thread) with a
        message naming the rank when one dies or hangs; the default exits the process."""
        self.config = config
        started = time.monotonic()
        try:
            kernel_switches.check_environment()  # loom serve checked it already (loom.preflight)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        registry = registry or default_registry()
        self.worker: Worker | ShardedWorker
        if config.num_shard > 1:
            self.worker = ShardedWorker(config, registry, on_failure=on_shard_failure)
        else:
            self.worker = Worker(config, registry)
        try:
            self._start(config, registry, started)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and the grammar process, if any. Idempotent."""
        if isinstance(self.worker, ShardedWorker):
            self.worker.close()
        structured = getattr(self, "_structured", None)  # (None too when the engine failed to start)
        if structured is not None:
            structured.close()

    def _start(self, config: EngineConfig, registry: PluginRegistry, started: float) -> None:
        """Size the pool, warm up, capture graphs: everything after the worker loaded the model."""
        model = self.worker.info
        self.adapters: AdapterManager | None = self._load_startup_adapters()
        self.eos_token_ids = model.eos_token_ids
        self.vocab_size = model.vocab_size
        self.requests: dict[str, list[Sequence]] = {}
        # Structured output, made on the first constrained request (see _structured_output).
        self._structured: StructuredOutput | GrammarProcess | GrammarProcessGroup | None = None
        self._rng = random.Random(config.seed)  # None: seeded from the OS
        self.num_steps = 0
        self._inflight: _Launched | None = None  # a launched step whose results are not read yet
        # --max-step-latency-ms: step times observed as (launch time, decode rows, prefill tokens)
        # of the last launch, fitted into the prefill budget of steps with decodes
        self.step_latency = (StepLatencyModel(config.max_step_latency_ms / 1000, config.max_batch_prefill_tokens,
                                              min_tokens=config.block_size)
                             if config.max_step_latency_ms is not None else None)
        self._last_launch: tuple[float, int, int] | None = None
        trace = os.environ.get("LOOM_STEP_TRACE")  # a JSON line per step (see _trace_step)
        self._trace: TextIO | None = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115
        self.num_async_steps = 0  # steps left in flight while the next one was prepared
        self._async = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.device.type == "cuda")
        bs = config.block_size
        self.max_model_len = config.max_total_tokens or min(model.max_position_embeddings, 4096)
        if self.max_model_len > model.max_position_embeddings:
            raise ConfigError(
                f"--max-total-tokens {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({model.max_position_embeddings})"
            )
        self.speculator: Speculator | None = None  # made once the pool is sized, after the warm-up
        self.kv_pool: KvPoolSize | None = None  # the CPU pool's size and why (None on the GPU)
        if self.device.type == "cpu":
            self.kv_pool = self._size_pool_on_cpu()
            num_blocks = self.kv_pool.blocks
        elif config.max_batch_total_tokens:
            num_blocks = max(1, config.max_batch_total_tokens // bs)
        else:
            num_blocks = self._size_pool_on_gpu()
        if not config.max_total_tokens:
            self.max_model_len = min(self.max_model_len, num_blocks * bs)
        if self.max_model_len > num_blocks * bs:
            raise ConfigError(
                f"--max-total-tokens {self.max_model_len} does not fit the KV pool of {num_blocks * bs} tokens; "
                "lower --max-total-tokens, or raise --max-batch-total-tokens "
                "(on GPU: raise --cuda-memory-fraction or lower --max-batch-prefill-tokens)"
            )
        self._build(num_blocks)
        if config.warmup:
            self.warmup(self._warmup_tokens())
            self._warmup_kernel_variants()
            self._build(num_blocks)  # a clean pool: no warm-up blocks in the prefix cache
        if config.speculate:
            self.speculator = self._make_speculator(registry)
            if config.warmup:
                self._warmup_speculation()
        # Graphs point at this pool: captured last, after any rebuild. Every step shape the engine
        # makes whose sequences all have one query length: 1 (decode) today; a proposer of k
        # drafts adds k + 1.
        self.worker.capture_cuda_graphs(self.max_model_len, self.graph_query_lens)
        pool_tokens = num_blocks * bs
        self.info = EngineInfo(
            model_id=config.model_id or "SmolLM2-135M-Instruct (embedded default)",
            architecture=model.hf_architecture,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            attention_backend=model.attention_backend,
            block_size=bs,
            num_blocks=num_blocks,
            max_batch_total_tokens=pool_tokens,
            max_model_len=self.max_model_len,
            vocab_size=model.vocab_size,
            eos_token_ids=self.eos_token_ids,
            plugins=model.plugins + self._lora_plugin_entry(),
            adapters=self.adapters.infos() if self.adapters is not None else (),
            max_loras=config.num_lora_slots,
            max_lora_rank=config.max_lora_rank if config.num_lora_slots else 0,
            num_shard=config.num_shard,
        )
        if isinstance(self.worker, ShardedWorker):
            self.worker.mark_serving()
        log.info("engine ready", num_shard=config.num_shard, model_dir=str(model.model_dir),
                 architecture=model.hf_architecture,
                 model=model.architecture, dtype=self.info.dtype, device=self.info.device,
                 attention_backend=model.attention_backend,
                 kv_blocks=num_blocks, block_size=bs, max_batch_total_tokens=pool_tokens,
                 max_total_tokens=self.max_model_len, duration_s=round(time.monotonic() - started, 1))

    # -- what the worker holds ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.worker.device

    @property
    def dtype(self) -> torch.dtype:
        return self.worker.dtype

    @property
    def runner(self) -> ModelRunner:
        runner = self.worker.runner
        assert runner is not None, "the worker has no KV pool yet"
        return runner

    @property
    def graph_query_lens(self) -> tuple[int, ...]:
        """The query lengths of the uniform steps this engine makes (CUDA graphs are captured for
        them): decode, and with speculation k + 1 (drafts are padded to k on CUDA)."""
        if self.speculator is not None and self.speculator.pad_to_k:
            return (1, self.speculator.k + 1)
        return (1,)

    def _make_speculator(self, registry: PluginRegistry) -> Speculator:
        config = self.config
        proposer_cls = registry.speculative_decoder(config.speculator).load()
        context = ProposerContext(num_speculative_tokens=config.speculate, vocab_size=self.vocab_size,
                                  device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                                  options=dict(config.speculator_options), max_model_len=self.max_model_len,
                                  max_batch_size=config.speculate_max_batch_size)
        try:
            # A proposer's own model (a draft) runs whole in the engine process, next to rank 0:
            # built as one rank of one, its layers never wait for the other ranks.
            with tensor_parallel_as(0, 1):
                proposer = proposer_cls(context)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"--speculator {config.speculator}: {exc}") from exc
        if self._async:
            log.info("asynchronous scheduling is off in steps where a sequence is due to propose drafts "
                     "(batches up to --speculate-max-batch-size): drafts are proposed from tokens on the host",
                     speculate_max_batch_size=config.speculate_max_batch_size)
        return Speculator(proposer, config.speculate, config.speculate_max_batch_size, self.vocab_size,
                          self.max_model_len, pad_to_k=self.device.type == "cuda")

    def _build(self, num_blocks: int) -> None:
        """(Re)create the KV pool, block manager, scheduler and output processor for ``num_blocks``."""
        config, bs = self.config, self.config.block_size
        self.worker.init_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batch_prefill_tokens=config.max_batch_prefill_tokens,
                max_batch_size=config.max_batch_size,
                waiting_served_ratio=config.waiting_served_ratio,
                max_waiting_tokens=config.max_waiting_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_queue_age_s=config.max_queue_age_s,
            ),
            self.block_manager,
        )
        if self.step_latency is not None:
            self.scheduler.prefill_budget_with_decodes = self.step_latency.prefill_budget
        self.outputs = OutputProcessor(self.scheduler, self.block_manager, self.requests, self.eos_token_ids,
                                       self.max_model_len)
        self.outputs.grammars = self._structured

    def _warmup_tokens(self) -> int:
        """GPU: the largest prefill the budgets allow (it sets the activation peak); CPU: a short
        one, enough to initialise every code path without slowing start-up."""
        limit = min(self.config.max_batch_prefill_tokens, self.max_model_len - 2)
        return limit if self.device.type == "cuda" else min(limit, 32)

    def warmup(self, num_tokens: int) -> None:
        """One request through every sampler path (penalties, all warpers, top-n, prompt logprobs)."""
        prompt = tuple(3 + i % max(1, self.vocab_size - 3) for i in range(max(2, num_tokens)))
        sampling = SamplingParams(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, typical_p=0.95,
                                  min_p=0.01, seed=0, repetition_penalty=1.1, frequency_penalty=0.1,
                                  presence_penalty=0.1, top_n_tokens=5, prompt_logprobs=True)
        # A short greedy request first, so that the big prompt's prefill shares a step with its
        # decode: the mixed-step kernel variants compile here, not in the middle of serving.
        self.add_request(EngineRequest("__loom_warmup_short__", (3, 4, 5), SamplingParams(),
                                       StoppingParams(max_new_tokens=4, ignore_eos=True)))
        self.step()
        self.add_request(EngineRequest("__loom_warmup__", prompt, sampling,
                                       StoppingParams(max_new_tokens=2, min_new_tokens=1, ignore_eos=True)))
        while self.has_unfinished():
            self.step()
        self.num_steps = 0

    def _warmup_kernel_variants(self) -> None:
        """A prefill of each token count at which one of the model's kernels compiles another
        variant (a quantized layer's W4A16 GEMM tiles by token-count bucket:
        ``Worker.warm_up_token_counts``), one request at a time, so that a prompt of a new size
        does not compile a kernel in the middle of serving (a second or more on the H200, every
        running stream stalled). Nothing to do where no kernel depends on the count (dense
        layers, the CPU). The sampled rows' counts (a quantized head) are left to the decode
        graphs, which capture every batch size up to the largest. Each prompt starts with its
        own token, so no two share a prefix-cache block."""
        limit = min(self.config.max_batch_prefill_tokens, self.max_model_len - 1)
        counts = self.worker.warm_up_token_counts(limit, 1).body
        span = max(1, self.vocab_size - 3)
        for n, count in enumerate(counts):
            prompt = tuple(3 + (n * 7919 + i) % span for i in range(count))
            self.add_request(EngineRequest(f"__loom_warmup_variant_{count}__", prompt, SamplingParams(),
                                           StoppingParams(max_new_tokens=1, ignore_eos=True)))
            while self.has_unfinished():
                self.step()
        if counts:
            log.info("kernel variants warmed up", token_counts=list(counts))
        self.num_steps = 0

    def _warmup_speculation(self) -> None:
        """Verification steps through every shape family before serving: a sequence verifying k
        drafts alone, beside a plain decode row, and beside a prefill chunk. On CUDA their
        attention kernels compile here (a second or more each), not in the middle of serving."""
        assert self.speculator is not None
        real, k = self.speculator.proposer, self.speculator.k
        self.speculator.proposer = _RepeatLastToken(real.context)
        try:
            stop = StoppingParams(max_new_tokens=3 * (k + 1), ignore_eos=True)
            self.add_request(EngineRequest("__loom_warmup_spec_a__", (3, 4, 5), SamplingParams(), stop))
            self.add_request(EngineRequest("__loom_warmup_spec_b__", (3, 4, 6), SamplingParams(speculate=False),
                                           stop))
            for _ in range(3):
                self.step()
            self.add_request(EngineRequest("__loom_warmup_spec_c__", tuple(range(3, 40)), SamplingParams(), stop))
            while self.has_unfinished():
                self.step()
        finally:
            self.speculator.proposer = real
            self.speculator.reset()
        self._build(self.block_manager.num_blocks)  # a clean pool: no warm-up blocks in the prefix cache
        self.num_steps = 0

    def _size_pool_on_cpu(self) -> KvPoolSize:
        """From the limits, within a share of the memory left after the weights (logged once)."""
        config = self.config
        # Every rank's pool lives in this host's memory: their bytes together count.
        per_token = config.num_shard * self.worker.kv_bytes_per_token
        available = available_memory_bytes()
        pool = size_cpu_kv_pool(block_size=config.block_size, max_model_len=self.max_model_len,
                                bytes_per_token=per_token, explicit_tokens=config.max_batch_total_tokens,
                                sequences=config.cpu_kv_cache_sequences, max_batch_size=config.max_batch_size,
                                memory_fraction=config.cpu_kv_memory_fraction, available_bytes=available)
        log.info("kv cache sized", device="cpu", max_batch_total_tokens=pool.tokens, kv_blocks=pool.blocks,
                 kv_cache_dtype=config.kv_cache_dtype,
                 kv_cache_mib=round(pool.bytes / (1 << 20), 1), bytes_per_token=per_token, reason=pool.reason,
                 available_mib=None if available is None else available >> 20)
        if available is not None and pool.bytes > available:
            log.warning("the KV cache is larger than the memory available; lower --max-total-tokens "
                        "or --max-batch-total-tokens", kv_cache_mib=pool.bytes >> 20, available_mib=available >> 20)
        return pool

    def _size_pool_on_gpu(self) -> int:
        """Size the KV pool from what is left after the weights and a warm-up's activation peak."""
        bs = self.config.block_size
        per_block = bs * self.worker.kv_bytes_per_token
        warm = self._warmup_tokens()
        trial_blocks = -(-(warm + 8) // bs) + 1
        self._build(trial_blocks)
        activations, weights_and_state, total = self.worker.profile_gpu_memory(lambda: self.warmup(warm))
        budget = int(total * self.config.cuda_memory_fraction) - weights_and_state - activations
        num_blocks = budget // per_block
        log.info("kv cache sized at warm-up", warmup_prefill_tokens=warm, activation_peak_mib=activations >> 20,
                 weights_mib=weights_and_state >> 20, gpu_total_mib=total >> 20,
                 cuda_memory_fraction=self.config.cuda_memory_fraction, kv_blocks=num_blocks,
                 max_batch_total_tokens=num_blocks * bs, kv_cache_dtype=self.config.kv_cache_dtype,
                 bytes_per_token=per_block // bs)
        if num_blocks * bs < self.max_model_len:
            raise ConfigError(
                f"the KV cache left after the weights and a {warm}-token warm-up holds {max(0, num_blocks) * bs} "
                f"tokens, less than --max-total-tokens {self.max_model_len}: lower --max-batch-prefill-tokens "
                "or --max-total-tokens, or raise --cuda-memory-fraction"
            )
        return num_blocks

    # -- LoRA adapters (loom.lora) -------------------------------------------------------------------
    def _load_startup_adapters(self) -> AdapterManager | None:
        worker = self.worker
        # (ShardedWorker, not Worker: tests stand a factory in for the module's Worker)
        if isinstance(worker, ShardedWorker) or worker.lora is None:  # sharded (refused), or LoRA off
            return None
        lora = worker.lora
        from loom.lora.manager import AdapterManager
        from loom.lora.peft_adapter import AdapterError

        manager = AdapterManager(lora.targets, lora.max_loras, lora.max_rank, worker.dtype,
                                 worker.install_adapter, worker.clear_adapter)
        for name, path in self.config.lora_adapters:
            try:
                manager.load_now(name, path)
            except (AdapterError, ValueError) as exc:
                raise ConfigError(f"--lora-adapters {name}={path}: {exc}") from exc
        return manager

    def _lora_plugin_entry(self) -> tuple[str, ...]:
        """GetModelInfo's plugins: the LoRA delta's kernel and its limits, when LoRA is on."""
        lora = self.worker.lora
        if lora is None:
            return ()
        kernel = "triton-sgmv" if lora.kernel is not None else "torch"
        return (f"lora:{kernel}?max_loras={lora.max_loras}&max_lora_rank={lora.max_rank}",)

    def adapter_command(self, cmd: AdapterCommand) -> AdapterReply | None:
        """Start a load (answered later by :meth:`adapter_replies`) or unload now; the reply, or
        None while a load reads its files."""
        if self.adapters is None:
            return AdapterReply(cmd.op_id, "FAILED_PRECONDITION",
                                "LoRA adapters are off: start the server with --max-loras N (or --lora-adapters)")
        if cmd.path is not None:
            return self.adapters.start_load(cmd.op_id, cmd.name, cmd.path)
        loaded = self.adapters.lookup(cmd.name)
        users = 0 if loaded is None else sum(
            1 for seqs in self.requests.values() if seqs and seqs[0].adapter_id == loaded.key
            and not all(s.is_finished for s in seqs))
        return self.adapters.unload(cmd.op_id, cmd.name, users)

    def adapter_replies(self) -> list[AdapterReply]:
        """Loads whose files are read: installed into their slot now, between steps."""
        return self.adapters.finished() if self.adapters is not None and self.adapters.num_loading else []

    @property
    def adapters_loading(self) -> bool:
        return self.adapters is not None and self.adapters.num_loading > 0

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError("empty prompt")
        seed = request.sampling.seed
        if seed is None and request.sampling.do_sample:
            seed = self._rng.getrandbits(63)
        # Completion i draws with seed + i: re-running it alone with that seed reproduces it.
        key, slot = self._adapter_of(request)
        seqs = [Sequence(request, i, None if seed is None else seed + i) for i in range(max(1, request.n))]
        for seq in seqs:
            seq.max_model_len = self.max_model_len
            seq.adapter_id, seq.lora_slot = key, slot
        self.requests[request.request_id] = seqs
        if request.sampling.constraint is not None:
            # Not schedulable until its grammar compiles (off this loop): see _admit_constrained.
            self._structured_output().hold(request.request_id, request.sampling.constraint, seqs)
            return
        self.scheduler.add(seqs[0], seqs[1:])

    def _adapter_of(self, request: EngineRequest) -> tuple[str, int]:
        """The request's adapter key and slot ("", 0: the base model); an adapter_id that is not
        loaded is refused (NOT_FOUND), never served by the base model."""
        if not request.adapter_id:
            return "", 0
        loaded = self.adapters.lookup(request.adapter_id) if self.adapters is not None else None
        if loaded is None:
            raise RequestRejected(f"adapter_id {request.adapter_id!r}: no such adapter is loaded",
                                  Rejection("NOT_FOUND", "adapter_id", "ADAPTER_NOT_FOUND"))
        return loaded.key, loaded.slot

    def abort(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.remove(seq)

    def abort_completion(self, request_id: str, index: int) -> None:
        """Stop one completion of a request (n > 1) whose output the front end has ended, e.g.
        on a stop string; its blocks are freed, the other completions go on."""
        seqs = self.requests.get(request_id, [])
        for seq in seqs:
            if seq.index == index and not seq.is_finished:
                seq.finish_reason = FinishReason.STOP_SEQUENCE
                self.scheduler.remove(seq)
        if seqs and all(s.is_finished for s in seqs):
            self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.has_schedulable() or (self._structured is not None and self._structured.num_held > 0)

    def has_schedulable(self) -> bool:
        """Whether a step has work: False while the only requests wait for their grammars."""
        return self._inflight is not None or self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        stats = EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_blocks=self.block_manager.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_prefill_chunks=self.scheduler.counters.prefill_chunks,
            prefix_cache_queries=self.block_manager.stats.queries,
            prefix_cache_hits=self.block_manager.stats.hits,
        )
        return self._with_grammar_stats(stats)

    # -- structured output (loom.structured) ----------------------------------------------------------
    def _structured_output(self) -> StructuredOutput | GrammarProcess | GrammarProcessGroup:
        """The structured-output driver, made on first use: its workers describe the vocabulary
        and compile grammars on their own threads. With asynchronous scheduling on one shard
        (``grammar_process`` auto) it runs in a process of its own, which fills a step's rows
        while this thread finishes the step before (loom.structured.grammar_process)."""
        if self._structured is None:
            model_dir, vocab, eos = self.worker.info.model_dir, self.vocab_size, self.eos_token_ids
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
            cache_bytes = self.config.grammar_cache_mib << 20
            if self._grammar_process_wanted():
                from loom.structured.grammar_group import GrammarProcessGroup
                from loom.structured.grammar_process import GrammarProcess, ProcessConfig

                processes = self.config.grammar_processes
                process_config = ProcessConfig(
                    str(model_dir), vocab, tuple(eos), self.config.grammar_compile_timeout, cache_bytes,
                    compiler_threads=max(1, threads // processes), fault_injection=self.config.fault_injection,
                    spin_us=kernel_switches.grammar_spin_us)
                register = self.device.type == "cuda" and kernel_switches.grammar_rows_registered
                self._structured = (GrammarProcess(process_config, register_rows=register,
                                                   device_wait=self._grammar_device_wait(register))
                                    if processes == 1 else
                                    GrammarProcessGroup(process_config, processes, register_rows=register))
            else:
                from loom.structured.compiler_pool import GrammarCompilerPool
                from loom.structured.driver import StructuredOutput
                from loom.structured.vocabulary import vocabulary_from_model_dir

                pool = GrammarCompilerPool(lambda: vocabulary_from_model_dir(model_dir, vocab, eos), workers=2,
                                           cache_bytes=cache_bytes, compiler_threads=threads)
                self._structured = StructuredOutput(pool, vocab, eos, self.config.grammar_compile_timeout)
            self.outputs.grammars = self._structured
        return self._structured

    def _grammar_device_wait(self, registered: bool) -> bool:
        """``LOOM_GRAMMAR_DEVICE_WAIT``: the grammar process signals its fills, and on CUDA the
        stream waits for the rows instead of this thread, where stream memory operations work on
        page-locked rows (loom.worker.stream_wait; else the rows are waited for here, as without
        the switch). Single-device engines only: a tensor-parallel engine sends the rows to its
        ranks after it has them."""
        if not kernel_switches.grammar_device_wait or isinstance(self.worker, ShardedWorker):
            return False
        if self.device.type != "cuda":
            return True  # (the rows are not page-locked: waited for where they are taken)
        from loom.worker import stream_wait

        return registered and stream_wait.available(self.device.index if self.device.index is not None
                                                    else torch.cuda.current_device())

    def _grammar_process_wanted(self) -> bool:
        """``grammar_process`` on, or auto where it pays: the rows are filled in the other process
        while a step is in flight, which only asynchronous scheduling gives it time for."""
        mode = self.config.grammar_process
        if mode == "auto":
            return self._async and self.config.num_shard == 1
        return mode == "on"

    def _admit_constrained(self) -> list[EngineOutput]:
        """Requests whose grammar compiled join the scheduler; refused ones fail (at step start)."""
        if self._structured is None:
            return []
        if not self._structured.num_held:
            self._structured.forget_finished()  # (take_ready does it otherwise)
            return []
        ready, refused = self._structured.take_ready()
        for seqs in ready:
            self.scheduler.add(seqs[0], seqs[1:])
        outputs: list[EngineOutput] = []
        for r in refused:
            log.info("constrained request refused", request_id=r.request_id, reason=r.rejection.reason, error=r.message)
            outputs += self.fail_request(r.request_id, r.message, r.rejection)
        return outputs

    def _with_grammar_stats(self, stats: EngineStats) -> EngineStats:
        if self._structured is None:
            return stats
        s = self._structured.compile_stats()
        return replace(stats, grammar_cache_queries=s.queries, grammar_cache_hits=s.hits,
                       grammar_compile_timeouts=s.timeouts, grammar_compile_buckets=tuple(s.buckets),
                       grammar_compile_seconds=s.seconds_sum)

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Schedule, run one forward, sample, and report the new tokens of every request.

        With asynchronous scheduling (on by default on CUDA) the step just launched is left in
        flight and the outputs returned are the previous step's: the host schedules and prepares
        step N+1 while the device computes step N, and step N+1 takes N's sampled tokens as
        input straight from the device. A sequence that step N finishes (EOS, stop token) has
        computed one row too many in step N+1, which is dropped. Steps that need every token on
        the host (penalties, prompt logprobs) run synchronously. A step with grammar rows queues
        its forward, completes step N, then fills its rows and queues its sampling (:meth:`_sample`). Constrained requests
        whose grammar has compiled join the scheduler first (:meth:`_admit_constrained`).
        """
        outputs: list[EngineOutput] = self._admit_constrained()
        prev, self._inflight = self._inflight, None
        overlap = self._overlap_helps() and not self._needs_sync()
        if prev is not None and not overlap:
            outputs += self._complete(prev)
            prev = None
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._last_launch = None  # idle: the next gap is not a step's time
            if prev is not None:
                outputs += self._complete(prev)
            return outputs
        drafts: dict[int, list[int]] = {}
        if self.speculator is not None and prev is None:
            drafts = self.speculator.add_drafts(sched, self.block_manager, len(self.scheduler.running))
        elif self.speculator is not None:  # overlapped: no sequence was due to propose
            self.speculator.rest(sched)
        self.num_steps += 1
        started = time.monotonic()
        if self.step_latency is not None:
            self._observe_step_time(sched, started)
        if self._trace is not None:
            self._trace_step(sched, started, overlapped=prev is not None)
        for seq in sched.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = started
        try:
            launched = self._launch(sched, drafts, prev)
        except ShardLostError:
            raise  # not one request's fault: the engine cannot step any more
        except Exception as exc:  # one request's fault must not fail the others
            log.warning("step failed; re-running its sequences one by one", error=repr(exc))
            if prev is not None:
                outputs += self._complete(prev)  # every input token is on the host again
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._isolate(sched, outputs, drafts)
            return outputs
        if prev is not None:
            outputs += self._complete(prev)
        # Admissions may have grown the batch past the largest graph: check that again. (Penalties
        # and prompt logprobs were checked over every live sequence before scheduling.)
        inflight = overlap and not drafts and self._overlap_helps()
        if not (inflight and self._structured is not None and self._structured.fills_ahead):
            outputs += self._sample(launched)  # (the requests failed on the way, if any)
        # else its rows are filled elsewhere meanwhile: its sampling is queued at the next launch
        if inflight:
            self._inflight = launched
            self.num_async_steps += 1
        else:
            outputs += self._complete(launched)
            if not self.has_unfinished():
                self._last_launch = None  # the engine goes idle: no next launch measures this one
        return outputs

    def _observe_step_time(self, sched: SchedulerOutput, now: float) -> None:
        """The previous launch's step time is the gap to this one (what a stream waits between
        tokens, asynchronous scheduling included); remember this launch's shape."""
        assert self.step_latency is not None
        if self._last_launch is not None:
            then, decodes, prefill = self._last_launch
            self.step_latency.observe(decodes, prefill, now - then)
        decodes = sum(1 for n in sched.num_new_tokens if n == 1)
        self._last_launch = (now, decodes, sum(sched.num_new_tokens) - decodes)

    def _trace_step(self, sched: SchedulerOutput, now: float, overlapped: bool) -> None:
        """One JSON line per step (``LOOM_STEP_TRACE=FILE``): when it was scheduled, its prefill
        tokens, decode rows, running batch, and whether it was prepared while the previous step
        ran on the device. The gaps between lines are the step times."""
        decodes = sum(1 for n in sched.num_new_tokens if n == 1)
        assert self._trace is not None
        self._trace.write(json.dumps({
            "t": round(now, 6), "prefill_tokens": sum(sched.num_new_tokens) - decodes, "decode_rows": decodes,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "overlapped": overlapped}) + "\n")

    def _overlap_helps(self) -> bool:
        """``on``: always. ``auto`` (CUDA): while the running batch fits the largest captured
        decode graph. Measured on the H200 (docs/benchmarks.md), eager steps of 512 sequences got
        slower when overlapped (llama-1b: 23-26 ms a step against 13-19 ms), while graph-sized
        batches gain the whole host time."""
        if not self._async:
            return False
        if self.config.async_scheduling == "on":
            return True
        largest = self.worker.max_graph_batch_size
        return largest is not None and len(self.scheduler.running) <= largest

    def _needs_sync(self) -> bool:
        """Whether some live sequence needs all its tokens on the host before its next step
        (drafts are proposed from the tokens on the host, too: a step in which some sequence is
        due to propose; not one in which every sequence backs off after rejections, is near its
        max_new_tokens or has speculation turned off)."""
        if self.speculator is not None and self.speculator.will_propose(self.scheduler.running):
            return True
        return any(_needs_host_tokens(s) for s in self.scheduler.running) or any(
            _needs_host_tokens(s) for s in self.scheduler.waiting)

    def _launch(self, sched: SchedulerOutput, drafts: dict[int, list[int]] | None = None,
                prev: _Launched | None = None) -> _Launched:
        """Plan ``sched``, launch it on the worker, and commit it on the sequences: computed
        tokens, and a placeholder for each token being sampled (the output processor corrects
        the computed count of a sequence that verified drafts). ``prev``, the step in flight: if
        its sampling is still due (a grammar process filled its rows meanwhile), it is queued
        first, since this step's forward takes its tokens from the device."""
        planned = plan_step(sched, self.config.block_size, self.vocab_size, self.eos_token_ids, drafts)
        plan = planned.plan
        guesses = None
        if plan.num_drafts is not None:  # each sampled sequence's drafts, as the plan lays them out
            flat = iter(plan.draft_token_ids)
            guesses = [[next(flat) for _ in range(m)] for m in plan.num_drafts]
        staged: StagedForward | None = None
        if prev is not None and isinstance(prev.step, ForwardedStep):
            if kernel_switches.stage_before_rows and not isinstance(self.worker, ShardedWorker):
                staged = self.worker.stage_forward(plan)  # while the child may still fill prev's rows
            prev.early += self._sample(prev)
        step: LaunchedStep | ForwardedStep
        constrained = self._structured is not None and self._structured.any_matched(planned.sample_seqs)
        if staged is not None:
            assert not isinstance(self.worker, ShardedWorker)
            step = self.worker.launch_staged(staged)
            if not constrained:
                step = self.worker.sample(step, None)
        elif constrained:
            step = self.worker.execute_forward(plan)  # the grammar rows are filled while it runs
        else:
            step = self.worker.execute(plan)
        if constrained:
            assert self._structured is not None
            self._structured.will_sample(planned.sample_seqs, guesses)
        self.block_manager.commit_pending()
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            seq.uses_pending_blocks = False
        for child, parent in sched.forks:
            child.num_computed_tokens = parent.num_computed_tokens
            child.first_scheduled_time = parent.first_scheduled_time
        positions = []
        for row, seq in enumerate(planned.sample_seqs):
            positions.append(seq.num_tokens)
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_pending_tokens += 1
            seq.pending_row = row
        return _Launched(sched, planned, step, positions, guesses)

    def _sample(self, launched: _Launched) -> list[EngineOutput]:
        """Queue a launched step's sampling if its grammar rows were left to fill: the matchers
        have seen every earlier token by now (the previous step was completed after this one's
        forward was queued), so the rows are filled while the device runs the forward.

        The driver turns a fault of one matcher into the failure of its own request; should the
        rows still fail to fill (a fault outside xgrammar), the step's constrained requests fail
        (INTERNAL, GRAMMAR_MATCHER_FAULT: their outputs are returned) and its rows are sampled
        without a mask, so that the other requests go on."""
        step = launched.step
        if not isinstance(step, ForwardedStep):
            return []
        assert self._structured is not None
        outputs: list[EngineOutput] = []
        try:
            bitmask = self._structured.bitmask_rows(launched.planned.sample_seqs, launched.guesses)
        except Exception as exc:
            bitmask = None
            outputs = self._fail_constrained(launched.planned.sample_seqs, exc)
        outputs += self._late_refusals()
        launched.awaiting_rows = bitmask is not None and bitmask.ready is not None
        if launched.awaiting_rows and self.device.type != "cuda":  # a host sampler reads them at once
            outputs += self._await_rows(launched)
        launched.step = self.worker.sample(step, bitmask)
        return outputs

    def _late_refusals(self) -> list[EngineOutput]:
        """Fail the requests whose token a grammar process refused after it was used."""
        assert self._structured is not None
        outputs: list[EngineOutput] = []
        for r in self._structured.take_refusals():
            log.error("a constrained request's token was refused by its grammar after it was used",
                      request_id=r.request_id, error=r.message)
            outputs += self.fail_request(r.request_id, r.message, r.rejection)
        return outputs

    def _await_rows(self, launched: _Launched) -> list[EngineOutput]:
        """A step whose sampling waits on the device for its grammar rows: the grammar process's
        reply, before its tokens are read. Should the rows have failed (the process ended, or its
        fill raised; the rows were then opened so the device went on), the step's constrained
        requests fail and the others go on, as when the rows fail in :meth:`_sample`."""
        assert self._structured is not None
        launched.awaiting_rows = False
        outputs: list[EngineOutput] = []
        try:
            self._structured.await_rows()
        except Exception as exc:
            outputs = self._fail_constrained(launched.planned.sample_seqs, exc)
        return outputs + self._late_refusals()

    def _fail_constrained(self, seqs: Seq[Sequence], exc: Exception) -> list[EngineOutput]:
        """Fail the requests of ``seqs`` that follow a grammar, after filling their rows raised."""
        assert self._structured is not None
        refused = {r.request_id: r for s in seqs if not s.is_finished
                   and (r := self._structured.host_fault(s, "filling this step's token masks", exc)) is not None}
        log.error("filling the step's grammar rows failed: its constrained requests fail, the others go on",
                  requests=sorted(refused), error=repr(exc), exc_info=exc)
        outputs: list[EngineOutput] = []
        for r in refused.values():
            outputs += self.fail_request(r.request_id, r.message, r.rejection)
        return outputs

    def _complete(self, launched: _Launched) -> list[EngineOutput]:
        """Wait for a launched step and apply its tokens (the output processor)."""
        outputs, launched.early = launched.early, []
        outputs += self._sample(launched)  # (nothing when its sampling is queued already)
        if launched.awaiting_rows:
            outputs += self._await_rows(launched)
        assert isinstance(launched.step, LaunchedStep)
        result = self.worker.finish(launched.step)
        outputs += self.outputs.process(launched.planned, launched.positions, result, launched.sched.seqs,
                                        self.speculator.proposed if self.speculator is not None else None)
        num_drafts = launched.planned.plan.num_drafts
        if self.speculator is not None and num_drafts is not None:
            for seq, m, tokens in zip(launched.planned.sample_seqs, num_drafts, result.token_ids, strict=True):
                if m and seq.seq_id not in result.failed:
                    self.speculator.observe(seq, m, len(tokens) - 1)
            self.speculator.release_finished()
        return outputs

    def _isolate(self, sched: SchedulerOutput, outputs: list[EngineOutput],
                 drafts: dict[int, list[int]] | None = None) -> None:
        """Run each sequence of a failed step alone; a sequence that fails alone fails its request.

        Prefix blocks this step was to fill are forgotten, and sequences that had started on
        them go back to the queue (their KV was never written)."""
        self.block_manager.drop_pending()
        for seq in sched.seqs:
            if seq.uses_pending_blocks and not seq.is_finished:
                self.scheduler.requeue(seq)
                for child, parent in sched.forks:
                    if parent is seq:  # it shares those blocks too
                        self.scheduler.requeue(child)
        copies = sched.blocks_to_copy
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            if seq.is_finished or seq.status is not SequenceStatus.RUNNING:
                continue
            part = SchedulerOutput(seqs=[seq], num_new_tokens=[n],
                                   forks=[(c, p) for c, p in sched.forks if p is seq],
                                   blocks_to_copy=copies)
            copies = []
            try:
                own = {seq.seq_id: drafts[seq.seq_id]} if drafts and seq.seq_id in drafts else None
                outputs += self._complete(self._launch(part, own))
            except ShardLostError:
                raise
            except Exception as exc:
                log.error("request failed in the model step", request_id=seq.request_id, error=repr(exc))
                outputs += self.fail_request(seq.request_id, f"model step failed: {type(exc).__name__}: {exc}")

    def fail_request(self, request_id: str, message: str, rejection: Rejection | None = None) -> list[EngineOutput]:
        """End every completion of ``request_id`` with an error (a ``rejection`` when the request
        is refused rather than failed); its blocks are freed."""
        return self.outputs.fail_request(request_id, message, rejection)
