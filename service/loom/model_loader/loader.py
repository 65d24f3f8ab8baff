"""Building a model plugin's module on the target device and streaming its weights in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch import nn

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
    quantization: str | None = None  # the quantizer plugin serving the linear layers, if any
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
    """Pick the plugin for ``config.architectures``, build it in ``dtype`` on ``device``, load
    weights, then let a quantizer replace linear layers (``quantize``: see
    ``loom.layers.quantization``).

    An unknown architecture raises the registry's PluginError, which lists the known ones.
    """
    config = load_hf_config(model_dir)
    architectures = list(getattr(config, "architectures", None) or ())
    spec = registry.model_for_architecture(architectures)
    hf_architecture = next(a for a in architectures if a in spec.architectures)
    model_cls: Any = spec.load()
    device = torch.device(device)
    # Parameters are created directly in the target dtype on the target device.
    with default_dtype(dtype), device, skip_weight_init():
        model = model_cls(config)
    random_weights = random_weights_of(config)
    if random_weights is not None:  # a benchmark model: drawn in place on the device, no checkpoint
        init_random_weights(model, random_weights)
    else:
        model.load_weights(iter_weights(model_dir, dtype, device))
    quantization = None
    if random_weights is None:
        quantization = apply_quantizer(model, model_dir, dtype, device, registry, quantize)
    model.requires_grad_(False)
    model.eval()
    return LoadedModel(model=model, hf_config=config, architecture=spec.name, model_dir=model_dir,
                       quantization=quantization, hf_architecture=hf_architecture)


def apply_quantizer(model: nn.Module, model_dir: Path, dtype: torch.dtype, device: torch.device,
                    registry: PluginRegistry, quantize: str) -> str | None:
    """Run the chosen quantizer over ``model``; returns its name, or None when the weights stay dense.

    ``auto``: the first available quantizer whose format the checkpoint carries and that can run
    here (the reason one cannot is logged); ``none``: dense; a name: that one, or ModelLoadError.
    """
    from loom.layers.quantization import QuantizationError

    if quantize == "none":
        return None
    if quantize != "auto":
        spec = registry.quantizer(quantize)  # PluginError: unknown (lists the names) or unavailable
        try:
            quantizer = spec.load()(model_dir, device, dtype)
        except QuantizationError as exc:
            raise ModelLoadError(f"--quantize {spec.name}: {exc}") from exc
        if quantizer.quantize(model) == 0:
            raise ModelLoadError(f"--quantize {spec.name}: no layer of this checkpoint is in its format")
        return spec.name
    for info in registry.infos("quantizer"):
        if info.unavailable_reason is not None:
            continue
        cls = info.spec.load()
        if not cls.for_checkpoint(model_dir):
            continue
        try:
            quantizer = cls(model_dir, device, dtype)
        except QuantizationError as exc:
            log.info("quantizer not applied; dense weights serve", quantizer=info.spec.name, reason=str(exc))
            continue
        if quantizer.quantize(model):
            return info.spec.name
    return None
