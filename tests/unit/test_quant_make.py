"""``loom quantize``: each method's checkpoint loads and serves; GPTQ and AWQ beat round-to-nearest
on the layer outputs they optimise; packed layouts read back with the tests' own readers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.quant_checkpoints import AWQ_PACK_ORDER, np_unpack_words
from helpers.reference_attention import ModelHarness
from safetensors.torch import load_file

from loom.cli import main as loom_main
from loom.model_loader import load_model
from loom.plugin_api import PluginRegistry
from loom_plugins.quant.make.gptq_solver import HessianAccumulator, gptq_quantize
from loom_plugins.quant.make.group_quant import rtn
from loom_plugins.quant.make.pipeline import QuantizeRequest, quantize_model

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300, 12]
TinyDir = Callable[[str], Path]
FAST = {"samples": 2, "seq_len": 64}
# name -> (loom quantize options, the quantizer plugin that serves the checkpoint)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "rtn-g32": ({"method": "rtn", "bits": 4, "group_size": 32}, "gptq"),
    "gptq-g32-act-order": ({"method": "gptq", "bits": 4, "group_size": 32, "act_order": True}, "gptq"),
    "gptq-8bit-per-channel": ({"method": "gptq", "bits": 8, "group_size": -1}, "gptq"),
    "awq-g32": ({"method": "awq", "bits": 4, "group_size": 32}, "awq"),
    "fp8": ({"method": "fp8"}, "fp8"),
    "nf4": ({"method": "nf4"}, "nf4"),
}
FOUR_BIT = ("rtn-g32", "gptq-g32-act-order", "awq-g32", "nf4")


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_model_dir: TinyDir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a word-level tokenizer (calibration needs one)."""
    import shutil

    from loom.model_loader.random_model import _write_tokenizer

    path = tmp_path_factory.mktemp("tiny-tok") / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    _write_tokenizer(320, path)
    return path


@pytest.fixture(scope="module")
def made(tiny_with_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case's checkpoint, written once for the module (the tests below read them)."""
    out = tmp_path_factory.mktemp("quantized")
    return {name: quantize_model(tiny_with_tokenizer, out / name, QuantizeRequest(**options, **FAST), progress=False)
            for name, (options, _) in CASES.items()}


def _logits(path: Path, registry: PluginRegistry, quantize: str = "auto") -> tuple[Any, torch.Tensor]:
    loaded = load_model(path, torch.float32, "cpu", registry, quantize)
    return loaded, ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)


@pytest.fixture(scope="module")
def logit_errors(made: dict[str, Path], tiny_with_tokenizer: Path, quant_registry: PluginRegistry) -> dict[str, float]:
    """Each checkpoint's ||logits - dense logits|| / ||dense logits|| on PROMPT, served by its plugin."""
    _, dense = _logits(tiny_with_tokenizer, quant_registry, "none")
    errors = {}
    for name, path in made.items():
        loaded, ours = _logits(path, quant_registry)
        assert loaded.quantization == CASES[name][1], name
        errors[name] = float((ours - dense).norm() / dense.norm())
    return errors


@pytest.mark.parametrize("name", list(CASES))
def test_quantize_round_trip_loads_and_serves(name: str, made: dict[str, Path], logit_errors: dict[str, float]) -> None:
    out = made[name]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" in config and (out / "tokenizer.json").is_file()
    rel = logit_errors[name]
    # A random tiny model's logits against its dense ones (chaotic on purpose: initializer_range
    # 0.15, peaked logits): 8-bit integers keep them within 5%; FP8 rounds weights AND activations
    # (dynamic per token) to e4m3's 3 mantissa bits (up to 6% per element each), 0.127 measured
    # here, so 0.25; 4-bit schemes within 0.6. Garbage is near 1.
    bound = 0.05 if name == "gptq-8bit-per-channel" else 0.25 if name == "fp8" else 0.6
    assert 0 < rel < bound, rel  # something was quantized, and not garbage


def test_more_bits_move_the_model_less(logit_errors: dict[str, float]) -> None:
    """8-bit integers < FP8 (e4m3: 3 mantissa bits) < every 4-bit method, on the same model."""
    assert logit_errors["gptq-8bit-per-channel"] < logit_errors["fp8"] < min(logit_errors[n] for n in FOUR_BIT)


