"""Single quantized linear layers, built the way the loader builds them (a linear method creates the
parameters, the checkpoint tensors go through their weight loaders part by part, then
``process_weights_after_loading``), on any device: the GPU kernel tests compare a layer on CUDA
with the same layer on the CPU, whose dequantizing path is the reference.

Checkpoint tensors are made with Loom's writers (round to nearest; the packed formats themselves
are checked bit for bit against independent packers and readers in tests/unit/test_quant_formats.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loom.layers.linear import MergedColumnParallelLinear
from loom.plugin_api.quantization import LinearMethod, QuantizationConfig

# llama-8b's linear layers: (name, input size, output parts)
LLAMA_8B_SHAPES: list[tuple[str, int, list[int]]] = [
    ("qkv_proj", 4096, [4096, 1024, 1024]),
    ("o_proj", 4096, [4096]),
    ("gate_up_proj", 4096, [14336, 14336]),
    ("down_proj", 14336, [4096]),
]


class OneMethod(QuantizationConfig):
    """A config that serves every layer with the method ``make()`` returns."""

    def __init__(self, make: Callable[[], LinearMethod]) -> None:  # no model directory: nothing to read
        self.packed_modules_mapping = {}
        self.make = make

    @classmethod
    def for_checkpoint(cls, model_dir: Any) -> bool:
        return False

    def get_linear_method(self, layer: Any, prefix: str) -> LinearMethod | None:
        return self.make()


@dataclass
class Scheme:
    """A quantization of a layer: the method to build and each part's checkpoint tensors."""

    name: str
    make_method: Callable[[], LinearMethod]
    part_tensors: Callable[[torch.Tensor], dict[str, torch.Tensor]]  # a part's dense weight -> its tensors
    while_loading: bool = False  # the method takes the dense weight itself


def gptq_scheme(group: int, act_order: bool = False, bits: int = 4, sym: bool = True, seed: int = 0) -> Scheme:
    from loom_plugins.quant.gptq import GPTQLinearMethod, GPTQSettings
    from loom_plugins.quant.make.group_quant import QuantizedLinear, rtn
    from loom_plugins.quant.make.writers import gptq_tensors

    settings = GPTQSettings(bits=bits, group_size=group, desc_act=act_order, sym=sym, checkpoint_format="gptq")

    def tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
        if not act_order:
            return _strip(gptq_tensors("x", rtn(w, bits, group, sym=sym, min_zero=1)))
        # act-order: quantize the inputs in a random order, groups of that order (as GPTQ records them)
        g = torch.Generator().manual_seed(seed + w.shape[0])
        perm = torch.randperm(w.shape[1], generator=g)
        ql = rtn(w[:, perm], bits, group, sym=sym, min_zero=1)
        inverse = torch.argsort(perm)
        g_idx = torch.empty(w.shape[1], dtype=torch.int32)
        g_idx[perm] = ql.g_idx
        return _strip(gptq_tensors("x", QuantizedLinear(ql.codes[:, inverse], ql.scales, ql.zeros, g_idx, bits)))

    name = f"gptq-{bits}b-g{group}{'-act' if act_order else ''}{'' if sym else '-asym'}"
    return Scheme(name, lambda: GPTQLinearMethod(settings), tensors)


def awq_scheme(group: int) -> Scheme:
    from loom_plugins.quant.awq import AWQLinearMethod
    from loom_plugins.quant.make.group_quant import rtn
    from loom_plugins.quant.make.writers import awq_tensors

    return Scheme(f"awq-g{group}", lambda: AWQLinearMethod(4, group),
                  lambda w: _strip(awq_tensors("x", rtn(w, 4, group, sym=False))))


def wna16_scheme(group: int, sym: bool = True, act_order: bool = False, bits: int = 4, seed: int = 0) -> Scheme:
    """compressed-tensors pack-quantized (bf16 scales, as LLM Compressor saves a bf16 model's),
    packed by the tests' own NumPy packer (the format's fidelity is checked against
    compressed-tensors' packer on the CPU, in test_quant_formats.py; the GPU machine does not have
    it); ``act_order``: a ``weight_g_idx`` of a random input order (``actorder: group``)."""
    import numpy as np

    from helpers.quant_checkpoints import np_pack_words
    from loom_plugins.quant.compressed_int import WNA16LinearMethod, WNA16Settings
    from loom_plugins.quant.make.group_quant import rtn

    def pack_to_int32(values: torch.Tensor, bits: int, packed_dim: int = 1) -> torch.Tensor:
        unsigned = (values.to(torch.int64) + (1 << (bits - 1))).numpy().astype(np.int64)  # as stored
        return torch.from_numpy(np_pack_words(unsigned, bits, axis=packed_dim))

    settings = WNA16Settings(bits=bits, group_size=group, sym=sym, actorder="group" if act_order else None)
    half = 1 << (bits - 1)

    def tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
        perm = torch.arange(w.shape[1])
        if act_order:
            perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed + w.shape[0]))
        ql = rtn(w[:, perm], bits, group, sym=sym, min_zero=1)
        inverse = torch.argsort(perm)
        out = {"weight_packed": pack_to_int32((ql.codes[:, inverse] - half).to(torch.int8), bits),
               "weight_scale": ql.scales.to(torch.bfloat16)}
        if not sym:
            out["weight_zero_point"] = pack_to_int32((ql.zeros - half).to(torch.int8), bits, packed_dim=0)
        if act_order:
            g_idx = torch.empty(w.shape[1], dtype=torch.int32)
            g_idx[perm] = ql.g_idx.to(torch.int32)
            out["g_idx"] = g_idx
        return out

    name = f"wna16-{bits}b-g{group}{'-act' if act_order else ''}{'' if sym else '-asym'}"
    return Scheme(name, lambda: WNA16LinearMethod(settings), tensors)


