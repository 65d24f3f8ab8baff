"""Weight memory of a model as the engine serves it: the bytes of its parameters and of its linear
layers' quantized buffers (packed codes, scales, zeros, tables, e4m3 weights), each storage once,
measured on the device after loading with the same ``--quantize``.

The engine runs in its own process, so the benchmark measures after the engine has exited (the
device is free). A random-weight model (``random:NAME``) needs no checkpoint: its decoder layers
are identical in shape, so one layer is loaded (a copy of the config with one decoder layer, the
embedding and head included) and the total is that model's bytes plus ``num_layers - 1`` times
its decoder layer's. A model with a checkpoint is loaded whole.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn


def module_weight_bytes(module: nn.Module) -> int:
    """Parameters, and buffers of the modules that have a linear method (the quantized weights;
    not a rotary cache), each storage counted once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and t.device.type != "meta":
            seen.add(key)
            total += storage.nbytes()

    for p in module.parameters():
        add(p)
    for sub in module.modules():
        if getattr(sub, "quant_method", None) is not None:
            for b in sub.buffers(recurse=False):
                add(b)
    return total


def expert_weight_bytes(module: nn.Module) -> int:
    """The bytes of the Mixture-of-Experts experts inside ``module`` as served (dense, or e4m3
    codes and their scales): what the limits count by the share of experts a step chooses."""
    from loom.layers.fused_moe import FusedMoE

    return sum(module_weight_bytes(m) for m in module.modules() if isinstance(m, FusedMoE))


def first_decoder_layer(model: nn.Module) -> nn.Module:
    inner: Any = model.model  # the model contract: ``model.layers`` holds the decoder layers
    return inner.layers[0]


def measure_weight_memory(model_dir: Path, dtype: torch.dtype, device: torch.device, quantize: str,
                          registry: Any = None) -> dict[str, Any]:
    """``{"weight_bytes", "decoder_layer_bytes", "num_layers", "expert_bytes", "quantization",
    "measured_on"}`` (``expert_bytes``: every MoE layer's experts, 0 for a dense model)."""
    from loom.model_loader import load_model
    from loom.model_loader.loader import load_hf_config
    from loom.model_loader.random_model import random_weights_of
    from loom.plugin_api import default_registry

    registry = registry or default_registry()
    config = load_hf_config(model_dir)
    num_layers = int(config.num_hidden_layers)
    if random_weights_of(config) is None:
        loaded = load_model(model_dir, dtype, device, registry, quantize)
        total = module_weight_bytes(loaded.model)
        layer = module_weight_bytes(first_decoder_layer(loaded.model))
        experts = expert_weight_bytes(loaded.model)
        measured = "the whole model"
    else:
        with tempfile.TemporaryDirectory(prefix="loom-weights-") as tmp:
            one = Path(tmp)
            for path in model_dir.iterdir():
                if path.is_file() and path.name != "config.json":
                    shutil.copy(path, one / path.name)
            raw = json.loads((model_dir / "config.json").read_text())
            raw["num_hidden_layers"] = 1
            (one / "config.json").write_text(json.dumps(raw))
            loaded = load_model(one, dtype, device, registry, quantize)
            layer = module_weight_bytes(first_decoder_layer(loaded.model))
            total = module_weight_bytes(loaded.model) + (num_layers - 1) * layer
            experts = num_layers * expert_weight_bytes(first_decoder_layer(loaded.model))
        measured = "one decoder layer (identical layers) and the embedding / head"
    result = {"weight_bytes": total, "decoder_layer_bytes": layer, "num_layers": num_layers, "expert_bytes": experts,
              "quantization": loaded.quantization, "quantization_settings": loaded.quantization_settings,
              "measured_on": measured}
    del loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result
