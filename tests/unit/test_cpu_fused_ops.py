"""The CPU's fused RMSNorm and RoPE operators against the torch path they replace (float32)."""

from __future__ import annotations

import pytest
import torch

from loom.layers import cpu_fused
from loom.layers.norm import RMSNorm
from loom.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_fused.available(),
                                reason=f"CPU fused ops unavailable: {cpu_fused.unavailable_reason()}")


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from loom import kernel_switches

    monkeypatch.setattr(kernel_switches, "fused_kernels", False)


@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("hidden", [576, 100])
def test_norm_with_residual_matches_torch_path(rows: int, hidden: int, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=g)
    x, residual = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    wide = torch.randn(rows, 2 * hidden, generator=g)[:, :hidden]  # a strided view, as splits give
    fused = norm.forward_with_residual(x, residual), norm(x), norm(wide)
    assert cpu_fused.norm_supported(wide, norm.weight, residual)
    _torch_path(monkeypatch)
    reference = norm.forward_with_residual(x, residual), norm(x), norm(wide)
    assert torch.equal(fused[0][1], reference[0][1])  # the residual add: the same bits
    for got, want in ((fused[0][0], reference[0][0]), (fused[1], reference[1]), (fused[2], reference[2])):
        # the sum of squares is reduced in another order: a few float32 ulps apart at most
        torch.testing.assert_close(got, want, atol=0, rtol=6e-7)


def test_rotary_matches_torch_path_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    rope = RotaryEmbedding(64, 4096, inv_freq)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, 960, generator=g)
    q, k = qkv[:, :576].view(9, 9, 64), qkv[:, 576:768].view(9, 3, 64)  # strided, as in the model
    positions = torch.tensor([0, 1, 5, 17, 100, 4095, 3, 3, 2000])
    fused = rope(positions, q, k)
    _torch_path(monkeypatch)
    reference = rope(positions, q, k)
    assert torch.equal(fused[0], reference[0]) and torch.equal(fused[1], reference[1])


def test_operators_refuse_bad_operands() -> None:
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        cpu_fused.rotary(torch.tensor([4096]), torch.randn(1, 2, 8), torch.randn(1, 1, 8),
                         torch.randn(4096, 4), torch.randn(4096, 4))
    with pytest.raises(RuntimeError, match="weight must be float32"):
        cpu_fused.add_rms_norm(torch.randn(2, 8), None, torch.randn(7), 1e-6)


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_silu_and_mul_matches_torch_path(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from loom.layers.activation import SiluAndMul

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * 1539, generator=g) * 8  # odd width: the scalar tail too
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far outside exp's clamped range
    fused = SiluAndMul()(x)
    _torch_path(monkeypatch)
    torch.testing.assert_close(fused, SiluAndMul()(x), atol=1e-30, rtol=1e-6)
