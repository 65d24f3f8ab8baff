"""Which quantizer serves a checkpoint, from ``--quantize`` and config.json's ``quantization_config``.

A checkpoint whose config.json names a ``quant_method`` (GPTQ, AWQ, FP8, bitsandbytes...) holds
its linear weights only in that format: the quantizer plugin that serves the method must run,
whatever ``--quantize auto`` would otherwise do, and a ``--quantize`` naming another one (or
``none``) is a conflict. A dense checkpoint takes ``--quantize auto`` (a GGUF file's blocks where
they run), ``none``, or the name of a quantizer that quantizes while loading (``fp8``, ``nf4``).

These checks read config.json only, so ``loom serve`` runs them before anything loads (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ModelLoadError

if TYPE_CHECKING:
    from loom.plugin_api import PluginRegistry


def checkpoint_quantizer(model_dir: Path, quantize: str, registry: PluginRegistry) -> tuple[str, Any] | None:
    """``(plugin name, its QuantizationConfig class)`` for a checkpoint that names a quant_method
    (None for a dense one); ModelLoadError, one sentence, when that cannot be served as asked."""
    from loom.plugin_api.quantization import (
        QuantizationError,
        checkpoint_quant_method,
        checkpoint_quantization_config,
    )

    try:
        method = checkpoint_quant_method(model_dir)
        qconfig = checkpoint_quantization_config(model_dir)
    except QuantizationError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from None
    if method is None or qconfig is None:
        return None
    # quant_method -> its claimants in registration order: (plugin, class, why it cannot run here)
    served: dict[str, list[tuple[str, Any, str | None]]] = {}
    for info in registry.infos("quantizer"):
        cls = info.spec.load()
        for name in getattr(cls, "quant_methods", ()):
            served.setdefault(name, []).append((info.spec.name, cls, info.unavailable_reason))
    if method not in served:
        known = ", ".join(sorted(served)) or "none"
        raise ModelLoadError(f"config.json quantization_config.quant_method is {method!r}, which no installed "
                             f"quantizer serves (served: {known})")
    # the claimant that takes this config (compressed-tensors: by its format), else the first,
    # whose check below says what is wrong with it
    claimants = served[method]
    name, cls, reason = next((c for c in claimants if c[1].serves_checkpoint_config(qconfig)), claimants[0])
    if reason is not None:
        raise ModelLoadError(f"the checkpoint is {method}-quantized but the {name} quantizer cannot run here: {reason}")
    if quantize == "none":
        raise ModelLoadError(f"--quantize none: the checkpoint's linear weights are {method}-quantized "
                             "(config.json quantization_config) and have no dense form; use --quantize auto")
    if quantize not in ("auto", name):
        raise ModelLoadError(f"--quantize {quantize} conflicts with the checkpoint's quantization_config.quant_method "
                             f"{method!r}, which the {name} quantizer serves; use --quantize auto (or {name})")
    try:
        cls.check_checkpoint_config(qconfig)
    except QuantizationError as exc:
        raise ModelLoadError(f"{model_dir}/config.json: {exc}") from None
    return name, cls


def check_dense_quantize(model_dir: Path | None, quantize: str, registry: PluginRegistry) -> None:
    """``--quantize NAME`` on a dense checkpoint (``model_dir`` None: a random-weight model, which
    has no checkpoint): NAME must quantize while loading, or find its own format there (a
    random-weight model also takes the quantizers that ``quantizes_random_weights``: gptq, awq)."""
    if quantize in ("auto", "none"):
        return
    cls = registry.quantizer(quantize).load()
    if cls.quantizes_while_loading or (model_dir is None and getattr(cls, "quantizes_random_weights", False)):
        return
    if model_dir is not None and cls.for_checkpoint(model_dir):
        return
    what = "a random-weight model has no checkpoint" if model_dir is None else "the checkpoint is not"
    on_the_fly = sorted(info.spec.name for info in registry.infos("quantizer")
                        if getattr(info.spec.load(), "quantizes_while_loading", False))
    raise ModelLoadError(f"--quantize {quantize}: {what} in its format (config.json has no quantization_config "
                         f"for it); make one with `loom quantize --method {quantize}`, or quantize while loading "
                         f"with --quantize {' or '.join(on_the_fly) or '(none installed)'}")
