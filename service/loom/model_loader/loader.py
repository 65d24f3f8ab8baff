"""Building a model plugin's module on the target device and streaming its weights in."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch import nn

from loom.plugin_api.quantization import QuantizationConfig, UnquantizedLinearMethod

from .errors import ModelLoadError
from .random_model import init_random_weights, random_weights_of
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
    hf_architecture: str = ""  # the config.json `architectures` entry it serves, e.g. "LlamaForCausalLM"


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
    config = load_hf_config(model_dir)
    architectures = list(getattr(config, "architectures", None) or ())
    spec = registry.model_for_architecture(architectures)
    hf_architecture = next(a for a in architectures if a in spec.architectures)
    model_cls: Any = spec.load()
    device = torch.device(device)
    random_weights = random_weights_of(config)
    model, quant_config, quantization = None, None, None
    if random_weights is None:  # a benchmark model has no checkpoint, so no quantized format
        for name, candidate in quantization_candidates(model_dir, dtype, device, registry, quantize):
            candidate.packed_modules_mapping = dict(getattr(model_cls, "packed_modules_mapping", {}))
            model = build_model(model_cls, config, dtype, device, candidate)
            served = sum(1 for m in model.modules() if not isinstance(
                getattr(m, "quant_method", None), (type(None), UnquantizedLinearMethod)))
            if served:
                quant_config, quantization = candidate, name
                log.info("quantized linear layers", quantizer=name, layers=served)
                break
            if quantize != "auto":
                raise ModelLoadError(f"--quantize {name}: no layer of this checkpoint is in its format")
            model = None
    if model is None:
        model = build_model(model_cls, config, dtype, device, None)
    if random_weights is not None:  # a benchmark model: drawn in place on the device, no checkpoint
        init_random_weights(model, random_weights)
    else:
        weights = iter_weights(model_dir, dtype, device,
                               skip=quant_config.skips_checkpoint_tensor if quant_config else None)
        if quant_config is not None:
            weights = itertools.chain(weights, quant_config.extra_checkpoint_weights(device))
        load_weights: Any = model.load_weights  # the model contract's method (nn.Module types it as a tensor)
        load_weights(weights)
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
    model.requires_grad_(False)
    model.eval()
    return LoadedModel(model=model, hf_config=config, architecture=spec.name, model_dir=model_dir,
                       quantization=quantization, hf_architecture=hf_architecture)


def build_model(model_cls: Any, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                quant_config: QuantizationConfig | None) -> nn.Module:
    """The model's module, parameters created directly in ``dtype`` on ``device`` (not initialised)."""
    with default_dtype(dtype), device, skip_weight_init():
        # A model plugin without quantization support keeps its one-argument constructor.
        model: nn.Module = model_cls(config, quant_config=quant_config) if quant_config else model_cls(config)
    return model


def quantization_candidates(model_dir: Path, dtype: torch.dtype, device: torch.device, registry: PluginRegistry,
                            quantize: str) -> Iterator[tuple[str, QuantizationConfig]]:
    """The quantization configs to try building the model with, in order.

    ``auto``: each available quantizer whose format the checkpoint carries and that can run here
    (the reason one cannot is logged); ``none``: nothing; a name: that one, or ModelLoadError.
    """
    from loom.plugin_api.quantization import QuantizationError

    if quantize == "none":
        return
    if quantize != "auto":
        spec = registry.quantizer(quantize)  # PluginError: unknown (lists the names) or unavailable
        try:
            yield spec.name, spec.load()(model_dir, device, dtype)
        except QuantizationError as exc:
            raise ModelLoadError(f"--quantize {spec.name}: {exc}") from exc
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
