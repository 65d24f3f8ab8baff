"""FP8 experts of Mixture-of-Experts models (``loom_plugins.quant.fp8_moe``) on the CPU: FP8
checkpoints whose experts are e4m3 (written by compressed-tensors' own quantizer, the independent
reference), ``--quantize fp8`` on a dense MoE checkpoint, tensor-parallel shards, and refusals.
The Triton kernels' FP8 path is checked in ``helpers/moe_interpret_check.py`` and on the GPU."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.quant_checkpoints import dense_tensors, dense_with, dequantized_linears, fp8_checkpoint
from helpers.reference_attention import ModelHarness
from helpers.tiny_models import hf_logits, load_hf_reference

from loom.distributed.parallel_state import tensor_parallel_as
from loom.layers.fused_moe import (
    FusedMoE,
    StackedExpertsMethod,
    dequantize_expert,
    fused_experts_torch,
    select_experts,
)
from loom.model_loader import ModelLoadError, load_model
from loom.plugin_api import PluginRegistry
from loom_plugins.quant.fp8_moe import FP8CheckpointExperts, FP8ExpertsWhileLoading

PROMPT = [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 5, 300, 12]
TinyDir = Callable[[str], Path]


def experts_of(model: Any) -> dict[str, FusedMoE]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}


def dequantized_experts(moe: FusedMoE, prefix: str) -> dict[str, torch.Tensor]:
    """Each expert projection's float32 weight as the layer computes with it (checkpoint names)."""
    method = moe.quant_method
    assert isinstance(method, StackedExpertsMethod)
    w = method.stacked(moe)
    assert w.w13_scale is not None and w.w2_scale is not None
    gate, up, down = moe.checkpoint_names
    inter = moe.intermediate_size_per_partition
    out: dict[str, torch.Tensor] = {}
    for e in range(moe.num_experts):
        w13 = dequantize_expert(w.w13[e], w.w13_scale[e], torch.float32, w.block)
        out[f"{prefix}.{e}.{gate}"], out[f"{prefix}.{e}.{up}"] = w13[:inter], w13[inter:]
        out[f"{prefix}.{e}.{down}"] = dequantize_expert(w.w2[e], w.w2_scale[e], torch.float32, w.block)
    return out


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_moe_checkpoint_dequantizes_like_compressed_tensors_and_matches_transformers(
    per_channel: bool, tiny_model_dir: TinyDir, quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    pytest.importorskip("compressed_tensors")
    dense = tiny_model_dir("qwen3-moe")
    path, expected = fp8_checkpoint(dense, tmp_path / "fp8", per_channel=per_channel, static=False,
                                    weight_only=True)
    assert any(".experts." in stem for stem in expected)
    loaded = load_model(path, torch.float32, "cpu", quant_registry)
    assert loaded.quantization == "fp8"
    assert loaded.quantization_settings["experts"] == "float8_e4m3fn weight-only (2 layers)"
    layers = experts_of(loaded.model)
    assert len(layers) == 2
    for prefix, moe in layers.items():
        assert isinstance(moe.quant_method, FP8CheckpointExperts)
        assert moe.w13_weight.dtype == moe.w2_weight.dtype == torch.float8_e4m3fn
        for stem, w in dequantized_experts(moe, prefix).items():
            assert torch.equal(w, expected[stem]), stem  # bit for bit: compressed-tensors' dequantize
    # Weight-only: the model is the dense model with the dequantized weights, which transformers runs.
    ours = ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)
    theirs = hf_logits(load_hf_reference(dense_with(dense, tmp_path / "hf", expected)), PROMPT)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_static_fp8_moe_checkpoint_runs_its_experts_weight_only(
    tiny_model_dir: TinyDir, quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    """A W8A8 checkpoint with static input scales: the linear layers keep them, the experts' are
    not read (they compute weight-only), and the model stays near the dense one."""
    pytest.importorskip("compressed_tensors")
    dense = tiny_model_dir("qwen3-moe")
    path, expected = fp8_checkpoint(dense, tmp_path / "fp8", per_channel=False, static=True)
    loaded = load_model(path, torch.float32, "cpu", quant_registry)
    assert loaded.quantization_settings["activations"] == "static"
    model: Any = loaded.model
    assert not any("input_scale" in n for n, _ in model.model.layers[2].mlp.experts.named_parameters())
    assert model.model.layers[2].self_attn.qkv_proj.input_scale.isfinite().all()
    for prefix, moe in experts_of(model).items():
        for stem, w in dequantized_experts(moe, prefix).items():
            assert torch.equal(w, expected[stem]), stem
    ours = ModelHarness(model, loaded.hf_config).prefill(PROMPT)
    theirs = hf_logits(load_hf_reference(dense_with(dense, tmp_path / "hf", expected)), PROMPT)
    assert float((ours - theirs).norm() / theirs.norm()) < 0.2  # the linear layers' activation rounding


@pytest.mark.parametrize("model", ["qwen3-moe", "mixtral"])
def test_quantize_fp8_while_loading_quantizes_the_experts_one_at_a_time(
    model: str, tiny_model_dir: TinyDir, quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    dense = tiny_model_dir(model)
    loaded = load_model(dense, torch.float32, "cpu", quant_registry, quantize="fp8")
    assert loaded.quantization == "fp8" and "experts" in loaded.quantization_settings
    layers = experts_of(loaded.model)
    assert layers
    tensors = dense_tensors(dense)
    dequantized = dequantized_linears(loaded.model)
    for prefix, moe in layers.items():
        assert isinstance(moe.quant_method, FP8ExpertsWhileLoading)
        assert not list(moe.parameters())  # the dense placeholders are gone; codes and scales are buffers
        assert not moe.quant_method.staged  # every expert quantized, nothing left staged
        ours = dequantized_experts(moe, prefix)
        for stem, w in ours.items():
            dense_w = tensors[f"{stem}.weight"]
            # per output channel, max |w| / 448: e4m3's 3 mantissa bits, each row within 1/16 of its max
            assert ((w - dense_w).abs() <= dense_w.abs().amax(dim=1, keepdim=True) / 16 + 1e-9).all(), stem
            assert float((w - dense_w).norm() / dense_w.norm()) < 0.05, stem
        dequantized.update(ours)
    # transformers on the weights Loom computes with: what is left is the linear layers' W8A8
    # activation rounding (the experts compute weight-only; the weight-only checkpoint test above
    # holds the experts' path to 1e-4).
    ours_logits = ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)
    theirs = hf_logits(load_hf_reference(dense_with(dense, tmp_path / "hf", dequantized)), PROMPT)
    assert float((ours_logits - theirs).norm() / theirs.norm()) < 0.2


def test_experts_stage_one_expert_at_a_time(tiny_model_dir: TinyDir, quant_registry: PluginRegistry,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """While loading, at most one expert's dense gate / up rows wait for their other half: the
    checkpoint's order (an expert's gate, down and up together) never stages a layer."""
    import loom_plugins.quant.fp8_moe as fp8_moe

    seen: list[int] = []
    original = fp8_moe.FP8ExpertsWhileLoading._staging_loader

    def staging_loader(self: Any, moe: FusedMoE, which: str, rows: int, cols: int) -> Any:
        load = original(self, moe, which, rows, cols)

        def wrapped(*args: Any) -> None:
            load(*args)
            seen.append(len(self.staged))

        return wrapped

    monkeypatch.setattr(fp8_moe.FP8ExpertsWhileLoading, "_staging_loader", staging_loader)
    load_model(tiny_model_dir("qwen3-moe"), torch.float32, "cpu", quant_registry, quantize="fp8")
    assert seen and max(seen) <= 1, max(seen)


@pytest.mark.parametrize("scales", ["channel", "tensor", "block"])
def test_fp8_experts_shard_over_two_ranks_and_sum_to_the_whole(scales: str, tiny_model_dir: TinyDir,
                                                                 tmp_path: Path) -> None:
    """Each rank holds its slice of every expert's intermediate rows (codes and, per channel or
    per block, their scales; per-tensor scales whole), and the ranks' outputs sum to one rank's."""
    pytest.importorskip("compressed_tensors")
    per_channel = scales == "channel"
    block = (8, 8) if scales == "block" else None  # this rank's 24 intermediate rows: 3 blocks
    path, _ = fp8_checkpoint(tiny_model_dir("qwen3-moe"), tmp_path / "fp8", per_channel=per_channel,
                             static=False, weight_only=True, layout="fp8" if block else "compressed-tensors",
                             block=block)
    tensors = dense_tensors(path)
    prefix = "model.layers.2.mlp.experts"
    cfg = json.loads((path / "config.json").read_text())
    E, H, inter = cfg["num_local_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]

    def build() -> FusedMoE:
        moe = FusedMoE(E, H, inter, prefix=prefix, params_dtype=torch.float32)
        moe.quant_method = FP8CheckpointExperts(per_channel, block, "weight_scale_inv" if block else "weight_scale")
        for name in list(moe._parameters):
            del moe._parameters[name]
        moe.quant_method.create_weights(moe, E, H, moe.intermediate_size_per_partition, torch.float32,
                                        moe.weight_loader)
        required, _ = moe.checkpoint_targets(prefix)
        for name, (param, shard, expert) in required.items():
            target = getattr(moe, param)
            target.weight_loader(target, tensors[name], shard, expert)
        moe.quant_method.process_weights_after_loading(moe)
        return moe

    whole = build()
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(0))
    weights, ids = select_experts(torch.randn(9, E, generator=torch.Generator().manual_seed(1)), 2, True)
    want = whole(x, weights, ids)
    parts = []
    for rank in range(2):
        with tensor_parallel_as(rank, 2):
            shard = build()
        rows = (E, inter // 8, H // 8) if block else (E, inter)  # half the intermediate rows: 2 x I/2
        assert shard.w13_weight.shape == (E, inter, H) and shard.w13_scale_rows.shape == rows
        parts.append(shard(x, weights, ids))
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-5)


def test_torch_experts_dequantize_only_the_experts_with_rows() -> None:
    """``fused_experts_torch`` with scales equals the dense path on the dequantized weights."""
    E, H, inter = 5, 16, 12
    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(E, 2 * inter, H, generator=gen)
    w2 = torch.randn(E, H, inter, generator=gen)
    s13, s2 = w13.abs().amax(-1) / 448, w2.abs().amax(-1) / 448
    c13 = (w13 / s13[..., None]).to(torch.float8_e4m3fn)
    c2 = (w2 / s2[..., None]).to(torch.float8_e4m3fn)
    x = torch.randn(7, H, generator=gen)
    weights, ids = select_experts(torch.randn(7, E, generator=gen), 2, True)
    got = fused_experts_torch(x, c13, c2, weights, ids, s13, s2)
    want = fused_experts_torch(x, c13.float() * s13[..., None], c2.float() * s2[..., None], weights, ids)
    assert torch.equal(got, want)


def _unquantized_expert(tensors: dict[str, torch.Tensor]) -> None:
    stem = "model.layers.2.mlp.experts.3.up_proj"
    tensors[f"{stem}.weight"] = tensors[f"{stem}.weight"].float()
    del tensors[f"{stem}.weight_scale"]


def _fp16_expert(tensors: dict[str, torch.Tensor]) -> None:
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float16)


@pytest.mark.parametrize(("mutate", "message"), [
    (_unquantized_expert, "quantizer fp8: FP8 checkpoint: model.layers.2.mlp.experts.3.up_proj has no weight_scale "
                          "tensor while other experts"),
    (_fp16_expert, "quantizer fp8: FP8 model.layers.2.mlp.experts expert 5: a weight is torch.float16 in the "
                   "checkpoint; expected float8_e4m3fn"),
], ids=["an-expert-unquantized", "an-expert-not-e4m3"])
def test_a_checkpoint_with_a_bad_expert_is_refused_naming_it(
    mutate: Callable[[dict[str, torch.Tensor]], None], message: str, tiny_model_dir: TinyDir,
    quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    path, _ = fp8_checkpoint(tiny_model_dir("qwen3-moe"), tmp_path / "fp8", per_channel=True, static=False,
                             weight_only=True, torch_writer=True)
    tensors = dense_tensors(path)
    mutate(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_model(path, torch.float32, "cpu", quant_registry)


@pytest.mark.parametrize("block", [None, (16, 16)], ids=["per-channel", "block-wise"])
def test_the_torch_writer_writes_compressed_tensors_bytes(block: tuple[int, int] | None, tiny_model_dir: TinyDir,
                                                          tmp_path: Path) -> None:
    """The GPU test's checkpoint writer (no compressed-tensors there) against compressed-tensors itself."""
    pytest.importorskip("compressed_tensors")
    dense = tiny_model_dir("qwen3-moe")
    theirs, want = fp8_checkpoint(dense, tmp_path / "ct", per_channel=True, static=False, weight_only=True,
                                  block=block)
    ours, got = fp8_checkpoint(dense, tmp_path / "torch", per_channel=True, static=False, weight_only=True,
                               torch_writer=True, block=block)
    a, b = dense_tensors(theirs), dense_tensors(ours)
    assert a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8) if a[n].dtype == torch.float8_e4m3fn
                                                    else a[n], b[n].view(torch.uint8)
                                                    if b[n].dtype == torch.float8_e4m3fn else b[n]) for n in a)
    assert all(torch.equal(want[s], got[s]) for s in want)
    assert (theirs / "config.json").read_text() == (ours / "config.json").read_text()


