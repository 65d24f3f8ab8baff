"""Read a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``) into
plain CPU tensors, checking everything that does not depend on the base model.

PEFT stores, per adapted module, ``base_model.model.<module>.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r]; the module's output gains ``scaling * x @ A^T @ B^T`` with
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA). Anything PEFT can put in
such a directory that this server does not compute (DoRA, biases, extra saved modules, per-module
alphas) is refused with :class:`AdapterError` naming the field, rather than served wrongly.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target (Hugging Face names); fused layers take them as parts.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


class AdapterError(ValueError):
    """An adapter this server refuses: ``field`` names the config field or tensor at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ModuleLora:
    """One adapted module's factors: ``delta(x) = scaling * (x @ a.T) @ b.T``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT adapter as read from disk: its settings and factors per module (Hugging Face names,
    ``model.layers.3.self_attn.q_proj``)."""

    path: str
    rank: int  # the config's r (the largest module rank when a rank_pattern sets others)
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # the projection names with factors, sorted
    modules: dict[str, ModuleLora] = field(default_factory=dict)


def read_peft_adapter(path: str | Path, max_rank: int) -> PeftAdapter:
    """Read and check the adapter at ``path``; raise :class:`AdapterError` on anything wrong."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterError("path", f"{str(path)!r} is not a directory")
    config = _read_config(root)
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(WEIGHTS_FILE, f"missing from {str(root)!r} (only safetensors weights are read)")
    r = _positive_int(config, "r")
    alpha = float(_number(config, "lora_alpha"))
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError("use_rslora", f"must be true or false, got {rslora!r}")
    _check_targets(config.get("target_modules"))
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights), device="cpu")
    except Exception as exc:  # a truncated or foreign file: safetensors' own message names the problem
        raise AdapterError(WEIGHTS_FILE, f"cannot be read: {exc}") from exc
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None or not name.startswith(_PREFIX):
            raise AdapterError(name, "is not a LoRA factor (base_model.model.<module>.lora_A/lora_B.weight); "
                                     "extra saved modules and DoRA magnitudes are not served")
        module = match["module"][len(_PREFIX):]
        projection = module.rsplit(".", 1)[-1]
        if projection not in SUPPORTED_TARGETS:
            raise AdapterError(name, f"targets {projection!r}; adapters may target only {', '.join(SUPPORTED_TARGETS)}")
        if tensor.dim() != 2:
            raise AdapterError(name, f"has shape {tuple(tensor.shape)}, expected a matrix")
        if not tensor.is_floating_point():
            raise AdapterError(name, f"has dtype {tensor.dtype}, expected a floating-point type")
        factors.setdefault(module, {})[match["ab"]] = tensor.to(torch.float32)
    if not factors:
        raise AdapterError(WEIGHTS_FILE, "holds no LoRA factors")
    modules: dict[str, ModuleLora] = {}
    largest = 0
    for module, ab in sorted(factors.items()):
        for part in ("A", "B"):
            if part not in ab:
                raise AdapterError(f"{_PREFIX}{module}.lora_{part}.weight", "is missing (its pair is present)")
        a, b = ab["A"], ab["B"]
        rank = int(a.shape[0])
        if int(b.shape[1]) != rank:
            raise AdapterError(f"{_PREFIX}{module}.lora_B.weight",
                               f"has shape {tuple(b.shape)}: {b.shape[1]} columns, but lora_A has rank {rank}")
        if rank > max_rank:
            raise AdapterError(f"{_PREFIX}{module}.lora_A.weight",
                               f"rank {rank} is above --max-lora-rank {max_rank}")
        largest = max(largest, rank)
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        modules[module] = ModuleLora(a.contiguous(), b.contiguous(), scaling)
    if r > max_rank:
        raise AdapterError("r", f"{r} is above --max-lora-rank {max_rank}")
    targets = tuple(sorted({m.rsplit(".", 1)[-1] for m in modules}))
    return PeftAdapter(str(root), max(r, largest), alpha, rslora, targets, modules)


def _read_config(root: Path) -> dict[str, object]:
    file = root / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(CONFIG_FILE, f"missing from {str(root)!r}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(CONFIG_FILE, f"is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(CONFIG_FILE, "must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError("peft_type", f"{peft_type!r} is not served; only LORA adapters are")
    # Settings that change what the factors compute: refused rather than ignored.
    if config.get("use_dora"):
        raise AdapterError("use_dora", "DoRA adapters are not served")
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError("bias", f"{config['bias']!r}: adapters that train biases are not served")
    if config.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out", "transposed (Conv1D) factors are not served")
    if config.get("modules_to_save"):
        raise AdapterError("modules_to_save", "adapters that save whole modules are not served")
    if config.get("alpha_pattern"):
        raise AdapterError("alpha_pattern", "per-module alphas are not served")
    return config


def _number(config: dict[str, object], key: str) -> float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(key, f"must be a number, got {value!r}")
    return float(value)


def _positive_int(config: dict[str, object], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(key, f"must be a positive integer, got {value!r}")
    return value


def _check_targets(targets: object) -> None:
    if isinstance(targets, str):  # a regular expression over module names: the tensors tell which
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError("target_modules", f"must be a list of module names or a pattern, got {targets!r}")
    for t in targets:
        if t.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS:
            raise AdapterError("target_modules", f"{t!r} is not served; adapters may target only "
                                                 f"{', '.join(SUPPORTED_TARGETS)}")
