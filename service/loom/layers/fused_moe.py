"""A Mixture-of-Experts feed-forward layer: a router picks ``k`` experts per token, the experts
run grouped by expert, and their outputs are summed with the routing weights.

* :func:`select_experts`: softmax over the router logits in float32, top-k, renormalised to sum
  to 1 when the model says so (Mixtral always, Qwen3-MoE with ``norm_topk_prob``); the weights
  stay float32 (Mixtral) or take the logits' dtype (Qwen3-MoE), as transformers computes them.
* :class:`FusedMoE`: the experts, stacked: ``w13_weight [E, 2 * I, H]`` (each expert's gate rows
  then up rows) and ``w2_weight [E, H, I]``. Its ``weight_loader`` puts a checkpoint's
  per-expert tensors (``experts.N.w1/w3/w2`` for Mixtral, ``experts.N.gate_proj/up_proj/
  down_proj`` for Qwen3-MoE) or transformers 5's stacked ones (``experts.gate_up_proj``,
  ``experts.down_proj``) into this rank's slice; its method (``loom.plugin_api.moe``; the dense
  :class:`UnquantizedFusedMoEMethod` unless a quantization config serves the layer) keeps and
  applies them. Methods whose experts are stacked tensors the fused kernels read
  (:class:`StackedExpertsMethod`: the dense one, and the fp8 quantizer's e4m3 experts with
  scales per channel or per block) share the kernels, the routing's sort and the unsummed rows for the norm.
* :class:`SparseMoeBlock`: the router (``gate``, a dense linear layer) and the experts.

The dense experts run on CUDA as the Triton kernels of ``fused_moe_triton`` (one launch for
every expert's gate/up GEMM and one for the down GEMM, CUDA-graph capturable; at one token
straight from the routing's ids, with no sort: ``fused_moe_triton.direct_experts``), elsewhere as
:func:`fused_experts_torch`: the (token, expert) rows are sorted by expert and each expert with
rows runs once on all of them, in the same order of operations as transformers.

Tensor parallelism splits the intermediate dimension: each rank holds ``I / ranks`` of every
expert's gate, up and down, and the block sums its output over ranks.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from loom import kernel_switches
from loom.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size
from loom.plugin_api.moe import FusedMoEMethod
from loom.plugin_api.quantization import (
    QuantizationConfig,
    UnquantizedLinearMethod,
    WeightLoader,
    set_weight_attrs,
)

from . import fused_moe_triton, moe_norm_router, moe_router_gemv, moe_routing_triton
from .activation import SiluAndMul
from .dense_gemv import GemvPlan
from .linear import ReplicatedLinear, WeightShapeError, default_weight_loader, divide, load_slice
from .quantized_input import expand_block_scales

if TYPE_CHECKING:
    from .norm import RMSNorm


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(weights [T, k], expert ids [T, k] int64)``.

    transformers' order: softmax in float32, top-k of the probabilities (ties as ``torch.topk``),
    divide by their sum when ``renormalize``; then cast to ``weights_dtype`` (None: float32).
    On CUDA one Triton kernel does it all (:func:`moe_routing_triton.route`; the ids are then
    int32, what the expert kernels read).
    """
    if (router_logits.is_cuda and moe_routing_triton.HAS_TRITON and kernel_switches.fused_kernels
            and moe_routing_triton.route_supported(router_logits, top_k)):
        return moe_routing_triton.route(router_logits, top_k, renormalize, weights_dtype)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        weights = weights.to(weights_dtype)
    return weights, ids


