"""The FP8 weight-only GEMV (``loom_plugins.quant.fp8_gemv``) on CUDA, on llama-8b's four projection
shapes and a ragged one, 1-4 rows, bf16 (the fp16 dot of power-of-two scaled rows) and fp16:

- within float32 accumulation and one rounding of the float64 W8A16 reference ``x @ (codes *
  scale)^T`` (what the GEMV computes: the activations are not rounded to e4m3), and close to the
  W8A8 path it replaces (which rounds them: the two differ by that rounding);
- batch-invariant within 1-4 rows and deterministic run to run, the fused merge's counters back
  at zero; inside a CUDA graph, bit for bit the eager call;
- served by the FP8 layers' CUDA kernel (``fp8.fp8_kernel``) exactly at 1-4 rows, W8A8 from 5
  rows, at the rows a table entry names, and with ``LOOM_FP8_GEMV`` off.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from loom import kernel_switches
from loom.layers import dense_gemv as dg
from loom.layers.split_k import counters
from loom_plugins.quant import fp8_gemv, fp8_gemv_table, fp8_triton
from loom_plugins.quant.fp8 import fp8_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (50, 200)]  # llama-8b's four, ragged
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
OTHER_PLANS = [dg.GemvPlan(128, 128, 8, 4, 3, False), dg.GemvPlan(64, 256, 1, 4, 3, False)]
U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _operands(n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 codes [n, k], per-channel float32 scales [n], 4 activation rows (ordinary, 100x, 1e-4x, zero)."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=CUDA) * 0.02
    scale = (w.abs().amax(dim=1) / 448.0).clamp(min=1e-12).float().contiguous()
    codes = (w / scale[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(dg.MAX_M, k, generator=gen, device=CUDA)
    x[1] *= 100.0
    x[2] *= 1e-4
    x[3] = 0.0
    return codes, scale, x.to(dtype)


def _check(y: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    w = codes.double() * scale.double()[:, None]
    xd = x.double()
    ref = xd @ w.t()
    k = x.shape[-1]
    bound = (k * 2.0**-20) * (xd.abs() @ w.abs().t()) + U[x.dtype] * ref.abs() + 1e-30
    bound += 2.0**-30 * xd.abs().amax(dim=1, keepdim=True) * w.abs().sum(dim=1)[None, :]
    ratio = float(((y.double() - ref).abs() / bound).max())
    assert ratio <= 1.0, f"error / bound {ratio:.3f}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=lambda v: str(v))
def test_matches_w8a16_reference_batch_invariant_and_deterministic(n: int, k: int, dtype: torch.dtype) -> None:
    codes, scale, x = _operands(n, k, dtype, seed=n + k)
    plans = [fp8_gemv.default_plan(n, k, SMS)] + (OTHER_PLANS if dtype == torch.bfloat16 else [])
    for plan in plans:
        whole = fp8_gemv.fp8_gemv(x, codes, scale, None, plan)
        for m in range(1, dg.MAX_M + 1):
            y = fp8_gemv.fp8_gemv(x[:m], codes, scale, None, plan)
            _check(y, x[:m], codes, scale)
            assert torch.equal(y, whole[:m]), f"{plan} m={m}: rows differ from the same rows in a 4-row call"
            assert torch.equal(y, fp8_gemv.fp8_gemv(x[:m], codes, scale, None, plan)), "not deterministic"
        torch.cuda.synchronize()
        ctr = counters(CUDA)
        assert ctr is None or int(ctr.abs().sum()) == 0
    # beside the W8A8 path it replaces (row 0, ordinary values): they differ by e4m3 activations
    state = fp8_triton.FP8GpuWeights(codes, scale.view(1, -1), None, None, fp8_triton.rowwise_supported(0, dtype),
                                     dtype)
    if state.shapes_ok:
        w8a8 = fp8_triton.fp8_linear(x[:1], state, None).float()
        y = fp8_gemv.fp8_gemv(x[:1], codes, scale, None, plans[0]).float()
        assert float((y - w8a8).norm() / w8a8.norm()) < 0.08  # ~2.5% measured by the e4m3 step's RMS


def test_bias_and_3d_inputs() -> None:
    codes, scale, _ = _operands(1536, 4096, torch.bfloat16, seed=5)
    bias = torch.randn(1536, device=CUDA).bfloat16()
    x = torch.randn(2, 2, 4096, device=CUDA).bfloat16()
    plan = fp8_gemv.default_plan(1536, 4096, SMS)
    y = fp8_gemv.fp8_gemv(x, codes, scale, bias, plan)
    assert y.shape == (2, 2, 1536)
    flat = fp8_gemv.fp8_gemv(x.reshape(4, 4096), codes, scale, None, plan).float() + bias.float()
    torch.testing.assert_close(y.reshape(4, 1536).float(), flat, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "launch"])
def test_cuda_graph_replay_equals_eager(fused: bool) -> None:
    codes, scale, _ = _operands(4096, 4096, torch.bfloat16, seed=3)
    plan = dg.GemvPlan(64, 256, 8, 4, 3, fused)
    counters(CUDA)  # allocated before capture, as the engine's warm-up does
    static_x = torch.zeros(2, 4096, device=CUDA, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fp8_gemv.fp8_gemv(static_x, codes, scale, None, plan)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv.fp8_gemv(static_x, codes, scale, None, plan)
    for seed in (1, 2):
        new = torch.randn(2, 4096, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(seed)).bfloat16()
        static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8_gemv.fp8_gemv(new, codes, scale, None, plan))


def test_the_fp8_layer_kernel_serves_1_to_4_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    codes, scale, _ = _operands(1024, 4096, torch.bfloat16, seed=9)
    layer = torch.nn.Module()
    fp8_triton.prepare(layer, codes, scale, None, torch.bfloat16)
    state = layer.fp8_gpu
    x = torch.randn(5, 4096, device=CUDA).bfloat16()
    rule = fp8_gemv.default_plan(1024, 4096, SMS)
    for m in range(1, 5):
        assert torch.equal(fp8_kernel(layer, x[:m], None), fp8_gemv.fp8_gemv(x[:m], codes, scale, None, rule))
    assert torch.equal(fp8_kernel(layer, x, None), fp8_triton.fp8_linear(x, state, None))  # 5 rows: W8A8
    monkeypatch.setattr(fp8_gemv_table, "PLANS", {(SMS, 1024, 4096): (2, 128, 128, 4, 4, 3, True)})
    tabled = dg.GemvPlan(128, 128, 4, 4, 3, True)
    assert torch.equal(fp8_kernel(layer, x[:2], None), fp8_gemv.fp8_gemv(x[:2], codes, scale, None, tabled))
    assert torch.equal(fp8_kernel(layer, x[:3], None), fp8_triton.fp8_linear(x[:3], state, None))
    monkeypatch.setattr(kernel_switches, "fp8_gemv", False)
    assert torch.equal(fp8_kernel(layer, x[:1], None), fp8_triton.fp8_linear(x[:1], state, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (200, 320)], ids=lambda v: str(v))
def test_block_scaled_gemv_matches_its_reference(n: int, k: int, dtype: torch.dtype) -> None:
    """Block-wise FP8 (128 x 128 blocks; the last one partial for 200 x 320) through
    ``fp8_gemv.maybe_fp8_block_gemv`` at 1-4 rows: within float32 accumulation and one rounding of
    ``x @ (codes * grid[row // 128, col // 128])^T`` in float64, the interpreter check's bound."""
    gen = torch.Generator(device=CUDA).manual_seed(n + k)
    w = torch.randn(n, k, generator=gen, device=CUDA) * 0.02
    rb, cb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(rb * 128, cb * 128, device=CUDA)
    padded[:n, :k] = w
    grid = (padded.reshape(rb, 128, cb, 128).abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12).contiguous()
    full = grid.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    codes = (w / full).to(torch.float8_e4m3fn)
    wd = codes.double() * full.double()
    x4 = torch.randn(4, k, generator=gen, device=CUDA).to(dtype)
    for m in range(1, 5):
        y = fp8_gemv.maybe_fp8_block_gemv(x4[:m], codes, grid, (128, 128), None)
        assert y is not None and y.shape == (m, n) and y.dtype == dtype
        xd = x4[:m].double()
        ref = xd @ wd.t()
        bound = (k * 2.0**-23) * (xd.abs() @ wd.abs().t()) + U[dtype] * ref.abs()
        bound += 2.0**-30 * xd.abs().amax(dim=1, keepdim=True) * wd.abs().sum(dim=1)[None, :]
        assert ((y.double() - ref).abs() - bound).max().item() <= 0, m
    assert fp8_gemv.maybe_fp8_block_gemv(torch.randn(5, k, device=CUDA).to(dtype), codes, grid, (128, 128),
                                         None) is None  # past 4 rows: the layer's dequantizing path
