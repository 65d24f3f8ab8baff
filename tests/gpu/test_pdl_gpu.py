"""Programmatic Dependent Launch (``LOOM_PDL``) on a GPU of compute capability 9 or later: the same
decode steps with PDL off and on, inside CUDA graphs, give the same bits.

- the switch turns PDL on where it should (Hopper, Triton with the API) and off otherwise;
- a chain of decode layers (``scripts/bench_pdl.py``'s: every Triton kernel of a dense and an
  MoE decode layer, with cuBLAS between some) captured in a graph with PDL off and on, replayed
  several times: equal outputs, replay to replay and between the two;
- an engine on a tiny random Llama and a tiny Qwen3-MoE (bf16, the dense GEMV on every shape,
  CUDA-graph decode, greedy): the same tokens with PDL off and on.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from loom import kernel_switches
from loom.layers.triton_jit import pdl_enabled, pdl_launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="PDL needs compute capability 9 or later")


def _bench_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_pdl", ROOT / "scripts" / "bench_pdl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # registered before it runs: its dataclasses (string annotations) look their module up there
    # (first H200 run: AttributeError in dataclasses, the chain never ran)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_switch_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernel_switches, "pdl", False)
    assert not pdl_enabled(cuda) and dict(pdl_launch(cuda)) == {}
    monkeypatch.setattr(kernel_switches, "pdl", True)
    assert not pdl_enabled(torch.device("cpu"))
    assert pdl_enabled(cuda) == HOPPER
    if HOPPER:
        assert dict(pdl_launch(cuda)) == {"USE_PDL": True, "launch_pdl": True}


@needs_hopper
@pytest.mark.parametrize("shape", ["tiny-moe", "tiny-dense"])
def test_chain_in_graph_same_bits(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_switches, "dense_gemv", "all")  # the Triton GEMV (and split sums) on these shapes
    bench = _bench_module()
    step, keep = bench.build_chain(bench.SHAPES[shape], layers=4, ctx=300, device=torch.device("cuda"))
    eager = bench.with_pdl(False, step).clone()
    eager_pdl = bench.with_pdl(True, step).clone()
    assert torch.equal(eager, eager_pdl)
    outs = []
    for on in (False, True):
        graph, out = bench.with_pdl(on, lambda: bench.capture(step))
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            outs.append(out.clone())
    assert torch.isfinite(outs[0]).all()
    for o in outs:
        assert torch.equal(o, eager)
    del keep


def _engine_tokens(model_dir: Path, pdl: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    from helpers.graph_engine_runs import graph_decode_tokens

    monkeypatch.setattr(kernel_switches, "pdl", pdl)
    monkeypatch.setattr(kernel_switches, "dense_gemv", "all")  # the Triton GEMV on the tiny shapes too
    return graph_decode_tokens(model_dir)


@needs_hopper
@pytest.mark.parametrize("variant", ["llama", "qwen3-moe"])
def test_engine_greedy_same_tokens(variant: str, tiny_model_dir: Callable[[str], Path],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_model_dir(variant)
    off = _engine_tokens(path, False, monkeypatch)
    on = _engine_tokens(path, True, monkeypatch)
    assert on == off
    assert all(len(t) == 24 for t in on.values())
