"""Switches of Loom's own fused kernels, read once from the environment when Loom is imported.

``LOOM_FUSED_KERNELS=0`` keeps every layer on its plain torch path (the Triton kernels on CUDA and
the fused CPU operators alike): for an operator who suspects a kernel, and as the reference the
kernels are tested against. The layers read :data:`fused_kernels`, a plain module attribute, on
each call: no environment lookup in the hot path. Tests and benchmarks switch it with
:func:`fused_kernels_off` (or by setting the attribute).

Two narrower switches, read the same way:

- ``LOOM_DENSE_GEMV`` (:data:`dense_gemv`): ``table`` (default) runs dense bf16 / fp16 linear
  layers of 1-4 rows on Loom's Triton GEMV for the shapes its measured table names
  (``loom.layers.dense_gemv_table``), ``0`` / ``off`` keeps them all on cuBLAS, ``all`` uses the
  GEMV for every shape (measurements).
- ``LOOM_FP8_GEMV=0`` (:data:`fp8_gemv`): FP8-weight layers (``--quantize fp8``, FP8
  checkpoints) of 1-4 rows keep the W8A8 path (per-token activation quantization, then
  ``torch._scaled_mm``) instead of the weight-only GEMV (``loom_plugins.quant.fp8_gemv``).
- ``LOOM_FP8_FAST_ACCUM=0`` (:data:`fp8_fast_accum`, on by default since session 34 measured it):
  FP8 layers' ``torch._scaled_mm`` (W8A8, 5 rows and more) promotes its partial sums to float32
  every 128 inputs instead of accumulating in the tensor cores' own format throughout
  (``use_fast_accum``, as vLLM's CUTLASS FP8 kernels do on Hopper). Fast accumulation made W2 FP8
  1.05x faster on an H100; its accumulation error stays an order of magnitude below e4m3's own
  rounding (docs/quantization.md, "FP8 fast accumulation").
- ``LOOM_FUSED_INPUT_QUANT=0`` (:data:`fused_input_quant`): FP8 layers (W8A8) quantize their own
  input instead of taking it quantized from the RMSNorm or SiLU-and-mul kernel that made it
  (``loom.layers.quantized_input``; the same codes bit for bit, one pass and one launch fewer).
- ``LOOM_PAGED_DECODE_TABLE=0`` (:data:`paged_decode_table`): the paged attention's decode
  launches keep the split rule written before measurement instead of the measured table
  (``loom_plugins.attention.decode_plan_table``).
- ``LOOM_DRAFT_CATCH_UP_GRAPHS=0`` (:data:`draft_catch_up_graphs`, read when a draft model is
  built): its catch-up steps run eagerly instead of replaying CUDA graphs of 16 to 128 rows a
  sequence (``loom_plugins.speculative.draft_catch_up``, on by default since the H200 measured
  it: W5 b's engine reached 0.98 of the cost model with it, 0.82-0.91 without;
  docs/speculative.md).
- ``LOOM_MOE_DIRECT_EXPERTS=0`` (:data:`moe_direct_experts`): a one-token step's MoE experts
  keep the sort by expert (two launches, ``moe_routing_triton.align_rows_by_expert``) instead
  of indexing each chosen expert straight from the routing's ids
  (``loom.layers.fused_moe_triton.direct_experts``; the same results bit for bit).
- ``LOOM_MOE_ROUTER_EPILOGUE=0`` (:data:`moe_router_epilogue`): an MoE layer's router and its
  routing stay two launches (the dense GEMV, then ``moe_routing_triton.route``) where the
  router's GEMV would route in its last program (``loom.layers.moe_router_gemv``; the same bits).
- ``LOOM_MOE_NORM_ROUTER=0`` (:data:`moe_norm_router`): the residual add + RMSNorm before an MoE
  layer and its router with the routing stay two launches (``fused_ops.fused_add_rms_norm``, then
  the router as ``LOOM_MOE_ROUTER_EPILOGUE`` says) where the router's grid would recompute the
  norm itself (``loom.layers.moe_norm_router``, 1-4 tokens; the same bits). Off with
  ``LOOM_MOE_ROUTER_EPILOGUE=0`` too (the norm rides on that kernel).
- ``LOOM_GREEDY_KERNEL=0`` (:data:`greedy_kernel`): a step whose rows are all greedy, with no
  alternatives asked for, picks its tokens with the six torch launches of the general sampler
  instead of one Triton launch (``loom.sample.greedy_triton``; CUDA only: the same tokens, the
  logprobs within a few ulps).
- ``LOOM_ROPE_STORE=0`` (:data:`rope_store`): a layer's RoPE (with Qwen3's / Gemma 3's per-head
  norms) runs in its own kernel and the paged backend then writes K/V in another, instead of one
  kernel rotating q and k and writing the rotated K and V into the pool (``rope_store`` in
  ``plugins/attention/triton_kernels.py``; the same bits).
- ``LOOM_PDL=0`` (:data:`pdl`; on by default since the H200 measured it, 2026-12-03: W1 1.015x
  bf16, 1.026x FP8, 1.086x int4, 1.027x Qwen3-30B-A3B): the decode path's Triton kernels are
  launched without Programmatic Dependent Launch. On, on GPUs of compute capability 9 and later
  (``loom.layers.triton_jit.pdl_launch``), a kernel may be scheduled while the one before it
  finishes and waits (``griddepcontrol.wait``) before reading anything. Off, every kernel
  compiles and launches exactly as without the switch (docs/gpu-kernels.md, "Programmatic
  Dependent Launch").
- ``LOOM_GRAMMAR_FAST_ROWS=0`` (:data:`grammar_fast_rows`, read when the structured-output
  driver is built): its bitmask rows and accepted tokens take the plain path (a fill per row
  set, an ``is_terminated`` query per row, no sharing of masks between matchers in the same
  state), the reference the fast path is tested against (docs/structured-output.md).
- ``LOOM_GRAMMAR_ROWS_REGISTERED=0`` (:data:`grammar_rows_registered`): the grammar process's
  shared bitmask rows are not page-locked for the GPU, so each step's rows are copied into the
  stager's pinned buffers on the host thread before their transfer (393 KB at 64 rows of a
  49,152-token vocabulary), as before 2026-12-06.
- ``LOOM_STAGE_BEFORE_ROWS=0`` (:data:`stage_before_rows`): with a grammar process, the engine
  queues the next step's inputs and builds its sampling batch only after it has waited for the
  previous step's grammar rows and queued that step's sampling, as before 2026-12-06. By default
  (on) it stages them first and waits after, so the wait for the rows (0.11-0.23 ms a step in S1
  on an H100) overlaps that host work; the forward is launched after the sampling either way
  (its pending rows take those tokens). S1 on an H100, four alternating runs of 16 pairs each way:
  0.887x on against 0.832x off, higher in every adjacent pair (docs/structured-output.md).
  Single-device engines only.
- ``LOOM_GRAMMAR_DEVICE_WAIT=1`` (:data:`grammar_device_wait`, off by default until a GPU run
  measures it): with one grammar process and page-locked rows on CUDA, the engine queues a
  step's sampling without waiting for the child's rows; the stream waits for them instead, on a
  word the child writes after them (``cuStreamWaitValue32``, :mod:`loom.worker.stream_wait`),
  and the engine reads the child's reply only before it waits for the step's tokens. Where the
  rows are not page-locked (the CPU), the engine waits for the reply where it takes the rows, as
  without the switch, but through the same protocol (docs/structured-output.md).
- ``LOOM_GRAMMAR_SPIN_US`` (:data:`grammar_spin_us`; 0 by default: an H100 host measured no gain
  from 2,000 in session 49, as sessions 36 and 38 measured none): how long the engine's thread polls for the grammar process's rows, and the grammar process
  (while constrained sequences are live) for the engine's next step, before either blocks in
  the kernel. A blocked process is woken tens of microseconds after its message arrives, twice a
  constrained step (docs/structured-output.md, "Polling instead of sleeping").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

fused_kernels: bool = os.environ.get("LOOM_FUSED_KERNELS", "1") != "0"

# ``LOOM_FP8_KV_KERNEL=0``: attention over an FP8 KV pool (``--kv-cache-dtype fp8``) runs the
# generic paged kernel's FP8 path (codes converted to the query's dtype through float32) instead
# of the fp16-dot kernel of ``plugins/attention/triton_fp8_attention.py``. Both read the same pool.
fp8_kv_kernel: bool = os.environ.get("LOOM_FP8_KV_KERNEL", "1") != "0"


def _dense_gemv_mode(value: str) -> str:
    value = value.strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return "all" if value == "all" else "table"


dense_gemv: str = _dense_gemv_mode(os.environ.get("LOOM_DENSE_GEMV", "table"))
fp8_gemv: bool = os.environ.get("LOOM_FP8_GEMV", "1") != "0"
fp8_fast_accum: bool = os.environ.get("LOOM_FP8_FAST_ACCUM", "1") not in ("0", "off", "false", "no")
fused_input_quant: bool = os.environ.get("LOOM_FUSED_INPUT_QUANT", "1") not in ("0", "off", "false", "no")
paged_decode_table: bool = os.environ.get("LOOM_PAGED_DECODE_TABLE", "1") != "0"
draft_catch_up_graphs: bool = os.environ.get("LOOM_DRAFT_CATCH_UP_GRAPHS", "1") != "0"
moe_direct_experts: bool = os.environ.get("LOOM_MOE_DIRECT_EXPERTS", "1") != "0"
moe_router_epilogue: bool = os.environ.get("LOOM_MOE_ROUTER_EPILOGUE", "1") != "0"
moe_norm_router: bool = os.environ.get("LOOM_MOE_NORM_ROUTER", "1") != "0"
greedy_kernel: bool = os.environ.get("LOOM_GREEDY_KERNEL", "1") != "0"
rope_store: bool = os.environ.get("LOOM_ROPE_STORE", "1") != "0"
grammar_fast_rows: bool = os.environ.get("LOOM_GRAMMAR_FAST_ROWS", "1") != "0"
pdl: bool = os.environ.get("LOOM_PDL", "1") not in ("0", "off", "false", "no")
grammar_rows_registered: bool = os.environ.get("LOOM_GRAMMAR_ROWS_REGISTERED", "1") not in ("0", "off", "false", "no")
stage_before_rows: bool = os.environ.get("LOOM_STAGE_BEFORE_ROWS", "1") not in ("0", "off", "false", "no")
grammar_device_wait: bool = os.environ.get("LOOM_GRAMMAR_DEVICE_WAIT", "0") not in ("0", "off", "false", "no")


def _grammar_spin_us(value: str) -> int:
    if not value.strip():
        return 0
    try:
        spin = int(value)
    except ValueError:
        raise ValueError(f"LOOM_GRAMMAR_SPIN_US={value!r}: expected a whole number of microseconds (0: off)") from None
    if spin < 0:
        raise ValueError(f"LOOM_GRAMMAR_SPIN_US={value!r}: expected 0 or more microseconds")
    return spin


def _spin_or_off() -> int:
    # A bad value must not fail the import (a traceback in whichever process imports this first):
    # ``loom serve`` and ``loom bench`` refuse it in one sentence (check_environment(), from
    # loom.preflight) before anything loads.
    try:
        return _grammar_spin_us(os.environ.get("LOOM_GRAMMAR_SPIN_US", ""))
    except ValueError:
        return 0


grammar_spin_us: int = _spin_or_off()


def check_environment() -> None:
    """Raise ValueError (one sentence naming the variable) for a switch whose value is not one it
    takes. ``loom.preflight.check_engine_config`` calls it, so ``loom serve`` and ``loom bench``
    refuse the value before anything loads."""
    _grammar_spin_us(os.environ.get("LOOM_GRAMMAR_SPIN_US", ""))


@contextlib.contextmanager
def fused_kernels_off() -> Iterator[None]:
    """Run the layers' plain torch code inside the block."""
    global fused_kernels
    before, fused_kernels = fused_kernels, False
    try:
        yield
    finally:
        fused_kernels = before
