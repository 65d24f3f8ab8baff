"""Tiny random-weight Hugging Face models of each supported architecture, saved to disk.

A large ``initializer_range`` keeps logits peaked, so argmax does not flip when float sums are
reordered between our fused projections and HF's separate ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=320, max_position_embeddings=128, initializer_range=0.15,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def _llama(**overrides: Any) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(**{**_COMMON, **overrides})

    return build


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**{**_COMMON, "sliding_window": 5})


def _qwen2() -> Any:
    from transformers import Qwen2Config

    # Layers 1 and 2 slide, layer 0 attends fully: exercises per-layer windows.
    return Qwen2Config(**{**_COMMON, "num_hidden_layers": 3, "use_sliding_window": True,
                          "sliding_window": 6, "max_window_layers": 1})


def _qwen3(**overrides: Any) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import Qwen3Config

        # head_dim 32 != hidden/heads (16), as in real Qwen3.
        return Qwen3Config(**{**_COMMON, "head_dim": 32, **overrides})

    return build


def _mixtral() -> Any:
    from transformers import MixtralConfig

    # 8 experts, 2 per token; every layer slides (window 6).
    return MixtralConfig(**{**_COMMON, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 6})


def _qwen3_moe(**overrides: Any) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import Qwen3MoeConfig

        # 3 layers: 0 and 2 sparse (8 experts, 3 per token), 1 dense (mlp_only_layers).
        return Qwen3MoeConfig(**{**_COMMON, "num_hidden_layers": 3, "head_dim": 32, "num_experts": 8,
                                 "num_experts_per_tok": 3, "moe_intermediate_size": 48, "mlp_only_layers": [1],
                                 **overrides})

    return build


def _gemma2() -> Any:
    from transformers import Gemma2Config

    # Layers 0 and 2 slide (window 5), layer 1 attends fully; caps small enough to bite.
    return Gemma2Config(**{**_COMMON, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 5, "tie_word_embeddings": False,
                           "query_pre_attn_scalar": 24, "attn_logit_softcapping": 4.0,
                           "final_logit_softcapping": 8.0, "hidden_activation": "gelu_pytorch_tanh"})


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{
        **_COMMON, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
    })


def _phi3(**overrides: Any) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import Phi3Config

        return Phi3Config(**{**_COMMON, **overrides})

    return build


# LongRoPE past position 32, on half of each 16-dim head (4 factors each).
_PHI3_LONGROPE = dict(
    max_position_embeddings=128, original_max_position_embeddings=32, partial_rotary_factor=0.5,
    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                     "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.3, 1.9, 2.5],
                     "long_factor": [1.5, 2.5, 4.0, 7.0]},
)

TINY_CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": _llama(),
    "llama-tied-bias": _llama(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    # One KV head: split over 2 tensor-parallel ranks, each keeps a replica of it.
    "llama-mqa": _llama(num_key_value_heads=1),
    # Inputs of 128 and 256: each of 2 tensor-parallel ranks keeps whole NF4 blocks of 64 in o_proj
    # and down_proj (the 64-wide llama's o_proj leaves a rank 32 inputs: half a block).
    "llama-wide": _llama(hidden_size=128, intermediate_size=256),
    "llama-linear-rope": _llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "llama3-rope": _llama(
        max_position_embeddings=256,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "llama-yarn-rope": _llama(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32},
    ),
    "llama-dynamic-rope": _llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3(tie_word_embeddings=True),
    "qwen3-bias": _qwen3(attention_bias=True),
    "mixtral": _mixtral,
    "qwen3-moe": _qwen3_moe(),
    "qwen3-moe-norm-topk": _qwen3_moe(norm_topk_prob=True, tie_word_embeddings=True),
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3(sliding_window=7),
    "phi3-longrope": _phi3(**_PHI3_LONGROPE),
}


def save_tiny_model(name: str, path: Path, seed: int = 0) -> Path:
    """Build the random-weight HF model ``name`` (a TINY_CONFIGS key) and save it to ``path``."""
    from transformers import AutoModelForCausalLM

    config = TINY_CONFIGS[name]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf_reference(path: Path) -> Any:
    """The same checkpoint through transformers (fp32, eager attention) for parity checks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_logits(model: Any, token_ids: list[int]) -> torch.Tensor:  # -> [T, V] float32
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def save_tiny_llama_with_vocab_of(model_dir: Path, path: Path, max_position_embeddings: int = 4096) -> Path:
    """A random-weight 2-layer Llama with ``model_dir``'s vocabulary and tokenizer files (seeded:
    the same weights on every run with the same torch). Used by the e2e servers and the golden
    outputs script."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    from loom.frontend.tokenizer import Tokenizer

    vocab = Tokenizer.from_model_dir(model_dir).vocab_size
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=max_position_embeddings,
                         initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, path / name)
    return path
