"""Checks of an engine configuration that need torch or the plugins but not the model.

``loom serve`` and ``loom bench`` run them before anything loads, so a mistake (an unknown
``--quantize`` or ``--attention-backend``, ``--device cuda`` without CUDA, a ``--model-id`` that is
not there, a model directory whose architecture no plugin serves) costs a second and one line
naming the flag, not an engine start-up and a traceback. What only the model can tell (its
positions) is checked when it loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loom import kernel_switches
from loom.config import ConfigError, EngineConfig
from loom.plugin_api import AttentionBackendSpec, PluginError, PluginRegistry, default_registry
from loom.plugin_api.specs import AnySpec, PluginKind


def check_engine_config(config: EngineConfig, registry: PluginRegistry | None = None) -> None:
    """Raise ConfigError (one sentence, naming the flag) for what cannot work on this machine."""
    from loom.model_loader import ModelLoadError, check_model_id

    registry = registry or default_registry()
    try:
        kernel_switches.check_environment()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    device_type = _check_device(config.device)
    _check_attention_backend(config, registry, device_type)
    _check_quantizer(config.quantize, registry)
    if config.speculate:
        _check_speculator(config, registry)
    try:
        check_model_id(config.model_id)
        _check_checkpoint_quantization(config.model_id, config.quantize, registry)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
    _check_architecture(config.model_id, registry)
    _check_shards(config, device_type)
    _check_lora_adapters(config)


def _check_shards(config: EngineConfig, device_type: str) -> None:
    """``--num-shard``: one GPU per rank, and a model whose heads and sizes it divides (read from
    a model directory's config.json; other models are checked by the engine, as it starts)."""
    from types import SimpleNamespace

    from loom.distributed.shard_check import check_shardable

    n = config.num_shard
    if n == 1:
        return
    if config.device.startswith("cuda:"):
        raise ConfigError(f"--device {config.device} names one GPU; --num-shard {n} takes one GPU per rank "
                          "(choose them with CUDA_VISIBLE_DEVICES and --device cuda)")
    if device_type == "cuda" and torch.cuda.device_count() < n:
        raise ConfigError(f"--num-shard {n} needs {n} GPUs; {torch.cuda.device_count()} are visible")
    if config.model_id is None:
        return
    config_file = Path(config.model_id).expanduser() / "config.json"
    try:
        fields = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return  # not a model directory, or unreadable: the loader says why
    if isinstance(fields, dict) and "num_attention_heads" in fields:
        check_shardable(SimpleNamespace(**fields), n)


def _check_lora_adapters(config: EngineConfig) -> None:
    """Each --lora-adapters directory holds a PEFT adapter's two files and a config that is a JSON
    object (the rest, shapes against the model included, is checked once the model is loaded)."""
    from loom.lora.peft_adapter import CONFIG_FILE, WEIGHTS_FILE

    for name, path in config.lora_adapters:
        root = Path(path).expanduser()
        if not root.is_dir():
            raise ConfigError(f"--lora-adapters {name}={path}: not a directory")
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            if not (root / file).is_file():
                raise ConfigError(f"--lora-adapters {name}={path}: {file} is missing (a PEFT LoRA directory has "
                                  f"{CONFIG_FILE} and {WEIGHTS_FILE})")


def _check_architecture(model_id: str | None, registry: PluginRegistry) -> None:
    """A Hugging Face model directory names an architecture some model plugin serves (read from
    its config.json; the bundled default, GGUF files and random shapes are Loom's own)."""
    if model_id is None:
        return
    config_file = Path(model_id).expanduser() / "config.json"
    if not config_file.is_file():
        return
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # unreadable: the loader says why, with the path
    try:
        registry.model_for_architecture(architectures)
    except PluginError as exc:
        raise ConfigError(f"--model-id {model_id}: {exc}") from None


def _check_device(device: str) -> str:
    """The device type ``device`` (already syntax-checked by EngineConfig) resolves to here."""
    if device in ("auto", "cpu"):
        return "cuda" if device == "auto" and torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)")
        raise ConfigError(f"--device {device}: CUDA is not available: {why}; use --device cpu or auto")
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"--device {device}: only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})")
    return "cuda"


def _check_attention_backend(config: EngineConfig, registry: PluginRegistry, device_type: str) -> None:
    name = config.attention_backend
    if name is None:
        try:
            registry.default_attention_backend(device_type, config.block_size)
        except PluginError as exc:
            raise ConfigError(f"--attention-backend unset: {exc}") from None
        return
    spec = _available_plugin(registry, "attention", name, "--attention-backend")
    assert isinstance(spec, AttentionBackendSpec)
    if device_type not in spec.devices:
        raise ConfigError(f"--attention-backend {spec.name} runs on {' or '.join(spec.devices)}, "
                          f"not on the {device_type} device this server uses (--device {config.device})")
    if config.block_size % spec.block_size_multiple:
        raise ConfigError(f"--attention-backend {spec.name} needs a --block-size that is a multiple of "
                          f"{spec.block_size_multiple}, got {config.block_size}")
    if config.kv_cache_dtype != "auto" and not getattr(spec.load(), "supports_fp8_kv_cache", False):
        raise ConfigError(f"--attention-backend {spec.name} cannot read an FP8 KV cache (--kv-cache-dtype "
                          f"{config.kv_cache_dtype}); the torch and paged backends can")


def _check_quantizer(quantize: str, registry: PluginRegistry) -> None:
    if quantize in ("auto", "none"):
        return
    _available_plugin(registry, "quantizer", quantize, "--quantize", also=" (or auto, none)")


def _check_speculator(config: EngineConfig, registry: PluginRegistry) -> None:
    """The plugin exists, runs here, and takes the options given."""
    spec = _available_plugin(registry, "speculative", config.speculator, "--speculator")
    try:
        spec.load().check_options(dict(config.speculator_options))
    except ValueError as exc:
        raise ConfigError(f"--speculator {spec.name}: {exc}") from None


def _check_checkpoint_quantization(model_id: str | None, quantize: str, registry: PluginRegistry) -> None:
    """A model directory's config.json against ``--quantize``: an unsupported or conflicting
    quantization_config (method, bits, group size, format...) fails here, before the model loads.
    A random-weight model takes only quantizers that quantize while loading. (A .gguf file is
    checked once converted, when it loads.)"""
    from pathlib import Path

    from loom.model_loader.quant_select import check_dense_quantize, checkpoint_quantizer
    from loom.model_loader.random_model import is_random_model_id

    if is_random_model_id(model_id):
        check_dense_quantize(None, quantize, registry)
        return
    path = Path(model_id).expanduser() if model_id is not None else None
    if path is None or not path.is_dir():
        return
    if checkpoint_quantizer(path, quantize, registry) is None:
        check_dense_quantize(path, quantize, registry)


def _available_plugin(registry: PluginRegistry, kind: PluginKind, name: str, flag: str, also: str = "") -> AnySpec:
    """The spec ``flag`` names, or ConfigError: unknown (listing the valid names) or unable to run here."""
    try:
        info = registry.get(kind, name)
    except PluginError as exc:
        raise ConfigError(f"{flag}: {exc}{also}") from None
    reason = info.unavailable_reason
    if reason is not None:
        raise ConfigError(f"{flag} {info.spec.name} cannot run here: {reason}")
    return info.spec
