"""The dense Triton GEMV (``loom.layers.dense_gemv``) on CUDA: every kind of plan the sweep may put in
its table (one split, split-K merged by a second launch or by the last split) on Qwen3-30B-A3B's,
llama-8b's and SmolLM2's layer shapes and a ragged one, 1-4 rows, bf16 and fp16, with and without
a bias:

- within float32 accumulation and one rounding of a float64 reference, and within bf16 / fp16
  tolerance of cuBLAS;
- batch-invariant within 1-4 rows (each row of a 4-row call is the same bits alone) and
  deterministic run to run, the fused merge's counters back at zero;
- inside a CUDA graph, bit for bit the eager call;
- served through ``UnquantizedLinearMethod`` exactly for the tabled shape and rows, and not with
  ``LOOM_DENSE_GEMV`` off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from loom import kernel_switches
from loom.layers import dense_gemv as dg
from loom.layers import dense_gemv_table
from loom.layers.split_k import counters
from loom.plugin_api.quantization import UnquantizedLinearMethod

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
SHAPES = [(5120, 2048), (128, 2048), (960, 576), (50, 200)]  # (N, K): Qwen3 qkv, its router, SmolLM2 qkv, ragged
PLANS = [dg.GemvPlan(64, 128, 1, 4, 3), dg.GemvPlan(32, 128, 8, 4, 4, True), dg.GemvPlan(128, 64, 16, 4, 4, False),
         dg.GemvPlan(16, 256, 4, 4, 3, True)]
# every plan in bf16, the first two in fp16 too (each pair is a compiled variant: kept few)
CASES = [(p, torch.bfloat16) for p in PLANS] + [(p, torch.float16) for p in PLANS[:2]]
U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _operands(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    w = (torch.randn(n, k, generator=gen, device=CUDA) * 0.02).to(dtype)
    x = torch.randn(dg.MAX_M, k, generator=gen, device=CUDA).to(dtype)
    b = (torch.randn(n, generator=gen, device=CUDA) * 0.1).to(dtype) if bias else None
    return (w, x, b) if b is not None else (w, x)


def _case_id(case: tuple[dg.GemvPlan, torch.dtype]) -> str:
    p, dtype = case
    merge = "fused" if p.fused_reduce else "launch" if p.split > 1 else "one"
    return f"{p.block_n}x{p.block_k}-s{p.split}-{merge}-{str(dtype).split('.')[-1]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=lambda v: str(v))
def test_matches_reference_batch_invariant_and_deterministic(case: tuple[dg.GemvPlan, torch.dtype], n: int,
                                                             k: int) -> None:
    plan, dtype = case
    ops = _operands(n, k, dtype, bias=(n + k) % 3 == 0, seed=n + k)
    w, x = ops[0], ops[1]
    b = ops[2] if len(ops) > 2 else None
    whole = dg.dense_gemv(x, w, b, plan)
    for m in range(1, dg.MAX_M + 1):
        y = dg.dense_gemv(x[:m], w, b, plan)
        ref = x[:m].double() @ w.double().t() + (b.double() if b is not None else 0.0)
        # float32 accumulation in any order (the tensor cores' adds, the split sums), one rounding
        bound = (k * 2.0**-20) * (x[:m].double().abs() @ w.double().abs().t()) + U[dtype] * ref.abs() + 1e-6
        assert ((y.double() - ref).abs() <= bound).all(), f"m={m}: error past the bound"
        torch.testing.assert_close(y, F.linear(x[:m], w, b), atol=2e-2, rtol=2e-2)
        assert torch.equal(y, whole[:m]), f"the first {m} rows differ from the same rows in a 4-row call"
        assert torch.equal(y, dg.dense_gemv(x[:m], w, b, plan)), "not deterministic run to run"
    torch.cuda.synchronize()
    ctr = counters(CUDA)
    assert ctr is not None and int(ctr.abs().sum()) == 0


@pytest.mark.parametrize("plan", [PLANS[1], PLANS[2]], ids=["fused", "launch"])
def test_cuda_graph_replay_equals_eager(plan: dg.GemvPlan) -> None:
    w, x = _operands(2048, 4096, torch.bfloat16, bias=False, seed=3)
    counters(CUDA)  # allocated before capture, as the engine's warm-up does
    static_x = x[:2].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dg.dense_gemv(static_x, w, None, plan)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dg.dense_gemv(static_x, w, None, plan)
    for seed in (1, 2):
        new = torch.randn(2, 4096, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(seed)).bfloat16()
        static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, dg.dense_gemv(new, w, None, plan))


def test_the_linear_method_serves_only_the_tabled_shape_and_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    monkeypatch.setattr(dense_gemv_table, "PLANS", {(sms, 5120, 2048): (2, 32, 128, 8, 4, 4, True)})
    plan = dg.GemvPlan(32, 128, 8, 4, 4, True)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(_operands(5120, 2048, torch.bfloat16, False, 5)[0], requires_grad=False)
    method = UnquantizedLinearMethod()
    x = torch.randn(4, 2048, device=CUDA).bfloat16()
    for m in (1, 2):
        assert dg.plan_for(x[:m], layer.weight) == plan
        assert torch.equal(method.apply(layer, x[:m]), dg.dense_gemv(x[:m], layer.weight, None, plan))
    for m in (3, 4):
        assert dg.plan_for(x[:m], layer.weight) is None
        assert torch.equal(method.apply(layer, x[:m]), F.linear(x[:m], layer.weight))
    assert dg.plan_for(x[:1].float(), layer.weight.float()) is None  # float32: cuBLAS
    monkeypatch.setattr(kernel_switches, "dense_gemv", "off")
    assert dg.plan_for(x[:1], layer.weight) is None
    assert torch.equal(method.apply(layer, x[:1]), F.linear(x[:1], layer.weight))
    monkeypatch.setattr(kernel_switches, "dense_gemv", "all")
    other = torch.empty(4096, 4096, device=CUDA, dtype=torch.bfloat16)
    assert dg.plan_for(torch.randn(1, 4096, device=CUDA).bfloat16(), other) == dg.default_plan(4096, 4096, sms)
