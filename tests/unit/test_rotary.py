"""RoPE: config reading (transformers 4 and 5 styles) and cos/sin/rotation against transformers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from loom.layers.rotary import get_rope, rope_parameters

HEAD_DIM = 16
SCALINGS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16},
}


def _hf_config(scaling: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                       rope_parameters={**scaling, "rope_theta": 50000.0})


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_cos_sin_and_rotation_match_transformers(kind: str) -> None:
    config = _hf_config(SCALINGS[kind])
    ours = get_rope(config, HEAD_DIM)
    theirs = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 65, 200, 255])
    q, k = torch.randn(len(positions), 4, HEAD_DIM), torch.randn(len(positions), 2, HEAD_DIM)
    cos, sin = theirs(q, positions[None])  # [1, T, D]
    ref_q, ref_k = apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    got_q, got_k = ours(positions, q, k)
    torch.testing.assert_close(got_q, ref_q[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, ref_k[0], atol=1e-6, rtol=1e-6)


def test_transformers4_style_config_is_read() -> None:
    old = SimpleNamespace(rope_theta=50000.0, rope_scaling={"type": "linear", "factor": 4.0},
                          max_position_embeddings=256)
    params = rope_parameters(old)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 50000.0 and params["factor"] == 4.0
    new = _hf_config(SCALINGS["linear"])
    positions = torch.arange(256)
    q = torch.randn(256, 2, HEAD_DIM)
    torch.testing.assert_close(get_rope(old, HEAD_DIM)(positions, q, q)[0], get_rope(new, HEAD_DIM)(positions, q, q)[0])


def test_missing_rope_fields_default_to_theta_10000() -> None:
    params = rope_parameters(SimpleNamespace(max_position_embeddings=32))
    assert params == {"rope_type": "default", "rope_theta": 10000.0}


def test_llama3_original_length_defaults_to_max_positions() -> None:
    cfg = SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                          max_position_embeddings=128)
    assert rope_parameters(cfg)["original_max_position_embeddings"] == 128


def test_unsupported_rope_type_is_refused() -> None:
    cfg = SimpleNamespace(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}, max_position_embeddings=64)
    with pytest.raises(ValueError, match="unsupported RoPE type 'longrope'"):
        get_rope(cfg, HEAD_DIM)


def test_half_precision_rotation_matches_transformers() -> None:
    config = _hf_config(SCALINGS["default"])
    positions = torch.arange(40)
    q = torch.randn(40, 4, HEAD_DIM).to(torch.bfloat16)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    ref_q, _ = apply_rotary_pos_emb(q[None], q[None], cos, sin, unsqueeze_dim=2)
    got_q, _ = get_rope(config, HEAD_DIM)(positions, q, q)
    assert got_q.dtype == torch.bfloat16
    assert torch.equal(got_q, ref_q[0])
