"""GPTQ, AWQ, FP8 and NF4 checkpoints: Loom's dequantized weights against independent references
(bit for bit), greedy outputs against transformers on the same dequantized weights, and
quantizing while loading."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.quant_checkpoints import (
    awq_checkpoint,
    dense_with,
    dequantized_linears,
    fp8_checkpoint,
    gptq_checkpoint,
    nf4_checkpoint,
)
from helpers.reference_attention import ModelHarness
from helpers.tiny_models import hf_logits, load_hf_reference

from loom.model_loader import load_model
from loom.plugin_api import PluginRegistry

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300, 12]
TinyDir = Callable[[str], Path]


def check_against_reference(path: Path, expected: dict[str, torch.Tensor], registry: PluginRegistry,
                            name: str) -> Any:
    loaded = load_model(path, torch.float32, "cpu", registry)
    assert loaded.quantization == name
    ours = dequantized_linears(loaded.model)
    assert ours.keys() == expected.keys()
    for stem, w in expected.items():
        assert torch.equal(ours[stem], w), stem  # bit for bit
    return loaded


def check_greedy_against_transformers(loaded: Any, expected: dict[str, torch.Tensor], dense_dir: Path,
                                      tmp_path: Path, atol: float = 1e-4) -> None:
    ours = ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)
    theirs = hf_logits(load_hf_reference(dense_with(dense_dir, tmp_path / "hf", expected)), PROMPT)
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize(("bits", "group", "sym", "desc_act", "v2"), [
    (4, 32, True, False, False), (4, 64, False, False, False), (8, 32, True, True, False),
    (4, -1, False, False, True), (4, 32, False, True, True), (8, 64, False, False, False),
])
def test_gptq_checkpoint_dequantizes_exactly_and_matches_transformers(
    bits: int, group: int, sym: bool, desc_act: bool, v2: bool, tiny_model_dir: TinyDir,
    quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    dense = tiny_model_dir("llama")
    path, expected = gptq_checkpoint(dense, tmp_path / "gptq", bits=bits, group=group, sym=sym,
                                     desc_act=desc_act, v2=v2)
    loaded = check_against_reference(path, expected, quant_registry, "gptq")
    assert loaded.quantization_settings["bits"] == str(bits)
    assert loaded.quantization_settings["format"] == ("gptq_v2" if v2 else "gptq")
    check_greedy_against_transformers(loaded, expected, dense, tmp_path)


@pytest.mark.parametrize(("model", "desc_act", "config_tied"), [
    ("llama", False, False), ("qwen3", True, False), ("qwen3", False, True)])
def test_gptq_checkpoint_with_a_quantized_head_matches_transformers(
    model: str, desc_act: bool, config_tied: bool, tiny_model_dir: TinyDir, quant_registry: PluginRegistry,
    tmp_path: Path,
) -> None:
    """``lm_head: true`` (GPTQModel's ``lm_head=True``): the head is a GPTQ layer like the others, bit
    for bit against the independent reader. A tied model's head (qwen3 here) has tensors of its
    own, and the embedding stays dense, whether the config was untied (as ``loom quantize``
    writes it) or still says tied (the head's own tensors win)."""
    import json

    dense = tiny_model_dir(model)
    path, expected = gptq_checkpoint(dense, tmp_path / "gptq", group=32, desc_act=desc_act, lm_head=True)
    if config_tied:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    loaded = load_model(path, torch.float32, "cpu", quant_registry)
    head: Any = loaded.model.lm_head
    assert torch.equal(head.quant_method.dequantize(head, torch.float32), expected.pop("lm_head"))
    ours = dequantized_linears(loaded.model)
    assert ours.keys() == expected.keys() and all(torch.equal(ours[k], w) for k, w in expected.items())
    assert loaded.quantization_settings["lm_head"] == "true"
    expected["lm_head"] = head.quant_method.dequantize(head, torch.float32)
    check_greedy_against_transformers(loaded, expected, dense, tmp_path)


def test_gptq_v2_read_as_v1_would_be_wrong(tiny_model_dir: TinyDir, quant_registry: PluginRegistry,
                                          tmp_path: Path) -> None:
    """The format field matters: the same v2 tensors labelled v1 dequantize one step off."""
    import json

    path, expected = gptq_checkpoint(tiny_model_dir("llama"), tmp_path / "v2", sym=False, v2=True)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq"
    (path / "config.json").write_text(json.dumps(config))
    ours = dequantized_linears(load_model(path, torch.float32, "cpu", quant_registry).model)
    assert not any(torch.equal(ours[k], expected[k]) for k in expected)


@pytest.mark.parametrize("group", [32, 64])
def test_awq_checkpoint_dequantizes_exactly_and_matches_transformers(
    group: int, tiny_model_dir: TinyDir, quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    dense = tiny_model_dir("llama")
    path, expected = awq_checkpoint(dense, tmp_path / "awq", group=group)
    loaded = check_against_reference(path, expected, quant_registry, "awq")
    check_greedy_against_transformers(loaded, expected, dense, tmp_path)


@pytest.mark.parametrize(("per_channel", "static", "layout"), [
    (False, True, "fp8"), (False, False, "fp8"), (True, False, "compressed-tensors"),
    (False, True, "compressed-tensors"),
])
def test_fp8_checkpoint_dequantizes_like_compressed_tensors(
    per_channel: bool, static: bool, layout: str, tiny_model_dir: TinyDir, quant_registry: PluginRegistry,
    tmp_path: Path,
) -> None:
    pytest.importorskip("compressed_tensors")
    dense = tiny_model_dir("llama")
    path, expected = fp8_checkpoint(dense, tmp_path / "fp8", per_channel=per_channel, static=static, layout=layout)
    loaded = check_against_reference(path, expected, quant_registry, "fp8")
    assert loaded.quantization_settings["activations"] == ("static" if static else "dynamic")
    # A layer rounds its input to e4m3 as a W8A8 kernel would: per token (dynamic) or with the
    # largest of its parts' static scales, here through compressed-tensors' own quantizer.
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

    layer = loaded.model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    if static:
        scale = layer.input_scale.max().reshape(1, 1)
        args = QuantizationArgs(num_bits=8, type="float", strategy="tensor")
    else:
        scale = x.abs().amax(dim=1, keepdim=True) / 448.0
        args = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
    x_q = dequantize(quantize(x, scale, torch.zeros_like(scale), args, dtype=torch.float8_e4m3fn), scale, None, args,
                     dtype=torch.float32)
    stem = "model.layers.0.self_attn"
    w = torch.cat([expected[f"{stem}.{p}_proj"] for p in "qkv"])
    torch.testing.assert_close(layer(x), x_q @ w.t(), atol=1e-5, rtol=1e-5)
    # The whole model: near the dense one with the same weights (activation rounding apart).
    ours = ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)
    theirs = hf_logits(load_hf_reference(dense_with(dense, tmp_path / "hf", expected)), PROMPT)
    assert float((ours - theirs).norm() / theirs.norm()) < 0.2  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_checkpoint_dequantizes_like_bitsandbytes(
    double_quant: bool, tiny_model_dir: TinyDir, quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    pytest.importorskip("bitsandbytes")
    dense = tiny_model_dir("llama")
    path, expected = nf4_checkpoint(dense, tmp_path / "nf4", double_quant=double_quant)
    loaded = check_against_reference(path, expected, quant_registry, "nf4")
    check_greedy_against_transformers(loaded, expected, dense, tmp_path)


@pytest.mark.parametrize("method", ["fp8", "nf4"])
def test_quantize_while_loading_holds_no_dense_linear_weight(
    method: str, tiny_model_dir: TinyDir, quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    dense = tiny_model_dir("llama")
    loaded = load_model(dense, torch.float32, "cpu", quant_registry, quantize=method)
    assert loaded.quantization == method
    model: Any = loaded.model
    layer = model.model.layers[0].self_attn.qkv_proj
    assert "weight" not in dict(layer.named_parameters())  # quantized, the dense rows dropped
    assert not any(p.dtype == torch.float32 and p.dim() == 2 and "proj" in n for n, p in model.named_parameters())
    ours = dequantized_linears(model)
    reference = load_hf_reference(dense)
    for stem, w in ours.items():
        dense_w = reference.get_submodule(stem).weight
        rel = (w - dense_w).norm() / dense_w.norm()
        assert rel < (0.05 if method == "fp8" else 0.15), (stem, float(rel))
    if method == "nf4":
        pytest.importorskip("bitsandbytes")
        import bitsandbytes.functional as bnbf

        # Our packing is bitsandbytes' format: its dequantize reads our blocks to our weights.
        state = bnbf.QuantState(absmax=layer.nf4_absmax_0, shape=torch.Size(layer.nf4_parts[0][1]),
                                code=layer.nf4_table_0, blocksize=64, quant_type="nf4", dtype=torch.float32)
        theirs = bnbf.dequantize_4bit(layer.nf4_codes_0.reshape(-1, 1), state)
        assert torch.equal(theirs, layer.quant_method.dequantize(layer, torch.float32))


@pytest.mark.parametrize(("bits", "group", "sym", "actorder"), [
    (4, 32, True, None), (4, 64, False, None), (4, -1, True, None), (8, 32, True, "weight"),
    (4, 32, False, "group"), (8, 64, True, "group"),
])
def test_compressed_tensors_pack_quantized_dequantizes_like_compressed_tensors(
    bits: int, group: int, sym: bool, actorder: str | None, tiny_model_dir: TinyDir,
    quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    """LLM Compressor's W4A16 / W8A16 (compressed-tensors pack-quantized), packed by
    compressed-tensors itself: bit for bit against its own decompression, greedy against
    transformers on those weights; the head (``ignore``) stays dense."""
    from helpers.quant_checkpoints import wna16_checkpoint

    dense = tiny_model_dir("llama")
    path, expected = wna16_checkpoint(dense, tmp_path / "ct", bits=bits, group=group, sym=sym, actorder=actorder)
    loaded = check_against_reference(path, expected, quant_registry, "wna16")
    assert loaded.quantization_settings == {"format": "pack-quantized", "bits": str(bits), "group_size": str(group),
                                            "sym": str(sym).lower(), "actorder": str(actorder).lower()}
    assert type(loaded.model.lm_head.quant_method).__name__ == "UnquantizedLinearMethod"
    check_greedy_against_transformers(loaded, expected, dense, tmp_path)


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_head_quantized_too_loads_by_vocabulary_rows(sym: bool, tiny_model_dir: TinyDir,
                                                                       quant_registry: PluginRegistry,
                                                                       tmp_path: Path) -> None:
    """A pack-quantized head (``lm_head`` not in ``ignore``): its tensors hold the vocabulary along
    their rows, the zero points 8 rows a word."""
    from helpers.quant_checkpoints import wna16_checkpoint

    dense = tiny_model_dir("llama")
    path, expected = wna16_checkpoint(dense, tmp_path / "ct", sym=sym, lm_head=True)
    loaded = load_model(path, torch.float32, "cpu", quant_registry)
    head: Any = loaded.model.lm_head
    assert torch.equal(head.quant_method.dequantize(head, torch.float32), expected.pop("lm_head"))
    ours = dequantized_linears(loaded.model)
    assert all(torch.equal(ours[k], w) for k, w in expected.items())
