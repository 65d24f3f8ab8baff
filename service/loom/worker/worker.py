"""The worker: one device's share of the engine. It resolves the device and dtype, loads the
model, builds the attention backend, holds the KV pool, the model runner, the CUDA graphs and
the staging buffers, and runs step plans (``loom.worker.step_plan``).

The engine core talks to it only through plans, sizes and :class:`StepOutput` results. With
``--num-shard N`` there is one worker per tensor-parallel rank: rank 0's in the engine process,
the others in their own processes (``loom.worker.rank_process``), all driven by
``loom.worker.sharded_worker.ShardedWorker`` with the same calls. A worker is built for the rank
that ``loom.distributed.parallel_state`` says this process is: its layers hold that rank's slices
and its attention backend and KV pool that rank's heads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import structlog
import torch

from loom.config import ConfigError, EngineConfig
from loom.distributed.parallel_state import get_tp_size
from loom.layers.kv_fp8 import is_fp8_kv_cache_dtype
from loom.lora.layers import LoraKernel, LoraSlots
from loom.plugin_api import PluginRegistry
from loom.process_tuning import keep_freed_memory
from loom.sample.batch import TokenBitmaskRows

from .cuda_graphs import maybe_capture_cuda_graphs
from .fault_injection import FaultInjectingRunner
from .kernel_warmup import WarmUpCounts, warm_up_counts
from .model_runner import CausalLM, ForwardedStep, LaunchedStep, ModelRunner, StagedForward
from .step_plan import StepOutput, StepPlan

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


@dataclass(frozen=True)
class LoadedModelInfo:
    """What the engine core needs to know of the loaded model (plain values)."""

    model_dir: Path
    hf_architecture: str
    architecture: str
    quantization: str | None
    attention_backend: str
    num_layers: int
    num_kv_heads: int  # this rank's (all of them with one shard; at least 1, replicated past the model's)
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    plugins: tuple[str, ...]  # EngineInfo.plugins' entries (the quantizer and its settings)


class Worker:
    """Device, model, attention backend, KV pool, model runner and CUDA graphs of one device."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry) -> None:
        from loom.model_loader import eos_token_ids, load_hf_config, load_model, model_dims, resolve_model_dir

        self.config = config
        self.tp_size = get_tp_size()
        self.device = resolve_device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif self.tp_size > 1 and self.device.type == "cpu":
            # The CPU ranks share the host's cores: torch's default (every core each) would
            # oversubscribe them N times over.
            torch.set_num_threads(max(1, torch.get_num_threads() // self.tp_size))
        if self.device.type == "cpu":
            # The fused-ops kernel is compiled (first start on a machine, ~20 s) while the model
            # loads and the plugins build theirs; its first user waits for it if need be.
            from loom.layers import cpu_fused

            threading.Thread(target=cpu_fused.available, name="build-cpu-fused-ops", daemon=True).start()
        model_dir = resolve_model_dir(config.model_id)
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
        capped = any(getattr(m, "logits_soft_cap", None) for m in loaded.model.modules())
        if capped and not getattr(backend_spec.load(), "supports_logits_soft_cap", False):
            if config.attention_backend:
                raise ConfigError(f"--attention-backend {backend_spec.name} cannot serve this model: it caps "
                                  "attention scores (Gemma 2's attn_logit_softcapping); use --attention-backend torch")
            log.info("attention backend: torch, the default one cannot cap attention scores (Gemma 2)",
                     default=backend_spec.name)
            backend_spec = registry.attention_backend("torch")
        fp8_kv = is_fp8_kv_cache_dtype(config.kv_cache_dtype)
        if fp8_kv and not config.attention_backend and not getattr(backend_spec.load(), "supports_fp8_kv_cache", False):
            fallback = "paged" if self.device.type == "cuda" and not capped else "torch"
            log.info(f"attention backend: {fallback}, the default one cannot read an FP8 KV cache",
                     default=backend_spec.name)
            backend_spec = registry.attention_backend(fallback)
        # This rank's heads: q heads split evenly; KV heads split, or one each (replicated) when
        # the ranks outnumber them (as QKVParallelLinear lays them out).
        num_heads = shape.num_heads // self.tp_size
        num_kv_heads = max(1, shape.num_kv_heads // self.tp_size)
        self.backend = backend_spec.load()(num_heads, num_kv_heads, shape.head_dim, self.dtype, self.device)
        if fp8_kv:
            try:
                self.backend.use_fp8_kv_cache()
            except ValueError as exc:
                raise ConfigError(f"--kv-cache-dtype {config.kv_cache_dtype}: {exc}; the torch and paged "
                                  "backends can") from exc
        self.model = cast(CausalLM, loaded.model)
        self.shape = shape
        self.info = LoadedModelInfo(
            model_dir=model_dir, hf_architecture=loaded.hf_architecture, architecture=loaded.architecture,
            quantization=loaded.quantization, attention_backend=backend_spec.name, num_layers=shape.num_layers,
            num_kv_heads=num_kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab_size,
            max_position_embeddings=shape.max_position_embeddings, eos_token_ids=eos_token_ids(model_dir),
            plugins=loaded.plugin_entries() + self._kv_cache_entries(backend_spec.name))
        self.runner: ModelRunner | None = None
        self.lora: LoraSlots | None = None
        if config.num_lora_slots:
            # Before any runner or CUDA graph: the layers' slot tables are part of what they read.
            self.lora = LoraSlots(cast(torch.nn.Module, self.model), config.num_lora_slots, config.max_lora_rank,
                                  self.device, self.dtype, _lora_kernel(self.device))

    def _kv_cache_entries(self, backend: str) -> tuple[str, ...]:
        """EngineInfo.plugins' entry for the attention backend's KV format (GetModelInfo, loom plugins)."""
        if not self.backend.fp8_kv_cache:
            return ()
        return (f"attention:{backend}?kv_cache_dtype=fp8_e4m3&kv_cache_scales=per_token_and_head",)

    # -- the KV pool ---------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K and V in every layer of the pool (FP8 codes and scales, or the model's dtype)."""
        return self.shape.num_layers * self.backend.kv_bytes_per_token_per_layer

    def init_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the KV pool for ``num_blocks`` blocks and a runner over it."""
        self.free_kv_cache()  # free the old pool before allocating anew
        bs = self.config.block_size
        kv_caches = self.backend.allocate_kv_cache(self.shape.num_layers, num_blocks, bs)
        # Tests only (--fault-injection): a runner that fails chosen requests on purpose.
        runner_cls = FaultInjectingRunner if self.config.fault_injection else ModelRunner
        self.runner = runner_cls(self.model, self.backend, kv_caches, bs, self.shape.vocab_size, self.device)
        self.runner.lora = self.lora

    def free_kv_cache(self) -> None:
        self.runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def capture_cuda_graphs(self, max_model_len: int, query_lens: tuple[int, ...] = (1,),
                            max_graph_tokens: int | None = None) -> None:
        """Capture graphs over the current pool (after its last rebuild) for steps whose every
        sequence has one of ``query_lens`` rows: 1 for decode, k + 1 to verify k drafts (a draft
        model adds its catch-up widths), none of more than ``max_graph_tokens`` rows. (The
        LoRA kernel's other variants are compiled here too: the last step before serving.)"""
        runner = self._runner()
        if self.lora is not None and self.device.type == "cuda":  # the prefill variants too, before serving
            self.lora.warm_up_kernel(self.config.max_batch_prefill_tokens)
        runner.cuda_graphs = maybe_capture_cuda_graphs(
            self.config.cuda_graphs, self.model, self.backend, runner.kv_caches, self.config.block_size,
            max_model_len, self.device, self.config.max_batch_size, query_lens, lora=self.lora is not None,
            max_tokens=max_graph_tokens)

    def warm_up_token_counts(self, max_tokens: int, max_rows: int) -> WarmUpCounts:
        """The step sizes at which the model must run before serving so that none of its
        kernels compiles later (``loom.worker.kernel_warmup``): up to ``max_tokens`` rows a step,
        ``max_rows`` of them sampled."""
        return warm_up_counts(cast(torch.nn.Module, self.model), max_tokens, max_rows)

    @property
    def max_graph_batch_size(self) -> int | None:
        """The largest batch a captured decode graph holds (None: no graphs)."""
        graphs = self.runner.cuda_graphs if self.runner is not None else None
        return graphs.sizes[-1] if graphs is not None else None

    def profile_gpu_memory(self, run: Callable[[], Any]) -> tuple[int, int, int]:
        """Run ``run`` (a warm-up through the engine) and measure the device memory: the
        activation peak above what was allocated before, what stays allocated once the pool is
        freed (weights and state), and the device's total, in bytes."""
        base = self.profile_start()
        run()
        return self.profile_end(base)

    def profile_start(self) -> int:
        """Reset the peak; what is allocated now (the base of :meth:`profile_end`)."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return base

    def profile_end(self, base: int) -> tuple[int, int, int]:
        dev = self.device
        torch.cuda.synchronize(dev)
        activations = torch.cuda.max_memory_allocated(dev) - base
        self.free_kv_cache()
        weights_and_state = torch.cuda.memory_allocated(dev)
        _, total = torch.cuda.mem_get_info(dev)
        return activations, weights_and_state, total

    # -- LoRA adapters (loom.lora) ----------------------------------------------------------------------
    def install_adapter(self, slot: int, tables: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy an adapter's tables (``loom.lora.layers.adapter_tables``) into ``slot``, between steps."""
        assert self.lora is not None, "LoRA is off (--max-loras 0)"
        self.lora.install(slot, tables)

    def clear_adapter(self, slot: int) -> None:
        assert self.lora is not None, "LoRA is off (--max-loras 0)"
        self.lora.clear(slot)

    # -- steps -------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> LaunchedStep:
        """Queue a step on the device; :meth:`finish` reads its results."""
        return self._runner().launch(plan)

    def execute_forward(self, plan: StepPlan) -> ForwardedStep:
        """Queue a step's forward; :meth:`sample` queues its sampling (the engine fills grammar
        rows in between, while the device runs the forward)."""
        return self._runner().launch_forward(plan)

    def stage_forward(self, plan: StepPlan) -> StagedForward:
        """Queue a step's inputs (its forward waits for :meth:`launch_staged`): the engine stages a
        step while the grammar rows of the step before it are still being filled."""
        return self._runner().stage_forward(plan)

    def launch_staged(self, staged: StagedForward) -> ForwardedStep:
        """Queue the forward of a step :meth:`stage_forward` staged; :meth:`sample` its sampling."""
        return self._runner().launch_staged(staged)

    def sample(self, step: ForwardedStep, bitmask: TokenBitmaskRows | None) -> LaunchedStep:
        """Queue the sampling of :meth:`execute_forward`'s step, with grammar rows filled since."""
        return self._runner().sample(step, bitmask)

    def finish(self, step: LaunchedStep) -> StepOutput:
        return self._runner().finish(step)

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the worker has no KV pool: init_kv_cache first")
        return self.runner


def _lora_kernel(device: torch.device) -> LoraKernel | None:
    """CUDA: the built-in plugins' segmented Triton kernel for the LoRA delta (one launch per
    layer, CUDA-graph capturable); elsewhere None (the torch path, grouped by adapter)."""
    if device.type != "cuda":
        return None
    import importlib

    module = importlib.import_module("loom_plugins.lora.sgmv_triton")
    return cast(LoraKernel, module.lora_shrink_expand)
