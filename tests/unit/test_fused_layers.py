"""The fused layer kernels (``loom.layers.fused_ops``) and the residual-carrying decoder layers.

The kernels are checked on the CPU through Triton's interpreter, against the layers' torch code,
in a child process (the interpreter is chosen when the kernels are defined, and must not leak
into a process that also compiles them for a GPU); skipped where triton is not installed. The
checks and their tolerances are in ``helpers/fused_cases.py``. The other tests run here: the
CPU keeps the torch path, bit for bit, whatever the restructuring around it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.reference_attention import ModelHarness
from helpers.triton_interpret import run_interpreted

from loom.layers import fused_ops
from loom.layers.activation import SiluAndMul
from loom.layers.norm import RMSNorm
from loom.layers.rotary import RotaryEmbedding, _default_inv_freq
from loom.model_loader import load_model
from loom.plugin_api import PluginRegistry

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300, 12, 77, 31, 200, 9, 4, 180, 66]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("group", ["norm", "combine_norm", "head_norm", "rotary", "qk_norm_rotary", "silu",
                                   "quantized_input", "model"])
def test_fused_kernels_match_torch_path_in_interpreter(group: str) -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "fused_interpret_check.py"), group)
    assert "FAIL" not in stdout and "ok " in stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize(("group", "cases"), [("qk_norm_rotary", 4), ("combine_norm", 3), ("quantized_input", 5)])
def test_fused_norms_compile_for_hopper_and_reduce_as_the_norm(group: str, cases: int) -> None:
    """The q/k norm + RoPE kernel and the norm that sums an MoE layer's rows, compiled for sm_90
    (no GPU needed): no spills, and their sum of squares in the plain norm kernel's layout (so the
    same bits on the GPU as the launches they replace)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "layout_compile_check.py"), group],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("ok  ") == cases, proc.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_with_residual_on_cpu_is_add_then_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-6).to(dtype)
    norm.weight.data = (1 + 0.5 * torch.randn(96)).to(dtype)
    x, residual = torch.randn(5, 96).to(dtype), (4 * torch.randn(5, 96)).to(dtype)
    out, h = norm.forward_with_residual(x, residual)
    assert torch.equal(h, residual + x)
    assert torch.equal(out, norm(residual + x))


def test_cpu_tensors_never_take_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a fused kernel was launched for CPU tensors")

    for name in ("fused_add_rms_norm", "rotary", "silu_and_mul"):
        monkeypatch.setattr(fused_ops, name, refuse)
    x = torch.randn(3, 64)
    assert not fused_ops.enabled(x)
    norm = RMSNorm(64)
    norm(x)
    norm.forward_with_residual(x, x)
    RMSNorm(16)(x.view(3, 4, 16))
    rope = RotaryEmbedding(16, 32, _default_inv_freq(10000.0, 16))
    rope(torch.arange(3), x.view(3, 4, 16), x[:, :32].view(3, 2, 16))
    SiluAndMul()(x)


def test_fused_path_needs_cuda_and_triton_and_no_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    on_gpu: Any = SimpleNamespace(is_cuda=True)  # stands in for a CUDA tensor
    on_cpu: Any = SimpleNamespace(is_cuda=False)
    monkeypatch.setattr(fused_ops, "HAS_TRITON", True)
    from loom import kernel_switches

    monkeypatch.setattr(kernel_switches, "fused_kernels", True)
    assert fused_ops.enabled(on_gpu)
    assert not fused_ops.enabled(on_cpu)
    with kernel_switches.fused_kernels_off():
        assert not fused_ops.enabled(on_gpu)
    assert fused_ops.enabled(on_gpu)
    monkeypatch.setattr(fused_ops, "HAS_TRITON", False)
    assert not fused_ops.enabled(on_gpu)


def test_layers_import_and_run_without_triton() -> None:
    # sys.modules[name] = None makes `import name` raise ImportError, as if not installed.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from loom.layers import fused_ops\n"
        "from loom.layers.norm import RMSNorm\n"
        "from loom.layers.activation import SiluAndMul\n"
        "assert not fused_ops.HAS_TRITON\n"
        "x = torch.randn(2, 8)\n"
        "RMSNorm(8).forward_with_residual(x, x); SiluAndMul()(x)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


class _HFOrder:
    """A loaded Llama-family model run in HF's order, as the layers did before they carried the
    residual: ``h = h + attn(norm1(h)); h = h + mlp(norm2(h))`` per layer, then ``norm(h)``."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)
        for layer in inner.layers:
            hidden = hidden + layer.self_attn(positions, layer.input_layernorm(hidden), inner.rotary_emb)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return inner.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3"])
def test_residual_carrying_layers_are_bit_identical_to_hf_order_on_cpu(
    variant: str, dtype: torch.dtype, tiny_model_dir: Callable[[str], Path], models_registry: PluginRegistry
) -> None:
    loaded = load_model(tiny_model_dir(variant), dtype, torch.device("cpu"), models_registry)
    ours = ModelHarness(loaded.model, loaded.hf_config, dtype=dtype).prefill(PROMPT)
    reference = ModelHarness(_HFOrder(loaded.model), loaded.hf_config, dtype=dtype).prefill(PROMPT)
    assert torch.equal(ours, reference)
