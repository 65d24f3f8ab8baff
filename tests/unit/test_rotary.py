"""RoPE: config reading (transformers 4 and 5 styles) and cos/sin/rotation against transformers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary

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
    assert params == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}


def test_llama3_original_length_defaults_to_max_positions() -> None:
    cfg = SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                          max_position_embeddings=128)
    assert rope_parameters(cfg)["original_max_position_embeddings"] == 128


def test_unsupported_rope_type_is_refused() -> None:
    cfg = SimpleNamespace(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}, max_position_embeddings=64)
    with pytest.raises(ValueError, match="unsupported RoPE type 'mrope'"):
        get_rope(cfg, HEAD_DIM)


def _phi3_config(partial: float, **rope: Any) -> Phi3Config:
    half = int(HEAD_DIM * partial) // 2
    return Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                      original_max_position_embeddings=64,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                                       "original_max_position_embeddings": 64,
                                       "short_factor": [1.0 + 0.3 * i for i in range(half)],
                                       "long_factor": [2.0 + 1.5 * i for i in range(half)], **rope})


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_uses_short_factors_below_the_original_length_and_long_ones_after(partial: float) -> None:
    """transformers picks one set for a whole forward by its largest position: positions below 64
    with a forward that ends there, positions from 64 on with one that reaches them."""
    config = _phi3_config(partial)
    ours = get_rope(config, HEAD_DIM)
    assert ours.rotary_dim == int(HEAD_DIM * partial)
    q, k = torch.randn(200, 4, HEAD_DIM), torch.randn(200, 2, HEAD_DIM)
    got_q, got_k = ours(torch.arange(200), q, k)
    for lo, hi in ((0, 64), (64, 200)):
        theirs = Phi3RotaryEmbedding(config)
        cos, sin = theirs(q, torch.arange(hi)[None])  # [1, hi, R]: the factors of a forward up to hi
        ref_q, ref_k = phi3_apply_rotary(q[None, :hi], k[None, :hi], cos, sin, unsqueeze_dim=2)
        torch.testing.assert_close(got_q[lo:hi], ref_q[0, lo:], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_k[lo:hi], ref_k[0, lo:], atol=1e-6, rtol=1e-6)
    short_only = get_rope(_phi3_config(partial, long_factor=config.rope_parameters["short_factor"]), HEAD_DIM)
    assert torch.equal(ours.cos_cached[:64], short_only.cos_cached[:64])
    assert not torch.allclose(ours.cos_cached[64:], short_only.cos_cached[64:])  # the long factors bite
    if partial < 1:  # the unrotated tail passes through
        assert torch.equal(got_q[..., ours.rotary_dim:], q[..., ours.rotary_dim:])


def test_su_is_longrope_and_its_scaling_follows_the_length_ratio() -> None:
    old = SimpleNamespace(rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
                          rope_theta=10000.0, max_position_embeddings=4096, original_max_position_embeddings=1024)
    params = rope_parameters(old)
    assert params["rope_type"] == "longrope" and params["original_max_position_embeddings"] == 1024
    rope = get_rope(old, HEAD_DIM)
    scale = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(1024.0))).sqrt()
    torch.testing.assert_close(rope.cos_cached[0, 0], scale)  # cos 0 = 1, times the attention factor
    with pytest.raises(ValueError, match="LongRoPE needs 8 short and long factors, got 8 and 3"):
        get_rope(SimpleNamespace(**{**vars(old), "rope_scaling": {**old.rope_scaling, "long_factor": [1.0] * 3}}),
                 HEAD_DIM)


def test_per_layer_type_parameters_give_one_table_per_type() -> None:
    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                              num_hidden_layers=2, max_position_embeddings=256,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1000000.0}})
    theirs = Gemma3RotaryEmbedding(config)
    positions = torch.tensor([0, 3, 100, 255])
    q = torch.randn(4, 4, HEAD_DIM)
    for layer_type in ("sliding_attention", "full_attention"):
        cos, sin = theirs(q, positions[None], layer_type)
        ref_q, _ = apply_rotary_pos_emb(q[None], q[None], cos, sin, unsqueeze_dim=2)
        got_q, _ = get_rope(config, HEAD_DIM, layer_type=layer_type)(positions, q, q)
        torch.testing.assert_close(got_q, ref_q[0], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="per layer type"):
        get_rope(config, HEAD_DIM)


def test_half_precision_rotation_matches_transformers() -> None:
    config = _hf_config(SCALINGS["default"])
    positions = torch.arange(40)
    q = torch.randn(40, 4, HEAD_DIM).to(torch.bfloat16)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    ref_q, _ = apply_rotary_pos_emb(q[None], q[None], cos, sin, unsqueeze_dim=2)
    got_q, _ = get_rope(config, HEAD_DIM)(positions, q, q)
    assert got_q.dtype == torch.bfloat16
    assert torch.equal(got_q, ref_q[0])