@pytest.mark.parametrize("model", ["mixtral", "qwen3-moe"])
def test_loom_quantize_fp8_writes_each_expert_in_fp8_under_the_checkpoints_names(
    model: str, tiny_model_dir: TinyDir, quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    """``loom quantize --method fp8`` on an MoE model: every tensor under the source checkpoint's
    name (per expert, Mixtral's ``block_sparse_moe``: what transformers 5's save_pretrained writes,
    not its stacked in-memory form), each expert projection e4m3 beside its per-channel scale, and
    Loom serves the experts from them."""
    from loom_plugins.quant.make.pipeline import QuantizeRequest, quantize_model

    dense = tiny_model_dir(model)
    out = quantize_model(dense, tmp_path / "q", QuantizeRequest(method="fp8"), progress=False)
    source, written = dense_tensors(dense), dense_tensors(out)
    experts = [n for n in source if ".experts." in n]
    assert experts and set(source) <= set(written)
    for name in experts:
        codes, scale = written[name], written[f"{name}_scale"]
        assert codes.dtype == torch.float8_e4m3fn and scale.shape == (codes.shape[0], 1)
        assert float((codes.float() * scale - source[name]).norm() / source[name].norm()) < 0.05, name
    loaded = load_model(out, torch.float32, "cpu", quant_registry)
    for prefix, moe in experts_of(loaded.model).items():
        assert isinstance(moe.quant_method, FP8CheckpointExperts)
        for stem, w in dequantized_experts(moe, prefix).items():
            assert torch.equal(w, written[f"{stem}.weight"].float() * written[f"{stem}.weight_scale"]), stem


def test_loom_quantize_of_mixtral_writes_names_loom_reads(tiny_model_dir: TinyDir, quant_registry: PluginRegistry,
                                                         tmp_path: Path) -> None:
    """A method that leaves the experts dense (rtn) writes them per expert under
    ``block_sparse_moe`` too: the checkpoint loads (it once held transformers 5's in-memory names)."""
    from loom_plugins.quant.make.pipeline import QuantizeRequest, quantize_model

    out = quantize_model(tiny_model_dir("mixtral"), tmp_path / "q", QuantizeRequest(method="rtn", group_size=32),
                         progress=False)
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in dense_tensors(out)
    loaded = load_model(out, torch.float32, "cpu", quant_registry)
    assert loaded.quantization == "gptq"


@pytest.mark.parametrize(("model", "layout", "block"), [
    ("llama", "fp8", (32, 32)), ("qwen3-moe", "fp8", (16, 16)), ("qwen3-moe", "compressed-tensors", (8, 16)),
])
def test_block_fp8_checkpoint_dequantizes_exactly_and_matches_transformers(
    model: str, layout: str, block: tuple[int, int], tiny_model_dir: TinyDir, quant_registry: PluginRegistry,
    tmp_path: Path,
) -> None:
    """Block-wise FP8 (DeepSeek's and Qwen3's releases: ``weight_block_size`` / ``weight_scale_inv``;
    LLM Compressor's FP8_BLOCK) written by compressed-tensors' own quantizer: every linear layer's
    and expert's weight equals its dequantization bit for bit, and the model (weight-only) gives
    transformers' logits on those weights; the ``fp8`` layout also against transformers' own FP8
    loader, which dequantizes such a checkpoint on a machine without a GPU."""
    pytest.importorskip("compressed_tensors")
    dense = tiny_model_dir(model)
    path, expected = fp8_checkpoint(dense, tmp_path / "fp8", per_channel=False, static=False, layout=layout,
                                    block=block)
    loaded = load_model(path, torch.float32, "cpu", quant_registry)
    settings = loaded.quantization_settings
    assert loaded.quantization == "fp8" and settings["weight_scales"] == f"per block of {block[0]}x{block[1]}"
    assert settings["activations"] == "none"  # computed weight-only
    ours = dequantized_linears(loaded.model)
    for prefix, moe in experts_of(loaded.model).items():
        ours.update(dequantized_experts(moe, prefix))
    assert ours.keys() == expected.keys()
    for stem, w in expected.items():
        assert torch.equal(ours[stem], w), stem
    logits = ModelHarness(loaded.model, loaded.hf_config).prefill(PROMPT)
    theirs = hf_logits(load_hf_reference(dense_with(dense, tmp_path / "hf", expected)), PROMPT)
    torch.testing.assert_close(logits, theirs, atol=1e-4, rtol=1e-4)
    if layout == "fp8":
        pytest.importorskip("accelerate")
        from transformers import AutoModelForCausalLM

        own = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)  # its FP8 dequantize
        torch.testing.assert_close(logits, hf_logits(own, PROMPT), atol=1e-4, rtol=1e-4)


def test_block_fp8_whose_blocks_do_not_tile_a_fused_part_is_refused(
    tiny_model_dir: TinyDir, quant_registry: PluginRegistry, tmp_path: Path,
) -> None:
    """Blocks of 48 rows across q (64 rows) and k: the parts' grids could not be told apart."""
    path, _ = fp8_checkpoint(tiny_model_dir("qwen3-moe"), tmp_path / "fp8", per_channel=False, static=False,
                             layout="fp8", block=(16, 16), torch_writer=True)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [48, 16]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="is not whole blocks of 48"):
        load_model(path, torch.float32, "cpu", quant_registry)


@pytest.mark.parametrize(("qconfig", "message"), [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128]},
     r"weight_block_size is \[128\]; expected two positive integers"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme is static with weight_block_size"),
])
def test_bad_block_fp8_configs_are_refused_before_loading(qconfig: dict[str, Any], message: str) -> None:
    from loom.plugin_api.quantization import QuantizationError
    from loom_plugins.quant.fp8 import FP8Config

    with pytest.raises(QuantizationError, match=message):
        FP8Config.check_checkpoint_config(qconfig)
