"""Our model plugins against transformers: same checkpoint, same logits (fp32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.reference_attention import ModelHarness, ReferenceAttentionBackend
from helpers.tiny_models import TINY_CONFIGS, hf_logits, load_hf_reference

from loom.layers.attention import AttentionBackend
from loom.model_loader import eos_token_ids, load_model, resolve_model_dir
from loom.plugin_api import PluginRegistry

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300, 12, 77, 31, 200, 9, 4, 180, 66]
EXPECTED_PLUGIN = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "mixtral",
    "qwen3-moe": "qwen3-moe", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
}


def _plugin_for(variant: str) -> str:
    """The plugin of the longest name the variant starts with (qwen3-moe-norm-topk: qwen3-moe)."""
    prefix = max((p for p in EXPECTED_PLUGIN if variant.startswith(p)), key=len)
    return EXPECTED_PLUGIN[prefix]


@pytest.mark.parametrize("variant", sorted(TINY_CONFIGS))
def test_prefill_logits_match_transformers(
    variant: str, tiny_model_dir: Callable[[str], Path], models_registry: PluginRegistry
) -> None:
    path = tiny_model_dir(variant)
    loaded = load_model(path, torch.float32, torch.device("cpu"), models_registry)
    assert loaded.architecture == _plugin_for(variant)
    ours = ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)  # [T, V]
    theirs = hf_logits(load_hf_reference(path), PROMPT)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def _backend(name: str) -> type[AttentionBackend]:
    if name == "reference":
        return ReferenceAttentionBackend
    module = pytest.importorskip("loom_plugins.attention.torch_backend")
    return module.TorchAttentionBackend


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3-moe", "gemma2",
                                     "gemma3", "phi3-longrope"])
def test_chunked_prefill_and_decode_match_one_shot_prefill(
    variant: str, backend: str, tiny_model_dir: Callable[[str], Path], models_registry: PluginRegistry
) -> None:
    """Positions and the KV cache are honoured: later chunks see earlier chunks' keys/values."""
    loaded = load_model(tiny_model_dir(variant), torch.float32, torch.device("cpu"), models_registry)
    full = ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)
    harness = ModelHarness(loaded.model, loaded.hf_config, backend_cls=_backend(backend))
    # Two sequences batched together: seq 1 prefills the prompt in chunks while seq 0 decodes.
    pieces = [harness.step([(0, PROMPT[:8], 0), (1, PROMPT[:5], 0)])]
    pieces.append(harness.step([(1, PROMPT[5:13], 5)]))
    decode = [harness.step([(0, [PROMPT[i]], i), (1, [PROMPT[13 + i - 8]], 13 + i - 8)]) for i in range(8, 12)]
    torch.testing.assert_close(pieces[0][:8], full[:8], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pieces[0][8:], full[:5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pieces[1], full[5:13], atol=1e-4, rtol=1e-4)
    for i, logits in enumerate(decode):
        torch.testing.assert_close(logits[0], full[8 + i], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[1], full[13 + i], atol=1e-4, rtol=1e-4)


def test_bfloat16_load_builds_half_params_and_float32_logits(
    tiny_model_dir: Callable[[str], Path], models_registry: PluginRegistry
) -> None:
    path = tiny_model_dir("llama")
    loaded = load_model(path, torch.bfloat16, torch.device("cpu"), models_registry)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored after building
    ours = ModelHarness(loaded.model, loaded.hf_config, dtype=torch.bfloat16).prefill(PROMPT)
    theirs = hf_logits(load_hf_reference(path), PROMPT)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=0.15, rtol=0.05)


@pytest.mark.slow
def test_default_gguf_converts_once_and_matches_transformers(
    default_model_dir: Path, models_registry: PluginRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real SmolLM2-135M-Instruct, dequantized from the bundled GGUF."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from loom.model_loader import gguf_cache

    def converted_again(*args: object) -> None:
        raise AssertionError("the cached GGUF conversion was made again")

    monkeypatch.setattr(gguf_cache, "_convert", converted_again)
    assert resolve_model_dir(None) == default_model_dir  # cached: no second conversion
    assert eos_token_ids(default_model_dir) == (2,)
    config_text = (default_model_dir / "config.json").read_text()
    assert "quantization_config" not in config_text and "LlamaForCausalLM" in config_text

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = tokenizer("The capital of France is")["input_ids"]
    loaded = load_model(default_model_dir, torch.float32, torch.device("cpu"), models_registry)
    assert loaded.architecture == "llama"
    ours = ModelHarness(loaded.model, loaded.hf_config, num_blocks=16).prefill(prompt)
    hf = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, attn_implementation="eager")
    theirs = hf_logits(hf.eval(), prompt)
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
