"""``loom quantize --device cuda``: each decoder layer calibrated and quantized on the GPU, the model
kept in host memory. The checkpoint has the CPU's tensors and layout and the same dense tensors.
Round-to-nearest equals the CPU's up to the rounding that float32 arithmetic on another device
moves (a few codes cross a step). Where calibration makes choices (act-order's column order from
the Hessian's diagonal, AWQ's scale search over a grid), near-equal candidates may go the other
way on the GPU (measured on the H200, 2026-12-03: AWQ's folded norms 12% apart, act-order's logits
0.28 of the quantization's error apart), so there the GPU's checkpoint must be as good as the
CPU's: as close to the dense model's logits within 25%, and closer to the CPU's than either is to
the dense model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.reference_attention import ModelHarness
from helpers.tiny_models import save_tiny_llama_with_vocab_of
from safetensors.torch import load_file

from loom.model_loader import load_model, resolve_model_dir
from loom.plugin_api import PluginRegistry
from loom_plugins.quant.make.pipeline import QuantizeRequest, quantize_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300, 12]
CASES = {
    "gptq-act-order": {"method": "gptq", "group_size": 32, "act_order": True},
    "awq": {"method": "awq", "group_size": 32},
    "rtn": {"method": "rtn", "group_size": 32},
}


@pytest.mark.parametrize("name", list(CASES))
def test_quantizing_on_the_gpu_writes_the_cpus_checkpoint(name: str, tmp_path: Path,
                                                          quant_registry: PluginRegistry) -> None:
    # A saved checkpoint (not random:...), so that the dense model's own logits are at hand.
    source = save_tiny_llama_with_vocab_of(resolve_model_dir("random:tiny-llama"), tmp_path / "dense")
    options = {**CASES[name], "samples": 2, "seq_len": 64}
    cpu = quantize_model(source, tmp_path / "cpu", QuantizeRequest(**options, device="cpu"), progress=False)
    gpu = quantize_model(source, tmp_path / "gpu", QuantizeRequest(**options, device="cuda"), progress=False)
    a, b = load_file(str(cpu / "model.safetensors")), load_file(str(gpu / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        if key.endswith(("qweight", "qzeros", "scales", "g_idx")):
            continue
        if name == "awq" and key.endswith("layernorm.weight"):  # AWQ folds its searched scales into them
            continue
        assert torch.equal(a[key], b[key]), key  # the embedding, the final norm, the head (and rtn's norms)
    if name == "rtn":  # no calibration: the same codes up to rounding
        words = sum(a[k].numel() for k in a if k.endswith("qweight"))
        differing = sum(int((a[k] != b[k]).sum()) for k in a if k.endswith("qweight"))  # a code apart
        assert differing <= 0.05 * words, f"{differing} of {words} packed words differ"
        for k in (k for k in a if k.endswith("scales")):
            torch.testing.assert_close(a[k].float(), b[k].float(), rtol=2e-2, atol=1e-4)

    def logits(path: Path, quantize: str = "auto") -> torch.Tensor:
        loaded = load_model(path, torch.float32, "cpu", quant_registry, quantize)
        return ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)

    dense, on_cpu, on_gpu = logits(source, "none"), logits(cpu), logits(gpu)
    cpu_error, gpu_error = float((on_cpu - dense).norm()), float((on_gpu - dense).norm())
    assert gpu_error <= 1.25 * cpu_error, (gpu_error, cpu_error)  # as good a checkpoint
    assert float((on_gpu - on_cpu).norm()) < 0.5 * cpu_error  # closer to each other than to the dense model
    if name == "rtn":
        assert float((on_gpu - on_cpu).norm() / on_cpu.norm()) < 2e-2
