"""The fused Mixture-of-Experts layer on the CPU: routing and experts against transformers' own
modules, the weight loader (per-expert and stacked checkpoints, tensor-parallel shards), the
quantization hook, and the Triton kernels through Triton's interpreter (in a child process)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.triton_interpret import run_interpreted
from torch import nn
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from loom.distributed.parallel_state import tensor_parallel_as
from loom.layers.fused_moe import FusedMoE, fused_experts_torch, select_experts, sort_rows_by_expert
from loom.layers.moe_routing_triton import num_blocks_bound
from loom.model_loader import ModelLoadError, iter_weights, load_model
from loom.plugin_api import FusedMoEMethod, PluginRegistry, QuantizerSpec, hookimpl
from loom.plugin_api.quantization import LinearMethod, QuantizationConfig, WeightLoader, set_weight_attrs

ROOT = Path(__file__).resolve().parents[2]
H, INTER, E = 32, 24, 6


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- routing ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_is_transformers_routing(dtype: torch.dtype) -> None:
    x = _rand(50, H, seed=1).to(dtype)
    mixtral = MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2)).to(dtype)
    mixtral.weight.data = _rand(E, H, seed=2).to(dtype)
    logits, theirs_w, theirs_ids = mixtral(x)
    ours_w, ours_ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(ours_ids, theirs_ids) and ours_w.dtype == theirs_w.dtype == torch.float32
    assert torch.equal(ours_w, theirs_w)
    for norm in (False, True):
        cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=3, norm_topk_prob=norm)
        qwen = Qwen3MoeTopKRouter(cfg).to(dtype)
        qwen.weight.data = _rand(E, H, seed=3).to(dtype)
        logits, theirs_w, theirs_ids = qwen(x)
        ours_w, ours_ids = select_experts(logits, 3, renormalize=norm, weights_dtype=logits.dtype)
        assert torch.equal(ours_ids, theirs_ids) and ours_w.dtype == theirs_w.dtype == dtype
        assert torch.equal(ours_w, theirs_w)
        assert torch.allclose(ours_w.float().sum(-1), torch.ones(50), atol=1e-2) == norm


def test_rows_are_sorted_by_expert_in_token_order() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1]])
    order, counts = sort_rows_by_expert(ids, 5)
    assert order.tolist() == [3, 6, 1, 2, 7, 5, 0, 4]  # rows t * k + j of experts 0, 1, 2, 3
    assert counts.tolist() == [2, 3, 1, 2, 0]
    # The Triton layout's static bound: any routing fits (here every row on one expert is worst).
    assert num_blocks_bound(8, 5, 16) == 5 and num_blocks_bound(1 * 8, 128, 16) == 8
    assert num_blocks_bound(4096 * 8, 128, 64) * 64 >= 4096 * 8 + 128 * 63


# -- experts --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_torch_experts_are_transformers_experts(dtype: torch.dtype, tol: float) -> None:
    cfg = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=2)
    hf = MixtralExperts(cfg).to(dtype)
    hf.gate_up_proj.data = (_rand(E, 2 * INTER, H, seed=4) / 4).to(dtype)
    hf.down_proj.data = (_rand(E, H, INTER, seed=5) / 4).to(dtype)
    x = _rand(37, H, seed=6).to(dtype)
    weights, ids = select_experts(_rand(37, E, seed=7), 2, renormalize=True)
    ids[:5] = torch.tensor([4, 1])  # a few tokens on the same pair; expert 5 may stay idle
    with torch.no_grad():
        theirs = hf(x, ids, weights)
    ours = fused_experts_torch(x, hf.gate_up_proj.data, hf.down_proj.data, weights, ids)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), theirs.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_the_torch_path_in_the_interpreter() -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "moe_interpret_check.py"), extra_env={"LOOM_CPU_KERNELS": "0"})
    # 6 routing, 8 fused routing and sort, 3 + 1 router epilogue, 1 sort, 4 experts, 3 + 1 direct
    # experts, 4 + 3 FP8 experts (per channel, per block), 4 layers, 1 model
    assert "FAIL" not in stdout and stdout.count("ok  ") == 39, stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_routing_kernels_compile_for_hopper_and_reduce_alike() -> None:
    """Both routing paths compiled for sm_90 (no GPU needed): no spills, and the one-launch
    decode kernel reduces its float32 values in ``_route_kernel``'s layouts (same weights bits)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "layout_compile_check.py"), "routing"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("ok  ") == 5, proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_router_epilogue_compiles_for_hopper_and_reduces_as_the_two_launches() -> None:
    """The router's GEMV with the routing in its epilogue compiled for sm_90 (no GPU needed): no
    spills, and its float32 reductions (the split sums, the softmax, the top-k, the
    renormalisation) in the layouts of the dense GEMV's and ``_route_kernel``'s: the same bits."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "layout_compile_check.py"),
                           "router_epilogue"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("ok  ") == 2, proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_expert_kernels_pipeline_their_loads_on_hopper() -> None:
    """The expert kernels compiled for sm_90 at the decode tiles: with whole K tiles their loads go
    through cp.async (pipelined), sorted and direct, dense and FP8 (per channel and per block),
    with no spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "layout_compile_check.py"),
                           "expert_pipelining"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("ok  ") == 12, proc.stdout