def sort_rows_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids [T, k]`` -> ``(order [T * k], counts [E])``: the flat (token, expert) rows
    ``i = t * k + j`` ordered by expert (rows of one expert in increasing ``i``), and how many
    rows each expert has. The grouping the Triton kernels do on the device, in torch."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def dequantize_expert(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
                      block: tuple[int, int] | None = None) -> torch.Tensor:
    """One expert's matrix in ``dtype``: itself (dense), or e4m3 ``codes [out, in]`` times their
    float32 scales, computed in float32 and rounded once: ``scale [out]`` one per output channel,
    or with ``block = (bn, bk)`` ``scale [cdiv(out, bn), cdiv(in, bk)]`` one per block."""
    if scale is None:
        return codes
    if block is None:
        return (codes.float() * scale.float()[:, None]).to(dtype)
    return (codes.float() * expand_block_scales(scale, block, *codes.shape)).to(dtype)


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None, scale_block: tuple[int, int] | None = None,
                        ) -> torch.Tensor:
    """``x [T, H]`` through each token's experts, weighted and summed -> ``[T, H]``.

    Each expert that has rows runs once on all of them (two matrix products); transformers'
    rounding order: ``down(silu(gate) * up)`` in the activation dtype, times the weight (which
    may be float32), cast back, and added to the token's output expert by expert in increasing
    expert order. Reads the row counts on the host: not for CUDA graphs. ``w13_scale [E, 2I]`` /
    ``w2_scale [E, H]`` (or per block of ``scale_block``): the weights are e4m3 codes, each expert
    with rows dequantized (:func:`dequantize_expert`) for its products.
    """
    k = topk_ids.shape[1]
    order, counts = sort_rows_by_expert(topk_ids, w13.shape[0])
    token = order // k  # [T * k]: the token of each sorted row
    xs = x.index_select(0, token)  # [T * k, H]
    ys = torch.empty_like(xs)
    act = SiluAndMul()
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            rows = slice(start, start + n)
            gate_up = dequantize_expert(w13[expert], None if w13_scale is None else w13_scale[expert], x.dtype,
                                        scale_block)
            down = dequantize_expert(w2[expert], None if w2_scale is None else w2_scale[expert], x.dtype, scale_block)
            ys[rows] = F.linear(act(F.linear(xs[rows], gate_up)), down)
            start += n
    weighted = (ys * topk_weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)  # [T * k, H]
    out = torch.zeros_like(x)
    out.index_add_(0, token, weighted)
    return out


def triton_experts_supported(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve ``x`` (CUDA, triton installed, fused kernels on)."""
    return (x.is_cuda and fused_moe_triton.HAS_TRITON and kernel_switches.fused_kernels
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32))


@dataclass(frozen=True)
class StackedWeights:
    """A layer's experts as the fused kernels read them: ``w13 [E, 2I, H]``, ``w2 [E, H, I]``,
    dense in the activations' dtype (no scales) or e4m3 codes with float32 scales per output
    channel (``w13_scale [E, 2I]``, ``w2_scale [E, H]``) or, with ``block = (bn, bk)``, per block
    of bn rows x bk inputs (``[E, cdiv(2I, bn), cdiv(H, bk)]``, ``[E, cdiv(H, bn), cdiv(I, bk)]``);
    contiguous."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None


class StackedExpertsMethod(FusedMoEMethod):
    """A method whose experts are stacked tensors the fused kernels read (:meth:`stacked`): the
    dense experts, and e4m3 experts with scales per channel or per block (the fp8 quantizer's). Such a layer
    takes the routing's sort by expert, and hands its rows back unsummed to the norm after it
    (:meth:`FusedMoE.forward_uncombined`), as dense experts do."""

    @abstractmethod
    def stacked(self, layer: nn.Module) -> StackedWeights:
        """The layer's expert tensors (after ``process_weights_after_loading``)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return self.apply_sorted(layer, x, topk_weights, topk_ids, None)

    def apply_sorted(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     layout: moe_routing_triton.ExpertLayout | None) -> torch.Tensor:
        """:meth:`apply`, reusing the rows' sort by expert when the routing already made it
        (``layout``: the Triton kernels only; the torch path sorts its own)."""
        if triton_experts_supported(x):
            return self.expert_outputs(layer, x, topk_weights, topk_ids, layout).combine()
        w = self.stacked(layer)
        return fused_experts_torch(x, w.w13, w.w2, topk_weights, topk_ids, w.w13_scale, w.w2_scale, w.block)

    def expert_outputs(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       layout: moe_routing_triton.ExpertLayout | None) -> fused_moe_triton.ExpertOutputs:
        """The experts' rows before their weighted sum (Triton kernels only: where
        :func:`triton_experts_supported`)."""
        w = self.stacked(layer)
        return fused_moe_triton.expert_outputs_triton(x, w.w13, w.w2, topk_weights, topk_ids, layout=layout,
                                                      w13_scale=w.w13_scale, w2_scale=w.w2_scale,
                                                      scale_block=w.block)


class UnquantizedFusedMoEMethod(StackedExpertsMethod):
    """Dense experts in the model's dtype: ``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]``."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        inter = intermediate_size_per_partition
        w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(w13, output_dim=0, weight_loader=weight_loader)  # dims of one expert's [2I, H]
        layer.register_parameter("w13_weight", w13)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(w2, input_dim=1, weight_loader=weight_loader)  # dims of one expert's [H, I]
        layer.register_parameter("w2_weight", w2)

    def stacked(self, layer: nn.Module) -> StackedWeights:
        return StackedWeights(layer.w13_weight, layer.w2_weight)  # type: ignore[arg-type]


