"""``loom quantize --device cuda``: each decoder layer calibrated and quantized on the GPU, the model
kept in host memory. The checkpoint equals the CPU's in its tensors and layout, its codes up to the
rounding of the few weights float32 arithmetic on another device puts on the other side of a step,
and it serves the same logits within the quantization's own noise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.reference_attention import ModelHarness
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
    source = resolve_model_dir("random:tiny-llama")
    options = {**CASES[name], "samples": 2, "seq_len": 64}
    cpu = quantize_model(source, tmp_path / "cpu", QuantizeRequest(**options, device="cpu"), progress=False)
    gpu = quantize_model(source, tmp_path / "gpu", QuantizeRequest(**options, device="cuda"), progress=False)
    a, b = load_file(str(cpu / "model.safetensors")), load_file(str(gpu / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        if key.endswith(("qweight", "qzeros", "scales", "g_idx")):
            continue
        assert torch.equal(a[key], b[key]), key  # the dense tensors (embedding, norms, head)
    if name != "gptq-act-order":  # (act-order may order near-equal Hessian diagonals otherwise)
        words = sum(a[k].numel() for k in a if k.endswith("qweight"))
        differing = sum(int((a[k] != b[k]).sum()) for k in a if k.endswith("qweight"))  # a code apart
        assert differing <= 0.05 * words, f"{differing} of {words} packed words differ"
        for k in (k for k in a if k.endswith("scales")):
            torch.testing.assert_close(a[k].float(), b[k].float(), rtol=2e-2, atol=1e-4)

    def logits(path: Path) -> torch.Tensor:
        loaded = load_model(path, torch.float32, "cpu", quant_registry, "auto")
        return ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)

    on_cpu, on_gpu = logits(cpu), logits(gpu)
    assert float((on_gpu - on_cpu).norm() / on_cpu.norm()) < 2e-2
