"""Streaming checkpoint tensors out of ``*.safetensors`` files, one at a time."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .errors import ModelLoadError


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a HF model directory, following the shard index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    # Mistral repos also ship consolidated*.safetensors in the original (non-HF) naming.
    files = sorted(p for p in model_dir.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {model_dir}; Loom loads safetensors checkpoints only "
            "(re-save PyTorch .bin checkpoints with save_pretrained(safe_serialization=True))"
        )
    return files


_FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


def iter_weights(model_dir: Path, dtype: torch.dtype, device: torch.device | str,
                 skip: Callable[[str], bool] | None = None,
                 keep_dtype: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every checkpoint tensor, floating ones cast to ``dtype`` on ``device``.

    Tensors are read and converted one at a time, so the host never holds a full-precision copy
    of the whole model. ``skip(name)`` True: the tensor is not even read (a quantization method
    loads that layer's weights from elsewhere). ``keep_dtype(name)`` True, and every float8
    tensor: loaded in its own dtype (a quantized format's scales: casting them would change them).
    """
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if skip is not None and skip(name):
                    continue
                tensor = handle.get_tensor(name)
                if tensor.is_floating_point() and tensor.dtype not in _FLOAT8 and not (
                        keep_dtype is not None and keep_dtype(name)):
                    yield name, tensor.to(device=device, dtype=dtype)
                else:  # integer payloads (pre-quantized weights) keep their dtype
                    yield name, tensor.to(device=device)