def _stored(param: torch.Tensor, dim: int, n: int) -> int:
    """``n`` logical values along ``dim`` of one expert -> elements of ``param`` holding them."""
    if getattr(param, "packed_dim", None) != dim:
        return n
    factor = int(param.packed_factor)  # type: ignore[attr-defined]
    if n % factor:
        raise ValueError(f"{n} values along dimension {dim} do not fill whole packs of {factor}")
    return n // factor


# (parameter name in the layer, part of w13 (0 gate, 1 up) or None, expert or None for all)
CheckpointTarget = tuple[str, Any, int | None]


class FusedMoE(nn.Module):
    """The experts of one MoE layer, stacked, built for one tensor-parallel rank.

    ``checkpoint_names``: the checkpoint's module names of an expert's gate, up and down
    projections (``("w1", "w3", "w2")`` for Mixtral). The model's loader asks
    :meth:`checkpoint_targets` which checkpoint tensor goes where.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.prefix = prefix
        self.checkpoint_names = checkpoint_names
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size,
                                                      f"{prefix or 'an MoE layer'}'s intermediate size")
        getter = getattr(quant_config, "get_moe_method", None)
        method: FusedMoEMethod | None = getter(self, prefix) if getter is not None else None
        self.quant_method: FusedMoEMethod = method or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, num_experts, hidden_size, self.intermediate_size_per_partition,
                                         params_dtype or torch.get_default_dtype(), self.weight_loader)

    # -- loading ------------------------------------------------------------------------------------

    def checkpoint_targets(self, prefix: str) -> tuple[dict[str, CheckpointTarget],
                                                       dict[str, tuple[CheckpointTarget, list[str]]]]:
        """(required, alternatives) for this layer registered at ``prefix``.

        ``required``: every per-expert checkpoint name -> where it loads (``experts.3.w1.weight``
        -> ``("w13_weight", 0, 3)``). ``alternatives``: transformers 5's stacked names
        (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) -> where they load and the
        required names each stands for.
        """
        gate, up, down = self.checkpoint_names
        required: dict[str, CheckpointTarget] = {}
        per_param: dict[str, list[str]] = {}
        for name, _ in self.named_parameters(recurse=False):
            part, _, leaf = name.partition("_")
            names = per_param.setdefault(name, [])
            for e in range(self.num_experts):
                if part == "w13":
                    for shard, module in ((0, gate), (1, up)):
                        key = f"{prefix}.{e}.{module}.{leaf}"
                        required[key] = (name, shard, e)
                        names.append(key)
                elif part == "w2":
                    key = f"{prefix}.{e}.{down}.{leaf}"
                    required[key] = (name, None, e)
                    names.append(key)
                else:
                    raise ValueError(f"{prefix}: MoE parameter {name!r} is neither w13_* nor w2_*")
        alternatives: dict[str, tuple[CheckpointTarget, list[str]]] = {}
        if "w13_weight" in per_param:
            alternatives[f"{prefix}.gate_up_proj"] = (("w13_weight", None, None), per_param["w13_weight"])
        if "w2_weight" in per_param:
            alternatives[f"{prefix}.down_proj"] = (("w2_weight", None, None), per_param["w2_weight"])
        return required, alternatives

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None,
                      expert_id: int | None = None) -> None:
        """A checkpoint tensor into this rank's slice of ``param``.

        ``expert_id`` None: ``loaded_weight`` holds every expert (``[E, ...]``). For ``w13_*``,
        ``shard_id`` 0 (gate) or 1 (up) loads one part, None both (``[gate | up]`` rows).
        """
        if expert_id is None:
            if loaded_weight.dim() == 0 or loaded_weight.shape[0] != self.num_experts:
                raise WeightShapeError(tuple(loaded_weight.shape), tuple(param.shape))
            for e in range(self.num_experts):
                self.weight_loader(param, loaded_weight[e], shard_id, e)
            return
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{self.prefix}: expert {expert_id} is not below {self.num_experts}")
        self.load_expert(param.data[expert_id], param, loaded_weight, shard_id)

    def load_expert(self, dst: torch.Tensor, param: torch.Tensor, loaded_weight: torch.Tensor,
                    shard_id: object = None) -> None:
        """One expert's checkpoint tensor into ``dst`` (that expert's slice of ``param``, or a
        buffer of its shape: a method that quantizes while loading stages there), this rank's
        part as ``param``'s hints (``output_dim``, ``input_dim``, packing) say."""
        inter, inter_p = self.intermediate_size, self.intermediate_size_per_partition
        out_dim, in_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
        if out_dim is not None:  # w13: gate and up rows
            if shard_id is None:
                stored = _stored(param, out_dim, inter)
                if loaded_weight.shape[out_dim] != 2 * stored:
                    raise WeightShapeError(tuple(loaded_weight.shape), tuple(dst.shape))
                for shard, part in enumerate(loaded_weight.split(stored, dim=out_dim)):
                    self.load_expert(dst, param, part, shard)
                return
            if shard_id not in (0, 1):
                raise ValueError(f"{self.prefix}: shard id {shard_id!r} is not 0 (gate) or 1 (up)")
            rows = dst.narrow(out_dim, _stored(param, out_dim, int(shard_id) * inter_p), _stored(param, out_dim, inter_p))
            load_slice(rows, loaded_weight, out_dim, _stored(param, out_dim, self.tp_rank * inter_p),
                       _stored(param, out_dim, inter))
        elif in_dim is not None:  # w2: this rank's columns of the down projection
            load_slice(dst, loaded_weight, in_dim, _stored(param, in_dim, self.tp_rank * inter_p),
                       _stored(param, in_dim, inter))
        else:  # a per-expert value, the same on every rank
            default_weight_loader(dst, loaded_weight.reshape(dst.shape) if loaded_weight.numel() == dst.numel()
                                  else loaded_weight)

    # -- forward ------------------------------------------------------------------------------------

    def sorts_in_routing(self, x: torch.Tensor) -> bool:
        """Whether the routing should sort the rows for these experts (``forward``'s ``layout``):
        stacked experts (dense or FP8) on the Triton kernels; another quantization method sorts its own."""
        return isinstance(self.quant_method, StackedExpertsMethod) and triton_experts_supported(x)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                layout: moe_routing_triton.ExpertLayout | None = None) -> torch.Tensor:
        """``[T, H] -> [T, H]``, this rank's part. ``layout``: the rows already sorted by expert
        (only where :meth:`sorts_in_routing`)."""
        if layout is not None and isinstance(self.quant_method, StackedExpertsMethod):
            return self.quant_method.apply_sorted(self, x, topk_weights, topk_ids, layout)
        return self.quant_method.apply(self, x, topk_weights, topk_ids)

    def forward_uncombined(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           layout: moe_routing_triton.ExpertLayout | None) -> fused_moe_triton.ExpertOutputs:
        """:meth:`forward` before the weighted sum (only where :meth:`sorts_in_routing`)."""
        if not isinstance(self.quant_method, StackedExpertsMethod):
            raise TypeError(f"{self.prefix}: {type(self.quant_method).__name__} sums its own experts")
        return self.quant_method.expert_outputs(self, x, topk_weights, topk_ids, layout)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size_per_partition}, tp={self.tp_rank}/{self.tp_size}, "
                f"method={type(self.quant_method).__name__}")


