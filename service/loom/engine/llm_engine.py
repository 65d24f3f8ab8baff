"""The in-process engine: load the model, size the KV pool, and run the step loop.

``LLMEngine`` is synchronous and single-threaded: ``add_request`` / ``abort`` / ``step``.
The server never calls it directly; :mod:`loom.engine.core_process` runs it in its own process
so the step loop never shares an interpreter lock with request handling.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TextIO, cast

import structlog
import torch

from loom.config import ConfigError, EngineConfig
from loom.plugin_api import PluginRegistry, default_registry
from loom.process_tuning import keep_freed_memory

from .block_manager import BlockManager
from .cuda_graphs import maybe_capture_cuda_graphs
from .fault_injection import FaultInjectingRunner
from .kv_pool_sizing import KvPoolSize, available_memory_bytes, kv_bytes_per_token, size_cpu_kv_pool
from .model_runner import CausalLM, LaunchedStep, ModelRunner, StepResult
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import PENDING_TOKEN, Sequence, SequenceStatus
from .types import (
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
    from loom.structured.driver import StructuredOutput

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """fp32 on CPU; on GPU the checkpoint's half type (bf16 when it says fp32 or nothing)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in (torch.float16, torch.bfloat16):
        return checkpoint_dtype
    return torch.bfloat16


def _needs_host_tokens(seq: Sequence) -> bool:
    """Penalties read the output so far, prompt logprobs are read back at once, and a grammar's
    matcher must see the last token before it fills the next mask: such a sequence's next step
    cannot be prepared while its last token is still on the device."""
    sp = seq.sampling
    return (sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
            or (sp.prompt_logprobs and not seq.prompt_logprobs_sent) or sp.constraint is not None)


@dataclass
class _Launched:
    sched: SchedulerOutput
    step: LaunchedStep
    positions: list[int]  # where each sampled token goes in its sequence's token_ids


