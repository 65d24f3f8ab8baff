"""FP8 experts for Mixture-of-Experts layers: what the ``fp8`` quantizer's ``get_moe_method`` serves.

Two methods, both holding a layer's experts as e4m3 codes with one float32 scale per output
channel, stacked as the fused kernels read them (``loom.layers.fused_moe.StackedWeights``:
``w13 [E, 2I, H]`` with ``w13_scale [E, 2I]``, ``w2 [E, H, I]`` with ``w2_scale [E, H]``):

- :class:`FP8CheckpointExperts`: an FP8 checkpoint's experts (compressed-tensors ``float-quantized``
  or vLLM's ``fp8``), each ``experts.N.<gate|up|down>.weight`` e4m3 beside its ``weight_scale``:
  per output channel (``[out, 1]``) or per tensor (one value, spread over the rows at load); or
  block-wise (``weight_scale_inv``, one per block of 128 x 128: DeepSeek's and Qwen3's releases),
  the grids kept as they are, the kernels scaling each K tile by its blocks;
- :class:`FP8ExpertsWhileLoading`: ``--quantize fp8`` on a bf16 / fp16 / fp32 checkpoint. Each
  expert's dense matrices are staged as they arrive and quantized (max |w| / 448 per output
  channel) as soon as the expert's parts are in: one expert's dense weights at a time, never a
  layer's, never the model's.

Numerics: weight-only (W8A16). The experts compute ``x @ (codes * scale)^T`` with the activations
in their own dtype, on every device and at every batch size: on CUDA the fused kernels convert the
codes in registers and apply the scales to the sums (``fused_moe_triton``'s ``W_SCALE``; bf16
activations dot in fp16 after a power-of-two scaling per row, exactly as the FP8 GEMV of linear
layers), elsewhere each expert with rows is dequantized in float32, rounded once to the activations'
dtype, and multiplied (``fused_experts_torch``). A checkpoint's activation scheme is the linear
layers' business: its experts' static ``input_scale`` tensors are not read (weight-only is the
more accurate of the two; the linear layers of the same checkpoint keep W8A8 from 5 rows on).

The router stays dense, as every quantizer leaves it.
"""

from __future__ import annotations

import torch
from torch import nn

from loom.layers.fused_moe import FusedMoE, StackedExpertsMethod, StackedWeights
from loom.layers.linear import WeightShapeError
from loom.layers.quantized_input import row_scales, to_e4m3
from loom.plugin_api.quantization import QuantizationError, WeightLoader, set_weight_attrs


def _layer(layer: nn.Module) -> FusedMoE:
    if not isinstance(layer, FusedMoE):
        raise TypeError(f"FP8 experts serve FusedMoE layers, not {type(layer).__name__}")
    return layer


def _buffer(layer: nn.Module, name: str) -> torch.Tensor:
    """A buffer the method registered (a dict lookup: this runs at every forward)."""
    value = layer._buffers[name]
    assert value is not None
    return value


