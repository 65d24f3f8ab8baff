"""Building a model plugin's module on the target device and streaming its weights in."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch import nn

from loom.plugin_api.quantization import QuantizationConfig, QuantizationError, UnquantizedLinearMethod

from .errors import ModelLoadError
from .quant_select import check_dense_quantize, checkpoint_quantizer
from .random_model import RandomWeights, init_random_weights, random_weights_of
from .weights import iter_weights

log = structlog.get_logger(__name__)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from loom.plugin_api import PluginRegistry


@dataclass
class LoadedModel:
    model: nn.Module  # follows the model contract: forward, compute_logits, load_weights
    hf_config: PretrainedConfig
    architecture: str  # the model plugin's name, e.g. "llama"
    model_dir: Path
    quantization: str | None = None  # the quantizer plugin serving (some of) the linear layers, if any
    # what that quantizer reports about itself (bits, group size, format...) for GetModelInfo
    quantization_settings: dict[str, str] = field(default_factory=dict)
    hf_architecture: str = ""  # the config.json `architectures` entry it serves, e.g. "LlamaForCausalLM"

    def plugin_entries(self) -> tuple[str, ...]:
        """EngineInfo.plugins' entries for the quantizer: "quantizer:NAME?key=value&..."."""
        if not self.quantization:
            return ()
        from urllib.parse import urlencode

        query = urlencode(self.quantization_settings)
        return (f"quantizer:{self.quantization}" + (f"?{query}" if query else ""),)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def skip_weight_init() -> Iterator[None]:
    """Make nn.Linear/nn.Embedding skip their random init: every parameter is overwritten by the
    checkpoint (a missing one is an error), and random init of a large model costs seconds."""
    names = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_")
    saved = {name: getattr(nn.init, name) for name in names}

    def keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor

    try:
        for name in names:
            setattr(nn.init, name, keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def load_hf_config(model_dir: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {exc}") from exc


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device | str,
               registry: PluginRegistry, quantize: str = "auto") -> LoadedModel:
    """Pick the plugin for ``config.architectures``, choose the quantization (``quantize``: see
    ``loom.plugin_api.quantization``), build the model in ``dtype`` on ``device`` with each linear
    layer's method, stream the weights into it, and let each method process what it loaded.

    An unknown architecture raises the registry's PluginError, which lists the known ones.
    """
    from loom.layers.fused_moe import UnquantizedFusedMoEMethod  # the dense experts: not "served"

    config = load_hf_config(model_dir)
    architectures = list(getattr(config, "architectures", None) or ())
    spec = registry.model_for_architecture(architectures)
    hf_architecture = next(a for a in architectures if a in spec.architectures)
    model_cls: Any = spec.load()
    device = torch.device(device)
    random_weights = random_weights_of(config)
    model, quant_config, quantization = None, None, None
    for name, candidate in quantization_candidates(model_dir, dtype, device, registry, quantize,
                                                   random_weights is not None):
        candidate.packed_modules_mapping = dict(getattr(model_cls, "packed_modules_mapping", {}))
        try:
            model = build_model(model_cls, config, dtype, device, candidate)
        except QuantizationError as exc:  # a layer the checkpoint's format cannot serve as it is
            raise ModelLoadError(f"quantizer {name}: {exc}") from None
        served = sum(1 for m in model.modules() if not isinstance(
            getattr(m, "quant_method", None), (type(None), UnquantizedLinearMethod, UnquantizedFusedMoEMethod)))
        if served:
            quant_config, quantization = candidate, name
            log.info("quantized linear layers", quantizer=name, layers=served, **candidate.settings())
            break
        if quantize != "auto" or candidate.quant_methods:
            raise ModelLoadError(f"--quantize {name}: no layer of this checkpoint is in its format")
        model = None
    if model is None:
        model = build_model(model_cls, config, dtype, device, None)
    if random_weights is not None:  # a benchmark model: drawn in place on the device, no checkpoint
        init_random_weights(model, random_weights)
        if quant_config is not None:  # layers quantized while loading take drawn dense weights
            feed_random_dense_weights(model, random_weights)
    else:
        weights = iter_weights(model_dir, dtype, device,
                               skip=quant_config.skips_checkpoint_tensor if quant_config else None,
                               keep_dtype=quant_config.keeps_checkpoint_dtype if quant_config else None)
        if quant_config is not None:
            weights = itertools.chain(weights, quant_config.extra_checkpoint_weights(device))
            rename = quant_config.rename_checkpoint_tensor
            weights = ((rename(name), tensor) for name, tensor in weights)
        load_weights: Any = model.load_weights  # the model contract's method (nn.Module types it as a tensor)
        try:
            load_weights(weights)
        except QuantizationError as exc:  # a packed tensor that contradicts its config
            raise ModelLoadError(f"quantizer {quantization}: {exc}") from None
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
    model.requires_grad_(False)
    model.eval()
    return LoadedModel(model=model, hf_config=config, architecture=spec.name, model_dir=model_dir,
                       quantization=quantization, hf_architecture=hf_architecture,
                       quantization_settings=quant_config.settings() if quant_config else {})


def build_model(model_cls: Any, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                quant_config: QuantizationConfig | None) -> nn.Module:
    """The model's module, parameters created directly in ``dtype`` on ``device`` (not initialised)."""
    with default_dtype(dtype), device, skip_weight_init():
        # A model plugin without quantization support keeps its one-argument constructor.
        model: nn.Module = model_cls(config, quant_config=quant_config) if quant_config else model_cls(config)
    return model


def quantization_candidates(model_dir: Path, dtype: torch.dtype, device: torch.device, registry: PluginRegistry,
                            quantize: str, random_weights: bool = False,
                            ) -> Iterator[tuple[str, QuantizationConfig]]:
    """The quantization configs to try building the model with, in order.

    A checkpoint whose config.json names a quant_method: the quantizer serving it, which must
    apply (see ``quant_select``). Otherwise ``auto``: each available quantizer whose format the
    checkpoint carries and that can run here (the reason one cannot is logged); ``none``:
    nothing; a name: that one (``fp8`` / ``nf4`` quantize the dense weights while they load), or
    ModelLoadError. A random-weight model has no checkpoint: only quantizing while loading applies.
    """
    if random_weights:
        if quantize not in ("auto", "none"):
            check_dense_quantize(None, quantize, registry)
            yield from _construct(registry.quantizer(quantize).name, registry.quantizer(quantize).load(),
                                  model_dir, device, dtype)
        return
    found = checkpoint_quantizer(model_dir, quantize, registry)
    if found is not None:
        yield from _construct(*found, model_dir, device, dtype)
        return
    if quantize == "none":
        return
    if quantize != "auto":
        spec = registry.quantizer(quantize)  # PluginError: unknown (lists the names) or unavailable
        cls = spec.load()
        if cls.quant_methods and not cls.quantizes_while_loading:
            check_dense_quantize(model_dir, quantize, registry)
        yield from _construct(spec.name, cls, model_dir, device, dtype)
        return
    for info in registry.infos("quantizer"):
        if info.unavailable_reason is not None:
            continue
        cls = info.spec.load()
        if not cls.for_checkpoint(model_dir):
            continue
        try:
            config = cls(model_dir, device, dtype)
        except QuantizationError as exc:
            log.info("quantizer not applied; dense weights serve", quantizer=info.spec.name, reason=str(exc))
            continue
        yield info.spec.name, config


def _construct(name: str, cls: Any, model_dir: Path, device: torch.device,
               dtype: torch.dtype) -> Iterator[tuple[str, QuantizationConfig]]:
    try:
        config = cls(model_dir, device, dtype)
    except QuantizationError as exc:
        raise ModelLoadError(f"--quantize {name}: {exc}") from None
    yield name, config


@torch.no_grad()
def feed_random_dense_weights(model: nn.Module, weights: RandomWeights) -> None:
    """A random-weight model's layers that quantize while loading: draw each one's dense weight
    (normal(0, std), seeded, on its device) and hand it to the method's loader, one layer at a time."""
    from loom.layers.fused_moe import FusedMoE

    generator: torch.Generator | None = None

    def draw(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        nonlocal generator
        if generator is None:
            generator = torch.Generator(device=like.device).manual_seed(weights.seed + 1)
        return torch.empty(rows, cols, dtype=like.dtype, device=like.device).normal_(
            0.0, weights.std, generator=generator)

    module: Any
    for module in model.modules():
        if not getattr(getattr(module, "quant_method", None), "quantizes_while_loading", False):
            continue
        if isinstance(module, FusedMoE):  # each expert's gate, up and down as a checkpoint holds them
            hidden, inter = module.hidden_size, module.intermediate_size
            params = dict(module.named_parameters(recurse=False))
            w13, w2 = params["w13_weight"], params["w2_weight"]
            load13: Any = w13.weight_loader  # type: ignore[attr-defined]
            load2: Any = w2.weight_loader  # type: ignore[attr-defined]
            for e in range(module.num_experts):
                load13(w13, draw(inter, hidden, w13), 0, e)
                load13(w13, draw(inter, hidden, w13), 1, e)
                load2(w2, draw(hidden, inter, w2), None, e)
            continue
        param = getattr(module, "weight", None)
        if param is None:
            continue
        rows, cols = sum(module.output_partition_sizes), module.input_size_per_partition
        param.weight_loader(param, draw(rows, cols, param))
