"""Physical limits: what the hardware allows for a workload, measured in the same run.

Two rates are measured on the device: copy bandwidth (bytes read + written by a large tensor copy,
per second) and dense matmul throughput in the model's dtype. A workload's limit is the least
time its unavoidable work takes at those rates:

- W1 (one sequence): each forward pass reads every weight once and the KV cache of the context so
  far; the prefill also has its FLOPs. Decode steps are bandwidth-bound, so the limit is
  sum over steps of (weight bytes + KV bytes read) / bandwidth.
- W2 (many sequences): max(total FLOPs / matmul rate, total bytes / bandwidth), where the bytes
  are the weights read once per step (at least one step per generated token of the longest
  request) plus every KV byte written and read.

Counting every weight byte per step (embedding and head included) follows WORKLOADS.md's
"16.06 GB / 4.3 TB/s = 3.7 ms a step" for llama-8b.

A Mixture-of-Experts model (issue #22) is held to what a step actually reads: the attention,
the router, the norms, the head and the experts its tokens chose, not the experts no token chose
nor the embedding table (a step reads a few of its rows). A batch of ``b`` tokens each choosing
``k`` of ``E`` experts is counted as reading ``E * (1 - (1 - k / E) ** b)`` experts per layer,
the expected number of distinct experts under uniform routing (exactly ``k`` for one token); its
FLOPs count each token's ``k`` experts.

A quantized model reads its packed weights instead (W6: int4 GPTQ / AWQ, FP8, NF4): the limits
then take the weight bytes the engine actually holds (``weight_memory``), so ``ratio_to_limit``
is the share of the int4 (or FP8...) weight-read limit; :func:`weight_read_limit` is that limit
alone (one decode step that only reads the weights).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .workloads import Workload


@dataclass(frozen=True)
class Hardware:
    device: str
    dtype: str
    copy_bytes_per_s: float
    matmul_flop_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "copy_TBps": self.copy_bytes_per_s / 1e12,
                "matmul_TFLOPs": self.matmul_flop_per_s / 1e12}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: torch.device, warmup: int, reps: int) -> float:
    """Mean seconds of ``fn()`` after ``warmup`` untimed calls (wall clock around a device sync)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / reps


def _copy_seconds(nbytes: int, device: torch.device) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return _timed(lambda: dst.copy_(src), device, 3, 10)


def _matmul_seconds(n: int, dtype: torch.dtype, device: torch.device) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return _timed(lambda: a @ b, device, 3, 10)


@torch.inference_mode()
def measure_hardware(device: torch.device, dtype: torch.dtype, quick: bool = False) -> Hardware:
    """Copy bandwidth on a tensor far larger than any cache, and an n x n x n matmul rate."""
    on_gpu = device.type == "cuda"
    copy_bytes = ((256 << 20) if quick else (4 << 30)) if on_gpu else (64 << 20)
    copy_s = _copy_seconds(copy_bytes, device)
    n = 8192 if on_gpu and not quick else (4096 if on_gpu else 1024)
    mm_s = _matmul_seconds(n, dtype, device)
    if on_gpu:
        torch.cuda.empty_cache()
    return Hardware(device=str(device), dtype=str(dtype).removeprefix("torch."),
                    copy_bytes_per_s=2 * copy_bytes / copy_s, matmul_flop_per_s=2 * n**3 / mm_s)


@dataclass(frozen=True)
class ModelCost:
    """The work one token costs, from the model's shape (counted on the meta device)."""

    weight_bytes: int  # every parameter once (tied ones once)
    body_matmul_params: int  # weights a processed token multiplies by (no embedding, no head; its k experts)
    head_params: int  # the logits projection, applied once per generated token
    num_layers: int
    num_heads: int
    head_dim: int
    kv_bytes_per_token: int  # K and V of all layers
    # Mixture of experts (0 for a dense model):
    expert_bytes: int = 0  # every expert of every layer
    num_experts: int = 0  # E per MoE layer
    experts_per_token: int = 0  # k
    embedding_bytes: int = 0  # the input embedding table when it is not the head's

    def attention_flops(self, context: int) -> int:
        """QK^T and PV of one query token over ``context`` keys, all layers and heads."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * context

    def active_expert_fraction(self, tokens: int) -> float:
        """The expected share of each layer's experts that ``tokens`` tokens choose (uniform routing)."""
        if not self.num_experts:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(1, tokens)

    def step_weight_bytes(self, tokens: int = 1) -> float:
        """Weight bytes a forward of ``tokens`` tokens reads: every weight for a dense model (the
        WORKLOADS.md convention); for an MoE model all but the unchosen experts and the embedding."""
        if not self.num_experts:
            return float(self.weight_bytes)
        idle = self.expert_bytes * (1.0 - self.active_expert_fraction(tokens))
        return self.weight_bytes - self.embedding_bytes - idle

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "decode_step_weight_bytes_batch_1": self.step_weight_bytes(1)}