def _codes(num_experts: int, rows: int, cols: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(num_experts, rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False)


class FP8CheckpointExperts(StackedExpertsMethod):
    """An FP8 checkpoint's experts: ``w13_weight`` / ``w2_weight`` e4m3 and their ``weight_scale``
    per output channel (``per_channel``) or per tensor, or with ``block = (bn, bk)`` one per block
    of bn rows x bk inputs (``scale_name``: ``weight_scale_inv`` in DeepSeek's and Qwen3's FP8
    releases): each expert's gate and up rows, and its down inputs, must then be whole blocks."""

    def __init__(self, per_channel: bool, block: tuple[int, int] | None = None,
                 scale_name: str = "weight_scale") -> None:
        self.per_channel = per_channel
        self.block = block
        self.scale_name = scale_name

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        inter = intermediate_size_per_partition
        checked = self._checked(layer, weight_loader)
        w13 = _codes(num_experts, 2 * inter, hidden_size)
        set_weight_attrs(w13, output_dim=0, weight_loader=checked)  # dims of one expert's [2I, H]
        layer.register_parameter("w13_weight", w13)
        w2 = _codes(num_experts, hidden_size, inter)
        set_weight_attrs(w2, input_dim=1, weight_loader=checked)  # dims of one expert's [H, I]
        layer.register_parameter("w2_weight", w2)
        nan = float("nan")  # a scale the checkpoint never gave stays NaN: process_weights_after_loading names it
        if self.block is not None:
            bn, bk = self.block
            if inter % bn or inter % bk:
                raise QuantizationError(f"FP8 {getattr(layer, 'prefix', '')}: the experts' {inter} intermediate "
                                        f"rows (this rank's) are not whole blocks of {bn} x {bk} "
                                        "(weight_block_size)")
            s13 = nn.Parameter(torch.full((num_experts, 2 * inter // bn, -(-hidden_size // bk)), nan),
                               requires_grad=False)  # gate and up rows counted in blocks
            set_weight_attrs(s13, output_dim=0, packed_dim=0, packed_factor=bn, weight_loader=weight_loader)
            s2 = nn.Parameter(torch.full((num_experts, -(-hidden_size // bn), inter // bk), nan), requires_grad=False)
            set_weight_attrs(s2, input_dim=1, packed_dim=1, packed_factor=bk, weight_loader=weight_loader)
            layer.register_parameter(f"w13_{self.scale_name}", s13)
            layer.register_parameter(f"w2_{self.scale_name}", s2)
            return
        if self.per_channel:  # the checkpoint's [out, 1] per expert
            s13 = nn.Parameter(torch.full((num_experts, 2 * inter, 1), nan), requires_grad=False)
            set_weight_attrs(s13, output_dim=0, weight_loader=weight_loader)
            s2 = nn.Parameter(torch.full((num_experts, hidden_size, 1), nan), requires_grad=False)
            set_weight_attrs(s2, weight_loader=weight_loader)  # H rows: the same on every rank
        else:  # one value per expert and part (gate, up), one per expert for down
            s13 = nn.Parameter(torch.full((num_experts, 2), nan), requires_grad=False)
            set_weight_attrs(s13, weight_loader=self._part_scale_loader(layer))
            s2 = nn.Parameter(torch.full((num_experts,), nan), requires_grad=False)
            set_weight_attrs(s2, weight_loader=weight_loader)
        layer.register_parameter("w13_weight_scale", s13)
        layer.register_parameter("w2_weight_scale", s2)

    @staticmethod
    def _checked(layer: nn.Module, weight_loader: WeightLoader) -> WeightLoader:
        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None,
                 expert_id: int | None = None) -> None:
            if loaded.dtype != torch.float8_e4m3fn:
                raise QuantizationError(f"FP8 {getattr(layer, 'prefix', '')} expert {expert_id}: a weight is "
                                        f"{loaded.dtype} in the checkpoint; expected float8_e4m3fn")
            weight_loader(param, loaded, shard_id, expert_id)

        return load

    @staticmethod
    def _part_scale_loader(layer: nn.Module) -> WeightLoader:
        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None,
                 expert_id: int | None = None) -> None:
            prefix = getattr(layer, "prefix", "")
            if expert_id is None or loaded.numel() != 1:
                raise QuantizationError(f"FP8 {prefix}: a per-tensor expert scale must be one value per expert "
                                        f"projection, got shape {tuple(loaded.shape)}")
            parts = (0, 1) if shard_id is None else (int(shard_id),)  # type: ignore[call-overload]
            for part in parts:
                param.data[expert_id, part] = loaded.reshape(()).float()

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        moe = _layer(layer)
        params = dict(moe.named_parameters(recurse=False))
        for name in (f"w13_{self.scale_name}", f"w2_{self.scale_name}"):
            value = params[name]
            missing = torch.isnan(value.reshape(value.shape[0], -1)).any(dim=1)
            if bool(missing.any()):
                expert = int(missing.nonzero()[0, 0])
                raise QuantizationError(f"FP8 {moe.prefix}: expert {expert}'s {name.split('_')[0]} {self.scale_name} "
                                        "was not in the checkpoint")
        inter = moe.intermediate_size_per_partition
        w13_scale, w2_scale = params[f"w13_{self.scale_name}"], params[f"w2_{self.scale_name}"]
        s13: torch.Tensor
        s2: torch.Tensor
        if self.block is not None:  # the kernels read the grids as they are
            s13, s2 = w13_scale.detach(), w2_scale.detach()
        elif self.per_channel:
            s13, s2 = w13_scale[..., 0], w2_scale[..., 0]
        else:
            s13 = w13_scale.repeat_interleave(inter, dim=1)  # [E, 2] -> [E, 2I]
            s2 = w2_scale[:, None].expand(moe.num_experts, moe.hidden_size)
        moe.register_buffer("w13_scale_rows", s13.detach().float().contiguous(), persistent=False)
        moe.register_buffer("w2_scale_rows", s2.detach().float().contiguous(), persistent=False)

    def stacked(self, layer: nn.Module) -> StackedWeights:
        params = layer._parameters
        w13, w2 = params["w13_weight"], params["w2_weight"]
        assert w13 is not None and w2 is not None
        return StackedWeights(w13, w2, _buffer(layer, "w13_scale_rows"), _buffer(layer, "w2_scale_rows"), self.block)


class FP8ExpertsWhileLoading(StackedExpertsMethod):
    """``--quantize fp8``: dense experts quantized one expert at a time as they load. One instance
    serves one layer (``get_moe_method`` makes one per layer): it holds that layer's staging."""

    quantizes_while_loading = True

    def __init__(self) -> None:
        # (which, expert) -> (the dense rows loaded so far, the parts in): at most one expert's
        # dense matrices wait here at a time for a checkpoint that stores an expert's parts together
        self.staged: dict[tuple[str, int], tuple[torch.Tensor, set[int]]] = {}
        self.done: set[tuple[str, int]] = set()
        self.dtype = torch.float32

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        moe = _layer(layer)
        inter = intermediate_size_per_partition
        self.dtype = params_dtype
        moe.register_buffer("w13_fp8", _codes(num_experts, 2 * inter, hidden_size).data)
        moe.register_buffer("w13_scale_rows", torch.zeros(num_experts, 2 * inter))
        moe.register_buffer("w2_fp8", _codes(num_experts, hidden_size, inter).data)
        moe.register_buffer("w2_scale_rows", torch.zeros(num_experts, hidden_size))
        # Placeholders under the dense names: the layer maps the checkpoint's per-expert (and
        # stacked) tensors onto them, and their loader stages and quantizes.
        for which, rows, cols, hints in (("w13", 2 * inter, hidden_size, {"output_dim": 0}),
                                         ("w2", hidden_size, inter, {"input_dim": 1})):
            placeholder = nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
            set_weight_attrs(placeholder, weight_loader=self._staging_loader(moe, which, rows, cols), **hints)
            moe.register_parameter(f"{which}_weight", placeholder)

    def _staging_loader(self, moe: FusedMoE, which: str, rows: int, cols: int) -> WeightLoader:
        parts = 2 if which == "w13" else 1
        buffers = dict(moe.named_buffers(recurse=False))
        codes, scales = buffers[f"{which}_fp8"], buffers[f"{which}_scale_rows"]

        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None,
                 expert_id: int | None = None) -> None:
            if expert_id is None:  # a stacked tensor [E, ...]: one expert at a time
                if loaded.dim() == 0 or loaded.shape[0] != moe.num_experts:
                    raise WeightShapeError(tuple(loaded.shape), (moe.num_experts, rows, cols))
                for e in range(moe.num_experts):
                    load(param, loaded[e], shard_id, e)
                return
            if not 0 <= expert_id < moe.num_experts:
                raise ValueError(f"{moe.prefix}: expert {expert_id} is not below {moe.num_experts}")
            key = (which, expert_id)
            staging, seen = self.staged.get(key) or (
                torch.empty(rows, cols, dtype=self.dtype, device=codes.device), set())
            moe.load_expert(staging, param, loaded, shard_id)
            seen.update(range(parts) if shard_id is None else (int(shard_id),))  # type: ignore[call-overload]
            if len(seen) < parts:
                self.staged[key] = (staging, seen)
                return
            scale = row_scales(staging, dim=1)  # [rows, 1]
            codes[expert_id].copy_(to_e4m3(staging, scale))
            scales[expert_id].copy_(scale[:, 0])
            self.staged.pop(key, None)  # the dense expert is dropped as soon as it is quantized
            self.done.add(key)

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        moe = _layer(layer)
        for name in ("w13_weight", "w2_weight"):
            moe._parameters.pop(name, None)
        if self.staged or len(self.done) != 2 * moe.num_experts:
            raise QuantizationError(f"{moe.prefix}: some experts' weights were never loaded")

    def stacked(self, layer: nn.Module) -> StackedWeights:
        return StackedWeights(_buffer(layer, "w13_fp8"), _buffer(layer, "w2_fp8"), _buffer(layer, "w13_scale_rows"),
                              _buffer(layer, "w2_scale_rows"))