def test_the_layer_imports_and_runs_without_triton() -> None:
    """A CPU install has no triton: the kernels module still imports and the torch path serves."""
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "import torch\n"
            "from loom.layers import fused_moe, fused_moe_triton\n"
            "assert not fused_moe_triton.HAS_TRITON\n"
            "block = fused_moe.SparseMoeBlock(4, 2, 8, 6, renormalize=True)\n"
            "print(tuple(block(torch.randn(3, 8)).shape), fused_moe.triton_experts_supported(torch.randn(1)))")
    env = {**os.environ, "LOOM_CPU_KERNELS": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "(3, 8) False"


# -- loading ------------------------------------------------------------------------------------------------


def _expert_tensors(seed: int = 10) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per expert: gate [I, H], up [I, H], down [H, I]."""
    return {e: (_rand(INTER, H, seed=seed + 3 * e), _rand(INTER, H, seed=seed + 3 * e + 1),
                _rand(H, INTER, seed=seed + 3 * e + 2)) for e in range(E)}


def test_per_expert_and_stacked_checkpoints_load_and_shard() -> None:
    experts = _expert_tensors()
    full = FusedMoE(E, H, INTER, checkpoint_names=("w1", "w3", "w2"), prefix="moe.experts")
    required, alternatives = full.checkpoint_targets("moe.experts")
    assert required["moe.experts.3.w1.weight"] == ("w13_weight", 0, 3)
    assert required["moe.experts.3.w3.weight"] == ("w13_weight", 1, 3)
    assert required["moe.experts.5.w2.weight"] == ("w2_weight", None, 5)
    assert len(required) == 3 * E and set(alternatives) == {"moe.experts.gate_up_proj", "moe.experts.down_proj"}
    for e, (gate, up, down) in experts.items():
        full.weight_loader(full.w13_weight, gate, 0, e)
        full.weight_loader(full.w13_weight, up, 1, e)
        full.weight_loader(full.w2_weight, down, None, e)
    stacked_w13 = torch.stack([torch.cat([g, u]) for g, u, _ in experts.values()])  # [E, 2I, H]
    stacked_w2 = torch.stack([d for _, _, d in experts.values()])  # [E, H, I]
    assert torch.equal(full.w13_weight, stacked_w13) and torch.equal(full.w2_weight, stacked_w2)

    # transformers 5's stacked tensors, split over two ranks: each rank's gate, up and down slices.
    for rank in range(2):
        with tensor_parallel_as(rank, 2):
            shard = FusedMoE(E, H, INTER, prefix="moe.experts")
        shard.weight_loader(shard.w13_weight, stacked_w13)
        shard.weight_loader(shard.w2_weight, stacked_w2)
        half = slice(rank * INTER // 2, (rank + 1) * INTER // 2)
        assert torch.equal(shard.w13_weight, torch.cat([stacked_w13[:, :INTER][:, half],
                                                       stacked_w13[:, INTER:][:, half]], dim=1))
        assert torch.equal(shard.w2_weight, stacked_w2[:, :, half])
    from loom.layers.linear import WeightShapeError

    with pytest.raises(WeightShapeError):
        full.weight_loader(full.w13_weight, _rand(INTER + 1, H), 0, 2)
    with pytest.raises(ValueError, match="expert 6 is not below 6"):
        full.weight_loader(full.w2_weight, _rand(H, INTER), None, 6)


def test_moe_model_loads_stacked_names_and_names_missing_experts(
    tiny_model_dir: Callable[[str], Path], models_registry: PluginRegistry
) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("qwen3-moe")
    loaded = load_model(path, torch.float32, "cpu", models_registry)
    model: Any = loaded.model
    reference = {n: p.clone() for n, p in model.named_parameters()}
    # transformers' in-memory names are the stacked ones (experts.gate_up_proj [E, 2I, H]).
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stacked = list(hf.state_dict().items())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in stacked)
    for p in model.parameters():
        p.data.zero_()
    model.load_weights(stacked)
    assert all(torch.equal(p, reference[n]) for n, p in model.named_parameters())

    weights = list(iter_weights(path, torch.float32, "cpu"))
    with pytest.raises(ModelLoadError, match=r"missing weights.*model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        model.load_weights([(n, t) for n, t in weights if n != "model.layers.2.mlp.experts.5.up_proj.weight"])
    with pytest.raises(ModelLoadError, match=r"does not know: model\.layers\.0\.mlp\.experts\.8\.up_proj\.weight"):
        model.load_weights([*weights, ("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(48, 64))])
    with pytest.raises(ModelLoadError, match=r"experts\.1\.down_proj\.weight' has shape \(64, 47\)"):
        model.load_weights([(n, t[:, :47] if n == "model.layers.0.mlp.experts.1.down_proj.weight" else t)
                            for n, t in weights])


# -- the quantization hook ----------------------------------------------------------------------------------


class ToyInt8Experts(FusedMoEMethod):
    """Experts stored int8 per output row: ``W = qweight * weight_scale[:, None]``."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        inter = intermediate_size_per_partition
        shapes = {"w13_qweight": ((num_experts, 2 * inter, hidden_size), torch.int8, {"output_dim": 0}),
                  "w13_weight_scale": ((num_experts, 2 * inter), params_dtype, {"output_dim": 0}),
                  "w2_qweight": ((num_experts, hidden_size, inter), torch.int8, {"input_dim": 1}),
                  "w2_weight_scale": ((num_experts, hidden_size), params_dtype, {})}
        for name, (shape, dtype, hints) in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(param, weight_loader=weight_loader, **hints)
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.w13_dense = layer.w13_qweight.float() * layer.w13_weight_scale[..., None]
        layer.w2_dense = layer.w2_qweight.float() * layer.w2_weight_scale[..., None]

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_torch(x, layer.w13_dense, layer.w2_dense, topk_weights, topk_ids)


class ToyMoeConfig(QuantizationConfig):
    """Serves every MoE layer's experts with ToyInt8Experts (``serve_experts``); linears stay dense."""

    serve_experts = True

    @classmethod
    def for_checkpoint(cls, model_dir: Path) -> bool:
        return (Path(model_dir) / "toy_moe.json").is_file()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return None

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod | None:
        return ToyInt8Experts() if self.serve_experts else None


class ToyDenseConfig(ToyMoeConfig):
    serve_experts = False


def _registry(config: type[QuantizationConfig]) -> PluginRegistry:
    import loom_plugins.models

    class Plugin:
        @hookimpl
        def loom_quantizers(self) -> Iterator[QuantizerSpec]:
            yield QuantizerSpec(name="toy-moe", summary="test scheme", load=lambda: config)

    registry = PluginRegistry()
    registry.register(loom_plugins.models, "loom-models", "loom-server")
    registry.register(Plugin(), "toy", "toy-dist")
    return registry


def _int8_checkpoint(dense_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """The tiny Qwen3-MoE with every expert matrix as int8 ``qweight`` + per-row ``weight_scale``;
    returns each one's dequantized matrix."""
    from safetensors.torch import save_file

    shutil.copytree(dense_dir, out)
    tensors: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, w in iter_weights(dense_dir, torch.float32, "cpu"):
        if ".experts." not in name:
            tensors[name] = w
            continue
        scale = w.abs().amax(dim=1) / 127
        q = torch.round(w / scale[:, None]).to(torch.int8)
        stem = name.removesuffix(".weight")
        tensors[f"{stem}.qweight"], tensors[f"{stem}.weight_scale"] = q, scale
        dense[stem] = q.float() * scale[:, None]
    save_file(tensors, str(out / "model.safetensors"))
    (out / "toy_moe.json").write_text("{}")
    return dense


def test_a_quantizer_serves_the_experts_through_get_moe_method(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    dense = _int8_checkpoint(tiny_model_dir("qwen3-moe"), tmp_path / "int8")
    loaded = load_model(tmp_path / "int8", torch.float32, "cpu", _registry(ToyMoeConfig))
    assert loaded.quantization == "toy-moe"
    model: Any = loaded.model
    experts = model.model.layers[2].mlp.experts
    assert isinstance(experts.quant_method, ToyInt8Experts) and not hasattr(experts, "w13_weight")
    stem = "model.layers.2.mlp.experts"
    assert torch.equal(experts.w13_dense[5], torch.cat([dense[f"{stem}.5.gate_proj"], dense[f"{stem}.5.up_proj"]]))
    assert torch.equal(experts.w2_dense[7], dense[f"{stem}.7.down_proj"])
    assert not hasattr(model.model.layers[1].mlp, "experts")  # layer 1 is dense (mlp_only_layers)

    # A quantizer that claims the checkpoint but serves no layer (its MoE layers keep the dense
    # method) is not applied: the model loads dense.
    plain = load_model(tiny_model_dir("qwen3-moe"), torch.float32, "cpu", _registry(ToyDenseConfig))
    assert plain.quantization is None
    (tmp_path / "marked").mkdir()
    for f in tiny_model_dir("qwen3-moe").iterdir():
        shutil.copy(f, tmp_path / "marked" / f.name)
    (tmp_path / "marked" / "toy_moe.json").write_text("{}")
    assert load_model(tmp_path / "marked", torch.float32, "cpu", _registry(ToyDenseConfig)).quantization is None