def model_cost(model_dir: Path, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> ModelCost:
    from transformers import AutoConfig, AutoModelForCausalLM

    from loom.model_loader import model_dims

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    elem = torch.empty((), dtype=dtype).element_size()
    weight_bytes = body = head = expert_params = 0
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    head_weight = out.weight if out is not None else embed
    num_experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0) if num_experts else 0
    for name, p in model.named_parameters():  # tied parameters appear once
        weight_bytes += p.numel() * elem
        if num_experts and _is_expert_weight(name, p):
            expert_params += p.numel()
        elif p.dim() == 2 and p is not embed and p is not head_weight:
            body += p.numel()
    head = head_weight.numel()
    if num_experts:  # a token multiplies by its k experts only
        body += expert_params * top_k // num_experts
    dims = model_dims(config)
    return ModelCost(weight_bytes=weight_bytes, body_matmul_params=body, head_params=head,
                     num_layers=dims.num_layers, num_heads=dims.num_heads, head_dim=dims.head_dim,
                     # an FP8 pool (loom/layers/kv_fp8.py): D e4m3 codes and a float32 scale a row
                     kv_bytes_per_token=2 * dims.num_layers * dims.num_kv_heads * (
                         dims.head_dim + 4 if kv_cache_dtype in ("fp8", "fp8_e4m3") else dims.head_dim * elem),
                     expert_bytes=expert_params * elem, num_experts=num_experts, experts_per_token=top_k,
                     embedding_bytes=embed.numel() * elem if embed is not head_weight else 0)


def _is_expert_weight(name: str, param: torch.Tensor) -> bool:
    """transformers 5 stacks each layer's experts (``experts.gate_up_proj [E, 2I, H]``); 4 kept
    one module per expert (``experts.3.w1.weight``)."""
    return param.dim() == 3 or re.search(r"\.experts\.\d+\.", name) is not None


def served_cost(cost: ModelCost, weight_bytes: int, expert_bytes: int | None = None) -> ModelCost:
    """``cost`` with the bytes of the weights as served (packed int4 / e4m3 / NF4 and their scales,
    the dense embedding and head): what a quantized model reads each forward pass. An MoE model's
    ``expert_bytes`` as served (FP8 experts: codes and scales) replace the dense count, so a step
    is charged its chosen experts' served bytes (None: the experts as ``cost`` counts them)."""
    if expert_bytes is None:
        return replace(cost, weight_bytes=weight_bytes)
    return replace(cost, weight_bytes=weight_bytes, expert_bytes=expert_bytes)


def weight_read_limit(weight_bytes: int, hw: Hardware) -> dict[str, float]:
    """The fastest decode step that reads ``weight_bytes`` once (no KV, no FLOPs): the weight-read
    limit of a batch-1 decode (for int4 weights, the int4 weight-read limit)."""
    step_s = weight_bytes / hw.copy_bytes_per_s
    return {"weight_bytes": float(weight_bytes), "min_step_s": step_s, "max_decode_tok_s": 1.0 / step_s}


def _sequence_work(cost: ModelCost, prompt: int, new: int) -> tuple[float, float]:
    """(FLOPs, KV bytes written + read by decode steps) of one sequence, greedy, ``new`` tokens.

    The prompt and the first new-1 generated tokens go through the model (the last generated
    token is never fed back); each decode step reads the whole KV cache of its sequence.
    """
    fed = prompt + new - 1
    flops = 2.0 * cost.body_matmul_params * fed + 2.0 * cost.head_params * new
    flops += cost.attention_flops(1) * fed * (fed + 1) / 2  # token at position t attends to t+1 keys
    decode_reads = sum(prompt + i for i in range(1, new))  # contexts of the new-1 decode steps
    kv_bytes = cost.kv_bytes_per_token * (fed + decode_reads)
    return flops, float(kv_bytes)


def w1_limit(cost: ModelCost, hw: Hardware, w: Workload) -> dict[str, float]:
    """One sequence: prefill (FLOP- or byte-bound), then new-1 bandwidth-bound decode steps."""
    (prompt_ids, new), = w.requests
    prompt = len(prompt_ids)
    prefill_flops = 2.0 * cost.body_matmul_params * prompt + 2.0 * cost.head_params
    prefill_flops += cost.attention_flops(1) * prompt * (prompt + 1) / 2
    prefill_s = max(prefill_flops / hw.matmul_flop_per_s,
                    (cost.step_weight_bytes(prompt) + cost.kv_bytes_per_token * prompt) / hw.copy_bytes_per_s)
    step_weights = cost.step_weight_bytes(1)
    decode_bytes = sum(step_weights + cost.kv_bytes_per_token * (prompt + i) for i in range(1, new))
    decode_s = decode_bytes / hw.copy_bytes_per_s
    step_s = (step_weights + cost.kv_bytes_per_token * prompt) / hw.copy_bytes_per_s
    return {
        "min_s": prefill_s + decode_s,
        "max_out_tok_s": new / (prefill_s + decode_s),
        "min_decode_step_s": step_s,
        "max_decode_tok_s": 1.0 / step_s,
    }


def w2_limit(cost: ModelCost, hw: Hardware, w: Workload) -> dict[str, float]:
    """All at once: the slower of all FLOPs at the matmul rate and all bytes at copy bandwidth."""
    flops = kv_bytes = 0.0
    for prompt_ids, new in w.requests:
        f, b = _sequence_work(cost, len(prompt_ids), new)
        flops += f
        kv_bytes += b
    steps = max(n for _, n in w.requests)  # a request's tokens come one forward pass apart
    # Each step at best carries every request (an MoE step then reads the experts they choose).
    total_bytes = kv_bytes + steps * cost.step_weight_bytes(len(w.requests))
    flop_s = flops / hw.matmul_flop_per_s
    byte_s = total_bytes / hw.copy_bytes_per_s
    min_s = max(flop_s, byte_s)
    return {
        "flops": flops,
        "bytes": total_bytes,
        "flop_bound_s": flop_s,
        "byte_bound_s": byte_s,
        "min_s": min_s,
        "max_out_tok_s": w.output_tokens / min_s,
        "max_total_tok_s": (w.output_tokens + w.prompt_tokens) / min_s,
    }