def test_written_gptq_and_awq_read_back_with_independent_unpackers(made: dict[str, Path],
                                                                    quant_registry: PluginRegistry) -> None:
    for name in ("gptq-g32-act-order", "awq-g32"):
        out = made[name]
        tensors = load_file(str(out / "model.safetensors"))
        loaded = load_model(out, torch.float32, "cpu", quant_registry)
        layer: Any = loaded.model.model.layers[1].mlp.down_proj
        stem = "model.layers.1.mlp.down_proj"
        if name.startswith("gptq"):
            q = np_unpack_words(tensors[f"{stem}.qweight"].numpy(), 4, axis=0)
            z = np_unpack_words(tensors[f"{stem}.qzeros"].numpy(), 4, axis=1) + 1
            g = tensors[f"{stem}.g_idx"].numpy().astype(np.int64)
            assert not np.array_equal(g, np.arange(q.shape[0]) // 32)  # act-order: groups follow another order
        else:
            q = np_unpack_words(tensors[f"{stem}.qweight"].numpy(), 4, axis=1, order=AWQ_PACK_ORDER)
            z = np_unpack_words(tensors[f"{stem}.qzeros"].numpy(), 4, axis=1, order=AWQ_PACK_ORDER)
            g = np.arange(q.shape[0]) // 32
        s = tensors[f"{stem}.scales"].numpy().astype(np.float32)
        expected = torch.from_numpy(np.ascontiguousarray(((q - z[g]).astype(np.float32) * s[g]).T))
        assert torch.equal(layer.quant_method.dequantize(layer, torch.float32), expected)


def test_gptq_beats_round_to_nearest_on_the_calibration_outputs() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    # correlated inputs with a few large channels: where compensating errors pays
    x = torch.randn(2048, 128, generator=g) @ (torch.eye(128) + 0.3 * torch.randn(128, 128, generator=g))
    x[:, :4] *= 8
    acc = HessianAccumulator(128)
    acc.add(x)
    for act_order in (False, True):
        ours = gptq_quantize(w, acc.hessian(), 4, 32, sym=True, act_order=act_order).dequantize()
        floor = rtn(w, 4, 32, sym=True).dequantize()
        err, err_rtn = ((x @ (ours - w).t()) ** 2).mean(), ((x @ (floor - w).t()) ** 2).mean()
        assert err < 0.8 * err_rtn, (act_order, float(err), float(err_rtn))


def test_awq_scales_keep_the_float_function_and_lower_the_error(tiny_with_tokenizer: Path, tmp_path: Path) -> None:
    from loom_plugins.quant.make.awq_search import fake_quantize, search_scales

    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g) * 0.1
    x = torch.randn(1024, 128, generator=g)
    x[:, :8] *= 20  # salient channels
    s = search_scales(x, [w], 4, 32)
    assert torch.allclose((x / s) @ (w * s).t(), x @ w.t(), atol=1e-4, rtol=1e-4)
    err_awq = ((x / s) @ fake_quantize(w * s, 4, 32).t() - x @ w.t()).pow(2).mean()
    err_rtn = (x @ fake_quantize(w, 4, 32).t() - x @ w.t()).pow(2).mean()
    assert err_awq < err_rtn


