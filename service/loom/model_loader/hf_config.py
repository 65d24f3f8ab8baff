"""Reading the shape of a model out of a Hugging Face config (either transformers 4 or 5 style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# How an architecture uses ``config.sliding_window``:
#   "none": never (Llama ignores the field);
#   "all": every layer (Mistral, Mixtral, Qwen3-MoE, Phi-3);
#   "per_layer": from ``layer_types`` (Gemma 2/3), or Qwen2's use_sliding_window + max_window_layers rule.
SlidingWindowRule = Literal["none", "all", "per_layer"]


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int
    # The window when *every* layer slides (so the engine may bound a sequence's KV by it);
    # None when any layer attends fully.
    sliding_window: int | None


def head_dim_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def num_kv_heads_of(config: Any) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def _default_rule(config: Any) -> SlidingWindowRule:
    model_type = getattr(config, "model_type", "")
    if model_type in ("mistral", "mixtral", "qwen3_moe", "phi3"):
        return "all"
    if model_type in ("qwen2", "qwen3", "gemma2", "gemma3_text"):
        return "per_layer"
    return "none"


def layer_sliding_windows(config: Any, rule: SlidingWindowRule | None = None) -> list[int | None]:
    """The sliding window of each layer (None: full causal attention)."""
    num_layers = int(config.num_hidden_layers)
    rule = rule or _default_rule(config)
    window = getattr(config, "sliding_window", None)
    if rule == "none" or not window:
        return [None] * num_layers
    if rule == "all":
        if getattr(config, "use_sliding_window", True) is False:  # Qwen3-MoE: the window is off
            return [None] * num_layers
        return [int(window)] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    # transformers-4 Qwen2 configs: the window applies from layer max_window_layers on.
    if not getattr(config, "use_sliding_window", False):
        return [None] * num_layers
    first = int(getattr(config, "max_window_layers", 0) or 0)
    return [int(window) if i >= first else None for i in range(num_layers)]


def model_dims(config: Any, rule: SlidingWindowRule | None = None) -> ModelDims:
    """The numbers the engine sizes its KV cache and limits by."""
    per_layer = layer_sliding_windows(config, rule)
    windows = [w for w in per_layer if w is not None]
    return ModelDims(
        num_layers=int(config.num_hidden_layers),
        num_heads=int(config.num_attention_heads),
        num_kv_heads=num_kv_heads_of(config),
        head_dim=head_dim_of(config),
        max_position_embeddings=int(config.max_position_embeddings),
        vocab_size=int(config.vocab_size),
        sliding_window=max(windows) if windows and len(windows) == len(per_layer) else None,
    )
