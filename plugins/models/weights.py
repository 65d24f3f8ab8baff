"""Loading Hugging Face checkpoint tensors through each parameter's own ``weight_loader``.

A model whose layers fuse several checkpoint modules (``q_proj``, ``k_proj`` and ``v_proj`` in
one ``qkv_proj``) declares a ``packed_modules_mapping``: fused module -> its parts, in order. A
checkpoint tensor ``...k_proj.<param>`` then goes to ``...qkv_proj.<param>`` with shard id 1
(the fused layer maps it to its rows; ``<param>`` is ``weight``, ``bias``, or whatever a
quantization method registered: ``qweight``, ``scales``...). Parameters without a loader of
their own (norms) take the whole tensor.

A module may own the naming of its parameters instead: one that defines
``checkpoint_targets(prefix)`` (the stacked experts of ``loom.layers.fused_moe.FusedMoE``) returns
``(required, alternatives)``: checkpoint name -> ``(parameter, shard id, expert id)`` for each
tensor it needs (``...experts.3.w1.weight`` -> ``w13_weight``, part 0, expert 3), and names that
stand for several required ones at once (transformers 5's stacked ``experts.gate_up_proj``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from loom.layers.linear import WeightShapeError, default_weight_loader
from loom.model_loader.errors import ModelLoadError

# fused module name -> the checkpoint module names it holds, in row order
PackedModules = dict[str, list[str]]

# Buffers some checkpoints carry that Loom recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _expected_names(params: Iterable[str], packed: PackedModules) -> set[str]:
    """Every checkpoint name the model needs, in HF naming (fused params expanded)."""
    expected: set[str] = set()
    for name in params:
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in packed:
            expected.add(name)
            continue
        for hf_module in packed[parts[-2]]:
            expected.add(".".join([*parts[:-2], hf_module, parts[-1]]))
    return expected


# checkpoint name -> (parameter's full name, shard id, expert id)
_Target = tuple[str, Any, int | None]


def _module_targets(model: nn.Module) -> tuple[dict[str, _Target], dict[str, tuple[_Target, list[str]]], set[str]]:
    """The checkpoint names of modules that map their own parameters (see the module docstring):
    (required names, alternative names with the required ones each covers, the full names of
    the parameters so mapped)."""
    required: dict[str, _Target] = {}
    alternatives: dict[str, tuple[_Target, list[str]]] = {}
    owned: set[str] = set()
    for prefix, module in model.named_modules():
        targets = getattr(module, "checkpoint_targets", None)
        if targets is None:
            continue
        req, alt = targets(prefix)
        for name, (param, shard, expert) in req.items():
            required[name] = (f"{prefix}.{param}", shard, expert)
        for name, ((param, shard, expert), covers) in alt.items():
            alternatives[name] = ((f"{prefix}.{param}", shard, expert), covers)
        owned.update(f"{prefix}.{n}" for n, _ in module.named_parameters(recurse=False))
    return required, alternatives, owned


def _summarise(names: Iterable[str], limit: int = 8) -> str:
    ordered = sorted(names)
    more = f" (and {len(ordered) - limit} more)" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed: PackedModules,
    skip: set[str] | None = None,
) -> None:
    """Load each ``(hf_name, tensor)`` into ``model``; unknown, missing or misshapen weights fail."""
    params = dict(model.named_parameters())  # tied parameters appear once
    part_of = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
    module_required, module_alternatives, owned = _module_targets(model)
    expected = _expected_names([p for p in params if p not in owned], packed) | set(module_required)
    loaded: set[str] = set()
    unexpected: list[str] = []
    skip = skip or set()
    with torch.no_grad():
        for name, tensor in weights:
            if name in skip or name.endswith(IGNORED_SUFFIXES):
                continue
            covers: list[str] = []
            extra: tuple[Any, ...] = ()
            if name in module_required or name in module_alternatives:
                if name in module_required:
                    target, shard, expert = module_required[name]
                else:
                    (target, shard, expert), covers = module_alternatives[name]
                extra = (shard, expert)
            else:
                parts = name.split(".")
                fused = part_of.get(parts[-2]) if len(parts) >= 2 else None
                target = ".".join([*parts[:-2], fused[0], parts[-1]]) if fused else name
                extra = (fused[1],) if fused else ()
            param = params.get(target)
            if param is None or (target in owned and not extra):
                unexpected.append(name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, *extra)
            except WeightShapeError as exc:
                raise ModelLoadError(
                    f"weight {name!r} has shape {exc.checkpoint_shape} in the checkpoint but "
                    f"{type(model).__name__} expects {exc.expected_shape}; does config.json match the weights?"
                ) from None
            loaded.add(name)
            loaded.update(covers)
    if unexpected:
        raise ModelLoadError(
            f"checkpoint has weights {type(model).__name__} does not know: {_summarise(unexpected)}"
        )
    missing = expected - loaded
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights of {type(model).__name__}: {_summarise(missing)}")