class LLMEngine:
    def __init__(self, config: EngineConfig, registry: PluginRegistry | None = None) -> None:
        from loom.model_loader import eos_token_ids, load_hf_config, load_model, model_dims, resolve_model_dir

        self.config = config
        started = time.monotonic()
        registry = registry or default_registry()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            # The fused-ops kernel is compiled (first start on a machine, ~20 s) while the model
            # loads and the plugins build theirs; its first user waits for it if need be.
            from loom.layers import cpu_fused

            threading.Thread(target=cpu_fused.available, name="build-cpu-fused-ops", daemon=True).start()
        model_dir = resolve_model_dir(config.model_id)
        self.model_dir = model_dir
        # Structured output, made on the first constrained request (see _structured_output).
        self._structured: StructuredOutput | None = None
        log.info("loading the model", model_dir=str(model_dir), device=str(self.device))
        hf_config = load_hf_config(model_dir)
        ckpt_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(ckpt_dtype, str):
            ckpt_dtype = _DTYPES.get(ckpt_dtype)
        self.dtype = resolve_dtype(config.dtype, self.device, ckpt_dtype)
        loaded = load_model(model_dir, self.dtype, self.device, registry, config.quantize)
        if self.device.type == "cpu":
            keep_freed_memory()  # CPU forwards allocate big activations each step: no page-fault storm
        if self.device.type == "cuda" and not config.num_threads:
            # The host only schedules and launches: intra-op threads would just spin after each
            # small CPU copy and take cores from this thread and the front end.
            torch.set_num_threads(1)
        shape = model_dims(loaded.hf_config)
        if config.attention_backend:
            backend_spec = registry.attention_backend(config.attention_backend)
        else:
            backend_spec = registry.default_attention_backend(self.device.type, config.block_size)
        backend = backend_spec.load()(shape.num_heads, shape.num_kv_heads, shape.head_dim, self.dtype, self.device)

        self.model = cast(CausalLM, loaded.model)
        self.backend = backend
        self.shape = shape
        self.eos_token_ids = eos_token_ids(model_dir)
        self.vocab_size = shape.vocab_size
        self.requests: dict[str, list[Sequence]] = {}
        self.runner: ModelRunner
        self._rng = random.Random(config.seed)  # None: seeded from the OS
        self.num_steps = 0
        self._inflight: _Launched | None = None  # a launched step whose results are not read yet
        trace = os.environ.get("LOOM_STEP_TRACE")  # a JSON line per step (see _trace_step)
        self._trace: TextIO | None = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115
        self.num_async_steps = 0  # steps left in flight while the next one was prepared
        self._async = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.device.type == "cuda")
        bs = config.block_size
        self.max_model_len = config.max_total_tokens or min(shape.max_position_embeddings, 4096)
        if self.max_model_len > shape.max_position_embeddings:
            raise ConfigError(
                f"--max-total-tokens {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({shape.max_position_embeddings})"
            )
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
            self._build(num_blocks)  # a clean pool: no warm-up blocks in the prefix cache
        # Decode graphs point at this pool: captured last, after any rebuild.
        self.runner.cuda_graphs = maybe_capture_cuda_graphs(
            config.cuda_graphs, self.model, self.backend, self.runner.kv_caches, bs, self.max_model_len,
            self.device, config.max_batch_size)
        pool_tokens = num_blocks * bs
        self.info = EngineInfo(
            model_id=config.model_id or "SmolLM2-135M-Instruct (embedded default)",
            architecture=loaded.hf_architecture,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            attention_backend=backend_spec.name,
            block_size=bs,
            num_blocks=num_blocks,
            max_batch_total_tokens=pool_tokens,
            max_model_len=self.max_model_len,
            vocab_size=shape.vocab_size,
            eos_token_ids=self.eos_token_ids,
            plugins=(f"quantizer:{loaded.quantization}",) if loaded.quantization else (),
        )
        log.info("engine ready", model_dir=str(model_dir), architecture=loaded.hf_architecture, model=loaded.architecture,
                 dtype=self.info.dtype, device=self.info.device, attention_backend=backend_spec.name,
                 kv_blocks=num_blocks, block_size=bs, max_batch_total_tokens=pool_tokens,
                 max_total_tokens=self.max_model_len, duration_s=round(time.monotonic() - started, 1))

    def _build(self, num_blocks: int) -> None:
        """(Re)create the KV pool, block manager, scheduler and runner for ``num_blocks`` blocks."""
        config, bs = self.config, self.config.block_size
        self._drop_pool()  # free the old pool before allocating anew
        kv_caches = self.backend.allocate_kv_cache(self.shape.num_layers, num_blocks, bs)
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
        # Tests only (--fault-injection): a runner that fails chosen requests on purpose.
        runner_cls = FaultInjectingRunner if config.fault_injection else ModelRunner
        self.runner = runner_cls(self.model, self.backend, kv_caches, bs, self.vocab_size, self.device,
                                 self.eos_token_ids)
        self.runner.token_bitmasks = self._structured

    def _drop_pool(self) -> None:
        self.__dict__.pop("runner", None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

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

    def _size_pool_on_cpu(self) -> KvPoolSize:
        """From the limits, within a share of the memory left after the weights (logged once)."""
        config = self.config
        per_token = kv_bytes_per_token(self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim,
                                       torch.empty((), dtype=self.dtype).element_size())
        available = available_memory_bytes()
        pool = size_cpu_kv_pool(block_size=config.block_size, max_model_len=self.max_model_len,
                                bytes_per_token=per_token, explicit_tokens=config.max_batch_total_tokens,
                                sequences=config.cpu_kv_cache_sequences, max_batch_size=config.max_batch_size,
                                memory_fraction=config.cpu_kv_memory_fraction, available_bytes=available)
        log.info("kv cache sized", device="cpu", max_batch_total_tokens=pool.tokens, kv_blocks=pool.blocks,
                 kv_cache_mib=round(pool.bytes / (1 << 20), 1), bytes_per_token=per_token, reason=pool.reason,
                 available_mib=None if available is None else available >> 20)
        if available is not None and pool.bytes > available:
            log.warning("the KV cache is larger than the memory available; lower --max-total-tokens "
                        "or --max-batch-total-tokens", kv_cache_mib=pool.bytes >> 20, available_mib=available >> 20)
        return pool

    def _size_pool_on_gpu(self) -> int:
        """Size the KV pool from what is left after the weights and a warm-up's activation peak."""
        bs = self.config.block_size
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_block = 2 * self.shape.num_layers * bs * self.shape.num_kv_heads * self.shape.head_dim * elem
        warm = self._warmup_tokens()
        trial_blocks = -(-(warm + 8) // bs) + 1
        self._build(trial_blocks)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.warmup(warm)
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - base
        self._drop_pool()
        weights_and_state = torch.cuda.memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.cuda_memory_fraction) - weights_and_state - activations
        num_blocks = budget // per_block
        log.info("kv cache sized at warm-up", warmup_prefill_tokens=warm, activation_peak_mib=activations >> 20,
                 weights_mib=weights_and_state >> 20, gpu_total_mib=total >> 20,
                 cuda_memory_fraction=self.config.cuda_memory_fraction, kv_blocks=num_blocks,
                 max_batch_total_tokens=num_blocks * bs)
        if num_blocks * bs < self.max_model_len:
            raise ConfigError(
                f"the KV cache left after the weights and a {warm}-token warm-up holds {max(0, num_blocks) * bs} "
                f"tokens, less than --max-total-tokens {self.max_model_len}: lower --max-batch-prefill-tokens "
                "or --max-total-tokens, or raise --cuda-memory-fraction"
            )
        return num_blocks

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
        seqs = [Sequence(request, i, None if seed is None else seed + i) for i in range(max(1, request.n))]
        for seq in seqs:
            seq.max_model_len = self.max_model_len
        self.requests[request.request_id] = seqs
        if request.sampling.constraint is not None:
            # Not schedulable until its grammar compiles (off this loop): see _admit_constrained.
            self._structured_output().hold(request.request_id, request.sampling.constraint, seqs)
            return
        self.scheduler.add(seqs[0], seqs[1:])

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
    def _structured_output(self) -> StructuredOutput:
        """The structured-output driver, made on first use: its workers describe the vocabulary
        and compile grammars on their own threads."""
        if self._structured is None:
            from loom.structured.compiler_pool import GrammarCompilerPool
            from loom.structured.driver import StructuredOutput
            from loom.structured.vocabulary import vocabulary_from_model_dir

            model_dir, vocab, eos = self.model_dir, self.vocab_size, self.eos_token_ids
            threads = max(1, min(8, (os.cpu_count() or 2) // 2))
            pool = GrammarCompilerPool(lambda: vocabulary_from_model_dir(model_dir, vocab, eos), workers=2,
                                       cache_bytes=self.config.grammar_cache_mib << 20, compiler_threads=threads)
            self._structured = StructuredOutput(pool, vocab, eos, self.config.grammar_compile_timeout)
            self.runner.token_bitmasks = self._structured
        return self._structured

    def _admit_constrained(self) -> list[EngineOutput]:
        """Requests whose grammar compiled join the scheduler; refused ones fail (at step start)."""
        if self._structured is None or not self._structured.num_held:
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
        s = self._structured.pool.snapshot()
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
        the host (penalties, prompt logprobs, grammars) run synchronously. Constrained requests
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
            if prev is not None:
                outputs += self._complete(prev)
            return outputs
        self.num_steps += 1
        started = time.monotonic()
        if self._trace is not None:
            self._trace_step(sched, started, overlapped=prev is not None)
        for seq in sched.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = started
        try:
            launched = self._launch(sched)
        except Exception as exc:  # one request's fault must not fail the others
            log.warning("step failed; re-running its sequences one by one", error=repr(exc))
            if prev is not None:
                outputs += self._complete(prev)  # every input token is on the host again
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._isolate(sched, outputs)
            return outputs
        if prev is not None:
            outputs += self._complete(prev)
        # Admissions may have grown the batch past the largest graph: check that again. (Penalties
        # and prompt logprobs were checked over every live sequence before scheduling.)
        if overlap and self._overlap_helps():
            self._inflight = launched
            self.num_async_steps += 1
        else:
            outputs += self._complete(launched)
        return outputs

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
        graphs = self.runner.cuda_graphs
        return graphs is not None and len(self.scheduler.running) <= graphs.sizes[-1]

    def _needs_sync(self) -> bool:
        """Whether some live sequence needs all its tokens on the host before its next step."""
        return any(_needs_host_tokens(s) for s in self.scheduler.running) or any(
            _needs_host_tokens(s) for s in self.scheduler.waiting)

    def _launch(self, sched: SchedulerOutput) -> _Launched:
        """Launch ``sched`` on the device and advance its sequences: computed tokens, and a
        placeholder for each token being sampled."""
        step = self.runner.launch(sched)
        self.block_manager.commit_pending()
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            seq.uses_pending_blocks = False
        for child, parent in sched.forks:
            child.num_computed_tokens = parent.num_computed_tokens
            child.first_scheduled_time = parent.first_scheduled_time
        positions = []
        for row, seq in enumerate(step.sample_seqs):
            positions.append(seq.num_tokens)
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_pending_tokens += 1
            seq.pending_row = row
        return _Launched(sched, step, positions)

    def _complete(self, launched: _Launched) -> list[EngineOutput]:
        """Wait for a launched step, put its tokens in place, and turn them into outputs."""
        result = self.runner.finish(launched.step)
        outputs = []
        for i, seq in enumerate(result.seqs):
            if seq.is_finished:
                continue  # finished or aborted while the step ran, or failed earlier in it
            pos = launched.positions[i]
            seq.token_ids[pos] = result.token_ids[i]
            seq.num_pending_tokens -= 1
            if seq.seq_id in result.failed:
                outputs += self.fail_request(seq.request_id, result.failed[seq.seq_id])
                continue
            refused = self._structured.accept(seq, result.token_ids[i]) if self._structured is not None else None
            if refused is not None:  # its grammar's matcher could not follow
                outputs += self.fail_request(seq.request_id, refused.message, refused.rejection)
                continue
            outputs.append(self._token_output(seq, pos, result, i))
        for seq in launched.sched.seqs:
            if not seq.is_finished:  # blocks that filled while their last token was on the device
                self.block_manager.register_full_blocks(seq)
        return outputs

    def _isolate(self, sched: SchedulerOutput, outputs: list[EngineOutput]) -> None:
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
                outputs += self._complete(self._launch(part))
            except Exception as exc:
                log.error("request failed in the model step", request_id=seq.request_id, error=repr(exc))
                outputs += self.fail_request(seq.request_id, f"model step failed: {type(exc).__name__}: {exc}")

    def fail_request(self, request_id: str, message: str, rejection: Rejection | None = None) -> list[EngineOutput]:
        """End every completion of ``request_id`` with an error (a ``rejection`` when the request
        is refused rather than failed); its blocks are freed."""
        outs = []
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                outs.append(EngineOutput(seq.request_id, seq.index, [], [], finish_reason=FinishReason.ERROR,
                                         error=message, rejection=rejection, seed=seq.seed,
                                         num_prompt_tokens=seq.num_prompt_tokens))
                seq.finish_reason = FinishReason.ERROR
                self.scheduler.remove(seq)
        return outs

    def _token_output(self, seq: Sequence, pos: int, result: StepResult, i: int) -> EngineOutput:
        """The output for ``seq``'s token at ``pos`` (row ``i`` of ``result``); finishes it when done."""
        token = result.token_ids[i]
        lp = result.logprobs[i]
        seq.cumulative_logprob += lp
        reason = self._finish_reason(seq, token, pos)
        out = EngineOutput(
            request_id=seq.request_id,
            index=seq.index,
            token_ids=[token],
            logprobs=[lp],
            top_tokens=[result.top_tokens[i]] if result.top_tokens is not None else None,
            finish_reason=reason,
            seed=seq.seed,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            first_scheduled_time=seq.first_scheduled_time,
        )
        if seq.sampling.prompt_logprobs and not seq.prompt_logprobs_sent:
            out.prompt_logprobs = seq.prompt_logprobs
            seq.prompt_logprobs_sent = True
        if reason is not None:
            # a token sampled after this one (the step in flight) is not part of the output
            del seq.token_ids[pos + 1 :]
            seq.num_pending_tokens = 0
            self._finish(seq, reason)
        return out

    def _finish_reason(self, seq: Sequence, token: int, pos: int) -> FinishReason | None:
        """Why ``seq`` ends with ``token`` at position ``pos`` (None: it goes on)."""
        st = seq.stopping
        if self._structured is not None and self._structured.terminated(seq):
            return FinishReason.EOS_TOKEN  # its grammar matched a whole sentence, then EOS
        num_output = pos + 1 - seq.num_prompt_tokens
        past_min = num_output >= st.min_new_tokens
        if past_min and not st.ignore_eos and token in self.eos_token_ids:
            return FinishReason.EOS_TOKEN
        if past_min and token in st.stop_token_ids:
            return FinishReason.STOP_SEQUENCE
        if num_output >= st.max_new_tokens or pos + 1 >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seqs = self.requests.get(seq.request_id, [])
        if all(s.status is SequenceStatus.FINISHED for s in seqs):
            self.requests.pop(seq.request_id, None)
