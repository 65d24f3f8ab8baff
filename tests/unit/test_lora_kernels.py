"""The LoRA Triton kernels checked on the CPU through Triton's interpreter (in a child process,
as the paged backend's are), and on a real GPU where there is one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.triton_interpret import run_interpreted

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_lora_kernels_match_the_torch_path_in_interpreter() -> None:
    """The kernels alone against the torch path, then inside a whole engine's layers (the CUDA
    path: the runner's device slot map) against peft's merged model."""
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "lora_interpret_check.py"))
    assert "FAIL" not in stdout and stdout.count("ok case") == 16, stdout
    assert "ok engine case" in stdout, stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_lora_kernels_compile_for_hopper() -> None:
    """The kernels through Triton's compiler for sm_90 (no GPU needed, no launch): what the
    interpreter cannot check, and the shrink's K loop pipelined, the expand's loads vectorized."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "lora_compile_check.py")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 6, proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lora_kernels_on_the_gpu_and_in_a_cuda_graph() -> None:
    from loom.lora.layers import LoraBatch, LoraLayerWeights, lora_batch
    from loom_plugins.lora.sgmv_triton import lora_shrink_expand

    dev = torch.device("cuda")
    layer = LoraLayerWeights(5, 48, 576, [576, 192, 192], torch.bfloat16, dev)
    # A [slot, parts * rank, in] stacks each part's A; B [slot, out, parts * rank] is block
    # diagonal (part i's rows read only part i's rank columns), as LoraSlots writes them.
    offsets = [(0, 576), (576, 768), (768, 960)]
    for s in range(1, 5):
        b = torch.zeros(960, 3 * 48, device=dev)
        for i, (lo, hi) in enumerate(offsets):
            b[lo:hi, i * 48:(i + 1) * 48] = torch.randn(hi - lo, 48, device=dev) * 0.05
        layer.write(s, torch.randn(3 * 48, 576, device=dev) * 0.05, b)
    layer.kernel = lora_shrink_expand

    def torch_path(slots: torch.Tensor, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        rows = [(s, (slots == s).nonzero().squeeze(1)) for s in range(1, 5)]
        with lora_batch(LoraBatch(slots, rows)):
            return layer.add_to(x, base.clone())

    # 104 rows: decode rows of 4 adapters and the base interleaved, then a prefill's run of one
    # adapter; the kernel through the layer (rows sorted by slot, the parts' columns only)
    slots = torch.tensor([0, 1, 2, 3, 4, 4, 0, 1] * 8 + [3] * 40, dtype=torch.int32, device=dev)
    x = torch.randn(104, 576, device=dev, dtype=torch.bfloat16)
    base = torch.randn(104, 960, device=dev, dtype=torch.bfloat16)
    expected = torch_path(slots, x, base)
    out = base.clone()
    with lora_batch(LoraBatch(slots, [], True)):
        layer.add_to(x, out)  # compiles outside the capture
    assert torch.equal(out[slots == 0], base[slots == 0])
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.02)
    lora_shrink_expand(x, layer.a, layer.b, slots, out.copy_(base))  # the old signature: no order, one part
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.02)

    # In a CUDA graph (the order sorted inside it), replayed with the slots shuffled
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), lora_batch(LoraBatch(slots, [], True)):
        layer.add_to(x, out)
    slots.copy_(slots[torch.randperm(104, device=dev)])
    out.copy_(base)
    graph.replay()
    expected = torch_path(slots, x, base)
    assert torch.equal(out[slots == 0], base[slots == 0])
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.02)