def nf4_scheme() -> Scheme:
    from loom_plugins.quant.make.writers import nf4_tensors
    from loom_plugins.quant.nf4 import NF4CheckpointMethod, NF4Config

    rename = NF4Config.rename_checkpoint_tensor

    def tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
        raw = nf4_tensors("x", w, torch.float32)
        return {rename(None, k).removeprefix("x."): v for k, v in raw.items()}  # type: ignore[arg-type]

    return Scheme("nf4", lambda: NF4CheckpointMethod(double_quant=False), tensors)


def bnb_nf4_scheme(double_quant: bool) -> Scheme:
    """NF4 packed by bitsandbytes itself (on the CPU), as transformers saves it."""
    import bitsandbytes.functional as bnbf

    from loom_plugins.quant.nf4 import NF4CheckpointMethod, NF4Config

    rename = NF4Config.rename_checkpoint_tensor

    def tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, state = bnbf.quantize_4bit(w.float(), blocksize=64, quant_type="nf4", compress_statistics=double_quant)
        raw = {"x.weight": packed, **{f"x.weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
        return {rename(None, k).removeprefix("x."): v for k, v in raw.items()}  # type: ignore[arg-type]

    return Scheme(f"bnb-nf4{'-dq' if double_quant else ''}", lambda: NF4CheckpointMethod(double_quant), tensors)


def bnb_reference(weights: list[torch.Tensor], double_quant: bool) -> torch.Tensor:
    """bitsandbytes' own dequantization of what :func:`bnb_nf4_scheme` packs: ``W [N, K]`` float32."""
    import bitsandbytes.functional as bnbf

    parts = []
    for w in weights:
        packed, state = bnbf.quantize_4bit(w.float(), blocksize=64, quant_type="nf4", compress_statistics=double_quant)
        parts.append(bnbf.dequantize_4bit(packed, state).float())
    return torch.cat(parts)


def fp8_scheme(per_channel: bool, static: bool) -> Scheme:
    from loom_plugins.quant.fp8 import FP8_MAX, FP8LinearMethod, FP8Scheme, quantize_fp8

    def tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
        amax = w.float().abs().amax(dim=1, keepdim=True) if per_channel else w.float().abs().amax().reshape(())
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        out = {"weight": quantize_fp8(w, scale), "weight_scale": scale}
        if static:
            out["input_scale"] = torch.tensor(0.02 + 0.001 * (w.shape[0] % 7), dtype=torch.float32)
        return out

    scheme = FP8Scheme(per_channel=per_channel, activations="static" if static else "dynamic")
    return Scheme(f"fp8-{'channel' if per_channel else 'tensor'}-{'static' if static else 'dynamic'}",
                  lambda: FP8LinearMethod(scheme), tensors)


def while_loading_scheme(name: str) -> Scheme:
    """``--quantize fp8 / nf4`` on a dense checkpoint, or gptq / awq on a random-weight model."""
    from loom_plugins.quant.fp8 import FP8WhileLoadingMethod
    from loom_plugins.quant.int_while_loading import AWQWhileLoadingMethod, GPTQWhileLoadingMethod
    from loom_plugins.quant.nf4 import NF4WhileLoadingMethod

    makers: dict[str, Callable[[], LinearMethod]] = {
        "fp8": FP8WhileLoadingMethod, "nf4": NF4WhileLoadingMethod,
        "gptq": lambda: GPTQWhileLoadingMethod(128), "awq": lambda: AWQWhileLoadingMethod(128)}
    return Scheme(f"{name}-while-loading", makers[name], lambda w: {"weight": w}, while_loading=True)


def _strip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("x."): v for k, v in tensors.items()}


def dense_parts(in_features: int, parts: list[int], seed: int) -> list[torch.Tensor]:
    """Each part's dense weight ``[rows, in]`` (float32, std 0.02, a few larger channels)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows in parts:
        w = torch.randn(rows, in_features, generator=g) * 0.02
        w[:, :: max(1, in_features // 16)] *= 4  # some inputs with larger weights
        out.append(w)
    return out


def build_layer(scheme: Scheme, in_features: int, parts: list[int], weights: list[torch.Tensor],
                device: torch.device | str, dtype: torch.dtype, bias: torch.Tensor | None = None) -> Any:
    """The layer on ``device`` in ``dtype``, loaded part by part and processed."""
    device = torch.device(device)
    with device:
        layer = MergedColumnParallelLinear(in_features, list(parts), bias=bias is not None,
                                           quant_config=OneMethod(scheme.make_method), prefix="layer",
                                           params_dtype=dtype)
    for i, w in enumerate(weights):
        for name, tensor in scheme.part_tensors(w).items():
            if name == "g_idx" and not hasattr(layer, "g_idx"):
                continue  # without act-order GPTQ's g_idx is not read (as the loader skips it)
            param = getattr(layer, name)
            # a dense weight comes in the model's dtype; packed tensors and scales in their own
            loaded = tensor.to(device, dtype) if scheme.while_loading else tensor.to(device)
            param.weight_loader(param, loaded, i)
    if bias is not None:
        layer.bias.data.copy_(bias.to(device=device, dtype=dtype))
    with torch.no_grad():
        layer.quant_method.process_weights_after_loading(layer)
    return layer
