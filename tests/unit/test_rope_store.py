"""RoPE handed to the attention layer unapplied (``loom.layers.rotary.PendingRope``), and the paged
backend's RoPE-and-store launch (``rope_store``) on a machine without a GPU: the kernel through
Triton's interpreter and compiled for sm_90 (each in a child process), where the layer applies the
rope itself, and when one kernel may not serve it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.triton_interpret import run_interpreted

from loom import kernel_switches
from loom.layers import fused_ops
from loom.layers.attention import Attention, AttentionBackend, ForwardContext, forward_context
from loom.layers.norm import GemmaRMSNorm, RMSNorm
from loom.layers.rotary import PendingRope, RotaryEmbedding, _default_inv_freq

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_rope_and_store_in_one_launch_give_the_two_launches_bits_in_the_interpreter() -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "rope_store_interpret_check.py"))
    assert "FAIL" not in stdout and stdout.count("ok  ") == 7, stdout


@needs_triton
def test_rope_store_compiles_for_hopper_and_normalises_in_the_qk_norm_kernels_order() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "layout_compile_check.py"), "rope_store"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and proc.stdout.count("ok   rope_store") == 3, proc.stdout + proc.stderr


class _Recorder(AttentionBackend[None]):
    """Records what forward() was given; returns q."""

    name = "recorder"

    def __init__(self, rope_store: bool) -> None:
        super().__init__(4, 2, 8, torch.float32, torch.device("cpu"))
        self.supports_rope_store = rope_store
        self.calls: list[dict[str, Any]] = []

    def prepare(self, meta: Any) -> None:
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                plan: None, scale: float, sliding_window: int | None, logits_soft_cap: float | None = None,
                rope: PendingRope | None = None) -> torch.Tensor:
        self.calls.append({"q": q.clone(), "k": k.clone(), "rope": rope})
        return q


def _layer_inputs(norms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PendingRope]:
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 32, generator=gen), torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
    rotary = RotaryEmbedding(8, 64, _default_inv_freq(10000.0, 8))
    qn, kn = (RMSNorm(8), RMSNorm(8)) if norms else (None, None)
    return q, k, v, PendingRope(rotary, torch.tensor([0, 5, 9]), qn, kn)


@pytest.mark.parametrize("norms", [False, True])
def test_the_attention_layer_applies_the_rope_unless_the_backend_takes_it(norms: bool) -> None:
    q, k, v, rope = _layer_inputs(norms)
    layer = Attention(0, 4, 2, 8)
    for takes in (False, True):
        backend = _Recorder(takes)
        with forward_context(ForwardContext(backend, [torch.zeros(1)], None, None)):  # type: ignore[arg-type]
            layer(q, k, v, rope)
        call = backend.calls[0]
        if takes:  # unrotated, and the rope handed over
            assert call["rope"] is rope
            assert torch.equal(call["q"], q.view(3, 4, 8)) and torch.equal(call["k"], k.view(3, 2, 8))
        else:  # rotated here, as the model did before
            want_q, want_k = rope.apply(q.view(3, 4, 8), k.view(3, 2, 8))
            assert call["rope"] is None
            assert torch.equal(call["q"], want_q) and torch.equal(call["k"], want_k)


def test_one_kernel_serves_the_rope_only_where_it_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    positions = torch.tensor([1, 2])
    rotary = RotaryEmbedding(8, 64, _default_inv_freq(10000.0, 8))
    monkeypatch.setattr(fused_ops, "enabled", lambda x: True)  # as on CUDA
    assert PendingRope(rotary, positions).kernel_args(q, k) is not None
    args = PendingRope(rotary, positions, RMSNorm(8), RMSNorm(8)).kernel_args(q, k)
    assert args is not None and args.q_weight is not None and not args.gemma
    args = PendingRope(rotary, positions, GemmaRMSNorm(8), GemmaRMSNorm(8)).kernel_args(q, k)
    assert args is not None and args.gemma

    class OwnNorm(RMSNorm):
        pass

    partial = RotaryEmbedding(8, 64, _default_inv_freq(10000.0, 4), rotary_dim=4)
    assert PendingRope(partial, positions).kernel_args(q, k) is None  # Phi-4-mini's partial rotary
    assert PendingRope(rotary, positions, OwnNorm(8), OwnNorm(8)).kernel_args(q, k) is None  # its own forward
    assert PendingRope(rotary, positions, RMSNorm(8), GemmaRMSNorm(8)).kernel_args(q, k) is None
    assert PendingRope(rotary, positions, RMSNorm(8), None).kernel_args(q, k) is None
    assert PendingRope(rotary, positions).kernel_args(torch.zeros(8, 4, 2).transpose(1, 2), k) is None  # strided D
    monkeypatch.setattr(kernel_switches, "rope_store", False)
    assert PendingRope(rotary, positions).kernel_args(q, k) is None
    monkeypatch.undo()
    assert PendingRope(rotary, positions).kernel_args(q, k) is None  # the CPU: the model's own path