class SparseMoeBlock(nn.Module):
    """Router + experts: ``x [T, H] -> [T, H]``.

    ``weights_in_logits_dtype``: cast the routing weights to the router logits' dtype (Qwen3-MoE)
    instead of keeping them in float32 (Mixtral).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool, weights_in_logits_dtype: bool = False,
                 checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: top_k {top_k} is not between 1 and the {num_experts} experts")
        self.top_k, self.renormalize = top_k, renormalize
        self.weights_in_logits_dtype = weights_in_logits_dtype
        # The router stays dense: quantizers leave it alone (it is small and decides everything).
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, quant_config=None, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, checkpoint_names=checkpoint_names,
                                quant_config=quant_config, prefix=f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        out = self._forward(x, uncombined=False)
        assert isinstance(out, torch.Tensor)
        return out

    def forward_uncombined(self, x: torch.Tensor) -> torch.Tensor | fused_moe_triton.ExpertOutputs:
        """:meth:`forward`, except that where the Triton experts serve one rank the experts' rows
        come back before their weighted sum, for the residual add + norm that follows the layer
        to sum them (``RMSNorm.forward_with_residual``: one launch fewer); otherwise the same
        tensor as :meth:`forward`. The sum is the same either way, bit for bit."""
        return self._forward(x, uncombined=True)

    def forward_with_norm(self, x: torch.Tensor, residual: torch.Tensor,
                          norm: RMSNorm) -> tuple[torch.Tensor | fused_moe_triton.ExpertOutputs, torch.Tensor]:
        """``h = residual + x``, then ``(forward_uncombined(norm(h)), h)``: the residual add and norm
        before the block (a decoder's post-attention norm) and the block, ``x, residual [T, H]``.
        Where the norm runs its Triton kernel and the router its fused epilogue (1-4 tokens on
        CUDA, ``moe_norm_router.norm_router_plan``), one launch does the norm, the router and the
        routing (``LOOM_MOE_NORM_ROUTER=0``: two); the same bits either way."""
        plan = self._fused_norm_router_plan(x, residual, norm)
        if plan is None:
            hidden, residual = norm.forward_with_residual(x, residual)
            return self.forward_uncombined(hidden), residual
        weights_dtype = x.dtype if self.weights_in_logits_dtype else None  # (the logits' dtype)
        hidden, residual, weights, ids = moe_norm_router.norm_route(
            x, residual, norm.weight, norm.eps, self.gate.weight, self.top_k,  # type: ignore[arg-type]
            self.renormalize, weights_dtype, plan)
        return self._run_experts(hidden, weights, ids, None, uncombined=True), residual

    def _plain_router(self) -> bool:
        """Whether the router is a plain dense layer (no quantization, bias or adapter): what the
        fused router kernels compute."""
        gate = self.gate
        return gate.bias is None and gate.lora is None and type(gate.quant_method) is UnquantizedLinearMethod

    def _sorts_in_routing(self, x: torch.Tensor) -> bool:
        """Decode sizes with LOOM_MOE_ONE_LAUNCH_ROUTING=1: the routing also sorts, from the logits."""
        return (self.experts.sorts_in_routing(x) and moe_routing_triton.ONE_LAUNCH_ROUTING
                and not fused_moe_triton.direct_experts(x.shape[0]))

    def _fused_norm_router_plan(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> GemvPlan | None:
        """The router's GEMV plan for the norm + router kernel, or None: where :meth:`_forward`
        would take the router's fused epilogue, and the norm's operands fit."""
        if self._sorts_in_routing(x) or not self._plain_router():
            return None
        return moe_norm_router.norm_router_plan(x, residual, norm.weight, self.gate.weight,  # type: ignore[arg-type]
                                                self.top_k)

    def _fused_router_plan(self, x: torch.Tensor) -> GemvPlan | None:
        """The dense GEMV plan on which the router runs with the routing in its epilogue
        (``moe_router_gemv``: one launch where two run), or None: the router is a plain dense
        layer here (no quantization, bias or adapter), and the pieces fit."""
        if not self._plain_router():
            return None
        return moe_router_gemv.fused_router_plan(x, self.gate.weight, self.top_k)  # type: ignore[arg-type]

    def _forward(self, x: torch.Tensor, uncombined: bool) -> torch.Tensor | fused_moe_triton.ExpertOutputs:
        sorts_in_routing = self._sorts_in_routing(x)
        plan = None if sorts_in_routing else self._fused_router_plan(x)
        layout = None
        if plan is not None:  # router and routing in one launch
            weights_dtype = x.dtype if self.weights_in_logits_dtype else None  # (the logits' dtype)
            weights, ids = moe_router_gemv.route_from_hidden(x, self.gate.weight,  # type: ignore[arg-type]
                                                             self.top_k, self.renormalize, weights_dtype, plan)
        else:
            router_logits = self.gate(x)  # [T, E], in the model's dtype
            weights_dtype = router_logits.dtype if self.weights_in_logits_dtype else None
            if sorts_in_routing and moe_routing_triton.fused_route_supported(router_logits, self.top_k):
                # Route and sort the rows by expert in one launch (where three run).
                block_m = fused_moe_triton.block_config(x.shape[0] * self.top_k, self.experts.num_experts,
                                                        x.dtype).block_m
                weights, ids, layout = moe_routing_triton.route_and_sort(router_logits, self.top_k, self.renormalize,
                                                                         block_m, weights_dtype)
            else:
                weights, ids = select_experts(router_logits, self.top_k, self.renormalize, weights_dtype)
        return self._run_experts(x, weights, ids, layout, uncombined)

    def _run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     layout: moe_routing_triton.ExpertLayout | None,
                     uncombined: bool) -> torch.Tensor | fused_moe_triton.ExpertOutputs:
        """The experts on the routed rows: their rows before the weighted sum where ``uncombined``
        and the Triton experts serve one rank, else the summed output (over the ranks)."""
        if uncombined and self.experts.tp_size == 1 and self.experts.sorts_in_routing(x):
            return self.experts.forward_uncombined(x, weights, ids, layout)
        out = self.experts(x, weights, ids, layout)
        return out if self.experts.tp_size == 1 else all_reduce(out)