def test_group_size_that_does_not_divide_is_refused_with_exit_2(tiny_with_tokenizer: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = loom_main(["quantize", "--method", "gptq", "--group-size", "48", str(tiny_with_tokenizer),
                      str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--group-size 48 does not divide the input size 64 of model.layers.0.self_attn.q_proj" in err
    assert "use --group-size 32 or 64" in err
    assert not (tmp_path / "out").exists()


def test_damping_outside_its_range_is_refused_with_exit_2(tiny_with_tokenizer: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = loom_main(["quantize", "--method", "gptq", "--group-size", "32", "--damp", "0", str(tiny_with_tokenizer),
                      str(tmp_path / "out")])
    assert code == 2
    assert "--damp 0.0: expected a share of the Hessian's mean diagonal in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("device", "message"), [
    ("tpu", "--device 'tpu': expected cpu or cuda (cuda:N)"),
    ("meta", "--device 'meta': expected cpu or cuda (cuda:N)"),
    pytest.param("cuda", "--device cuda: this machine has no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has CUDA")),
    pytest.param("cuda:7", "CUDA device", marks=pytest.mark.skipif(
        torch.cuda.device_count() > 7, reason="this machine has 8 GPUs"))])
def test_a_device_that_cannot_quantize_is_refused_with_exit_2(device: str, message: str, tiny_with_tokenizer: Path,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = loom_main(["quantize", "--method", "rtn", "--group-size", "32", "--device", device,
                      str(tiny_with_tokenizer), str(tmp_path / "out")])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sink_weight_counts_the_first_token_of_each_window_more() -> None:
    from loom_plugins.quant.make.pipeline import QuantizeError, QuantizeRequest, _adder

    x = torch.randn(2, 5, 4, dtype=torch.float64)  # [windows, tokens, inputs]
    plain, weighted = HessianAccumulator(4), HessianAccumulator(4)
    _adder(plain)("x", x)
    _adder(weighted, 9.0)("x", x)
    flat, first = x.reshape(-1, 4), x[:, 0]
    assert torch.allclose(plain.h, flat.t() @ flat)
    assert torch.allclose(weighted.h, flat.t() @ flat + 8 * first.t() @ first)  # 9 times in all
    with pytest.raises(QuantizeError, match=r"--sink-weight 0\.5: expected at least 1"):
        QuantizeRequest(method="gptq", sink_weight=0.5).check()


def _head_reference(tensors: dict[str, torch.Tensor], bits: int, group: int) -> torch.Tensor:
    """The written head read back by the tests' own unpacker (GPTQ v1, no act-order)."""
    q = np_unpack_words(tensors["lm_head.qweight"].numpy(), bits, axis=0)
    z = np_unpack_words(tensors["lm_head.qzeros"].numpy(), bits, axis=1) + 1
    g = np.arange(q.shape[0]) // group
    s = tensors["lm_head.scales"].numpy().astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(((q - z[g]).astype(np.float32) * s[g]).T))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_lm_head_quantizes_the_head_as_gptqmodel_marks_it(method: str, tiny_with_tokenizer: Path, tmp_path: Path,
                                                         quant_registry: PluginRegistry,
                                                         logit_errors: dict[str, float]) -> None:
    out = quantize_model(tiny_with_tokenizer, tmp_path / method,
                         QuantizeRequest(method=method, bits=4, group_size=32, lm_head=True, **FAST), progress=False)
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["lm_head"] is True
    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    loaded, ours = _logits(out, quant_registry)
    head: Any = loaded.model.lm_head
    assert torch.equal(head.quant_method.dequantize(head, torch.float32), _head_reference(tensors, 4, 32))
    assert loaded.quantization_settings["lm_head"] == "true"
    _, dense = _logits(tiny_with_tokenizer, quant_registry, "none")
    rel = float((ours - dense).norm() / dense.norm())
    # more moved than the body alone (the same rounding, one layer more), and still not garbage
    assert logit_errors["rtn-g32"] < rel < 0.8 if method == "rtn" else 0 < rel < 0.8, rel


def test_lm_head_of_a_tied_model_gets_tensors_of_its_own(tiny_model_dir: TinyDir, tmp_path: Path,
                                                         quant_registry: PluginRegistry) -> None:
    import shutil

    from loom.model_loader.random_model import _write_tokenizer

    source = tmp_path / "qwen3"
    shutil.copytree(tiny_model_dir("qwen3"), source)  # tie_word_embeddings: true
    _write_tokenizer(320, source)
    out = quantize_model(source, tmp_path / "out", QuantizeRequest(method="rtn", group_size=32, lm_head=True),
                         progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["lm_head"] is True
    tensors = load_file(str(out / "model.safetensors"))
    embedding = load_file(str(source / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(tensors["model.embed_tokens.weight"], embedding)  # the embedding stays dense
    loaded = load_model(out, torch.float32, "cpu", quant_registry)
    head: Any = loaded.model.lm_head
    assert head.tied_to is None
    assert torch.equal(head.quant_method.dequantize(head, torch.float32), _head_reference(tensors, 4, 32))
    assert float((_head_reference(tensors, 4, 32) - embedding).abs().max()) < float(embedding.abs().max()) / 7


def test_gptq_head_beats_round_to_nearest_on_its_calibration_inputs(tiny_with_tokenizer: Path) -> None:
    """The head's GPTQ Hessian is the final norm's outputs: on those, its error is below RTN's."""
    from transformers import AutoTokenizer

    from loom_plugins.quant.make.calibration import calibration_windows
    from loom_plugins.quant.make.pipeline import gptq_head, load_source

    model = load_source(tiny_with_tokenizer)
    ids = calibration_windows(AutoTokenizer.from_pretrained(str(tiny_with_tokenizer)), 2, 64, 320)
    captured: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    with torch.no_grad():
        model(ids, use_cache=False)
    handle.remove()
    request = QuantizeRequest(method="gptq", group_size=32, lm_head=True)
    w = model.lm_head.weight.data.clone()
    ours = gptq_head(model, captured[0], request).dequantize()
    assert torch.equal(model.lm_head.weight.data, w)  # (not changed: tied, it would be the embedding)
    with torch.no_grad():
        x = model.model.norm(captured[0]).reshape(-1, w.shape[1])
    err, err_rtn = ((x @ (ours - w).t()) ** 2).mean(), ((x @ (rtn(w, 4, 32, sym=True).dequantize() - w).t()) ** 2).mean()
    assert err < 0.5 * err_rtn, (float(err), float(err_rtn))  # (measured: 0.06x)


def test_lm_head_with_a_format_that_keeps_the_head_dense_is_refused_with_exit_2(
        tiny_with_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = loom_main(["quantize", "--method", "awq", "--group-size", "32", "--lm-head", str(tiny_with_tokenizer),
                      str(tmp_path / "out")])
    assert code == 2
    assert ("--lm-head applies to --method gptq and rtn (GPTQ checkpoints say lm_head: true); awq checkpoints keep "
            "the head dense") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
