"""Which linear layers of a checkpoint hold which tensors: what a per-layer quantization format
config decides its layers by (a layer is quantized when the checkpoint holds its packed tensors,
so modules a format leaves dense, such as an unquantized ``lm_head``, stay dense)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.model_loader.weights import safetensors_files
from loom.plugin_api.quantization import QuantizationConfig, QuantizationError


def checkpoint_tensor_names(model_dir: Path) -> set[str]:
    """Every tensor name in the checkpoint's safetensors files (headers only: nothing is read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


def quantized_parts(config: QuantizationConfig, names: set[str], prefix: str, marker: str,
                    required: tuple[str, ...], fmt: str) -> list[str] | None:
    """The checkpoint modules of the layer at ``prefix`` when they hold ``<part>.<marker>`` (None:
    they are dense). A fused layer needs all its parts in the format, each with every tensor of
    ``required``; otherwise QuantizationError names the tensor."""
    parts = config.checkpoint_parts(prefix)
    have = [f"{part}.{marker}" in names for part in parts]
    if not any(have):
        return None
    if not all(have):
        dense = [p for p, h in zip(parts, have, strict=True) if not h]
        raise QuantizationError(f"{fmt} checkpoint: {dense[0]} has no {marker} tensor while the other parts of "
                                f"the fused layer {prefix} do (a fused layer's parts must all be quantized)")
    for part in parts:
        for suffix in required:
            if f"{part}.{suffix}" not in names:
                raise QuantizationError(f"{fmt} checkpoint tensor {part}.{suffix} is missing (every quantized "
                                        f"linear layer needs {', '.join(required)} beside its {marker})")
    return parts


def int_field(qconfig: dict[str, Any], names: tuple[str, ...], default: int | None, allowed: str,
              fmt: str) -> int:
    """An integer field of ``quantization_config`` (the first of ``names`` present)."""
    for name in names:
        if name in qconfig:
            value = qconfig[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise QuantizationError(f"{fmt} quantization_config.{name} must be an integer ({allowed}), "
                                        f"got {value!r}")
            return value
    if default is None:
        raise QuantizationError(f"{fmt} quantization_config has no {names[0]} field ({allowed})")
    return default


def bool_field(qconfig: dict[str, Any], name: str, default: bool, fmt: str) -> bool:
    value = qconfig.get(name, default)
    if not isinstance(value, bool):
        raise QuantizationError(f"{fmt} quantization_config.{name} must be true or false, got {value!r}")
    return value
