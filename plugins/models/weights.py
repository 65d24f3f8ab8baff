"""Loading Hugging Face checkpoint tensors into models whose projections are fused."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from loom.model_loader.errors import ModelLoadError

# HF module name -> (fused module name, first row, number of rows), e.g.
# "k_proj" -> ("qkv_proj", Hq*D, Hkv*D). Weights and biases are both split along dim 0.
FusedLayout = dict[str, tuple[str, int, int]]

# Buffers some checkpoints carry that Loom recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _expected_names(params: Iterable[str], layout: FusedLayout) -> set[str]:
    """Every checkpoint name the model needs, in HF naming (fused params expanded)."""
    parts_of: dict[str, list[str]] = {}
    for hf_name, (fused, _, _) in layout.items():
        parts_of.setdefault(fused, []).append(hf_name)
    expected: set[str] = set()
    for name in params:
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in parts_of:
            expected.add(name)
            continue
        for hf_module in parts_of[parts[-2]]:
            expected.add(".".join([*parts[:-2], hf_module, parts[-1]]))
    return expected


def _summarise(names: Iterable[str], limit: int = 8) -> str:
    ordered = sorted(names)
    more = f" (and {len(ordered) - limit} more)" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more


def load_fused_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    layout: FusedLayout,
    skip: set[str] | None = None,
) -> None:
    """Copy each ``(hf_name, tensor)`` into ``model``; unknown, missing or misshapen weights fail."""
    params = dict(model.named_parameters())  # tied parameters appear once
    expected = _expected_names(params, layout)
    loaded: set[str] = set()
    unexpected: list[str] = []
    skip = skip or set()
    with torch.no_grad():
        for name, tensor in weights:
            if name in skip or name.endswith(IGNORED_SUFFIXES):
                continue
            parts = name.split(".")
            fused = layout.get(parts[-2]) if len(parts) >= 2 else None
            target = ".".join([*parts[:-2], fused[0], parts[-1]]) if fused else name
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            dst = param.narrow(0, fused[1], fused[2]) if fused else param
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(tensor.shape)} in the checkpoint but "
                    f"{type(model).__name__} expects {tuple(dst.shape)}; does config.json match the weights?"
                )
            dst.copy_(tensor)
            loaded.add(name)
    if unexpected:
        raise ModelLoadError(
            f"checkpoint has weights {type(model).__name__} does not know: {_summarise(unexpected)}"
        )
    missing = expected - loaded
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights of {type(model).__name__}: {_summarise(missing)}")
