"""Self-loading linear layers: tensor-parallel sharding of every weight loader (ranks built with
``tensor_parallel_as``, no process group), fused checkpoint names, and quantization methods chosen
per layer when the model is built, with packed parameters loaded through the same path."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_parallel_as
from loom.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from loom.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from loom.model_loader import iter_weights, load_model
from loom.model_loader.errors import ModelLoadError
from loom.model_loader.loader import build_model, load_hf_config
from loom.plugin_api import PluginRegistry, QuantizerSpec, hookimpl
from loom.plugin_api.quantization import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    WeightLoader,
    set_weight_attrs,
)
from loom_plugins.models.llama import LlamaForCausalLM
from loom_plugins.models.weights import load_packed_weights


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _as_rank(rank: int, size: int, build: Callable[[], Any]) -> Any:
    with tensor_parallel_as(rank, size):
        return build()


def test_rank_override_is_scoped() -> None:
    assert (get_tp_rank(), get_tp_size()) == (0, 1)
    with tensor_parallel_as(1, 2):
        assert (get_tp_rank(), get_tp_size()) == (1, 2)
    assert (get_tp_rank(), get_tp_size()) == (0, 1)
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"), tensor_parallel_as(2, 2):
        pass


def test_column_and_row_parallel_shards_concatenate_back_and_compute_their_part() -> None:
    w, b = _rand(6, 4), _rand(6, seed=1)
    x = _rand(3, 4, seed=2)
    cols = [_as_rank(r, 2, lambda: ColumnParallelLinear(4, 6, bias=True)) for r in range(2)]
    for layer in cols:
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
    assert torch.equal(torch.cat([c.weight for c in cols]), w)
    assert torch.equal(cols[1].weight, w[3:]) and torch.equal(cols[1].bias, b[3:])
    torch.testing.assert_close(torch.cat([c(x) for c in cols], dim=-1), F.linear(x, w, b))

    w2, b2 = _rand(5, 6, seed=3), _rand(5, seed=4)
    rows = [_as_rank(r, 2, lambda: RowParallelLinear(6, 5, bias=True)) for r in range(2)]
    for layer in rows:
        layer.weight.weight_loader(layer.weight, w2)
        layer.bias.weight_loader(layer.bias, b2)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), w2)
    assert all(torch.equal(r.bias, b2) for r in rows)  # the bias is added once, after the sum
    h = _rand(3, 6, seed=5)
    partial = [r.quant_method.apply(r, h[:, 3 * i:3 * (i + 1)], None) for i, r in enumerate(rows)]
    torch.testing.assert_close(partial[0] + partial[1] + b2, F.linear(h, w2, b2))

    rep = _as_rank(1, 2, lambda: ReplicatedLinear(4, 6, bias=False))
    rep.weight.weight_loader(rep.weight, w)
    assert torch.equal(rep.weight, w)


def test_world_size_one_layer_is_plain_linear_bit_for_bit() -> None:
    w, b, x = _rand(6, 4), _rand(6, seed=1), _rand(5, 4, seed=2)
    for layer in (ColumnParallelLinear(4, 6), RowParallelLinear(4, 6), ReplicatedLinear(4, 6)):
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        assert isinstance(layer.quant_method, UnquantizedLinearMethod)
        assert torch.equal(layer(x), F.linear(x, w, b))


def test_shard_loaders_refuse_a_tensor_of_the_wrong_shape() -> None:
    from loom.layers.linear import WeightShapeError

    layer = _as_rank(0, 2, lambda: ColumnParallelLinear(4, 6, bias=False))
    with pytest.raises(WeightShapeError) as info:
        layer.weight.weight_loader(layer.weight, _rand(5, 4))
    assert (info.value.checkpoint_shape, info.value.expected_shape) == ((5, 4), (6, 4))
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
        _as_rank(0, 2, lambda: ColumnParallelLinear(4, 5))


def test_merged_gate_up_places_each_rank_slice_of_each_part() -> None:
    gate, up = _rand(8, 4, seed=1), _rand(8, 4, seed=2)
    ranks = [_as_rank(r, 2, lambda: MergedColumnParallelLinear(4, [8, 8], bias=False)) for r in range(2)]
    for layer in ranks:
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
    for r, layer in enumerate(ranks):  # [gate_r | up_r]
        assert torch.equal(layer.weight, torch.cat([gate[4 * r:4 * (r + 1)], up[4 * r:4 * (r + 1)]]))
    # A checkpoint that stores the fused [gate | up] loads to the same place.
    fused = _as_rank(1, 2, lambda: MergedColumnParallelLinear(4, [8, 8], bias=False))
    fused.weight.weight_loader(fused.weight, torch.cat([gate, up]))
    assert torch.equal(fused.weight, ranks[1].weight)


def _qkv_parts(heads: int, kv_heads: int, d: int, hidden: int) -> dict[str, torch.Tensor]:
    return {"q": _rand(heads * d, hidden, seed=1), "k": _rand(kv_heads * d, hidden, seed=2),
            "v": _rand(kv_heads * d, hidden, seed=3)}


def test_qkv_splits_heads_over_ranks() -> None:
    d, hidden = 2, 4
    parts = _qkv_parts(4, 2, d, hidden)
    ranks = [_as_rank(r, 2, lambda: QKVParallelLinear(hidden, d, 4, 2, bias=False)) for r in range(2)]
    for layer in ranks:
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (2, 1, 1)
        for shard_id, tensor in parts.items():
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
    for r, layer in enumerate(ranks):
        q, k, v = layer.weight.split([2 * d, d, d])
        assert torch.equal(q, parts["q"][2 * d * r:2 * d * (r + 1)])
        assert torch.equal(k, parts["k"][d * r:d * (r + 1)]) and torch.equal(v, parts["v"][d * r:d * (r + 1)])
    # Shard ids by index, and the fused checkpoint tensor, land on the same rows.
    by_index = _as_rank(1, 2, lambda: QKVParallelLinear(hidden, d, 4, 2, bias=False))
    for i, tensor in enumerate(parts.values()):
        by_index.weight.weight_loader(by_index.weight, tensor, i)
    fused = _as_rank(1, 2, lambda: QKVParallelLinear(hidden, d, 4, 2, bias=False))
    fused.weight.weight_loader(fused.weight, torch.cat(list(parts.values())))
    assert torch.equal(by_index.weight, ranks[1].weight) and torch.equal(fused.weight, ranks[1].weight)


def test_qkv_replicates_kv_heads_when_ranks_outnumber_them() -> None:
    d, hidden = 2, 4
    parts = _qkv_parts(4, 2, d, hidden)
    for r in range(4):
        layer = _as_rank(r, 4, lambda: QKVParallelLinear(hidden, d, 4, 2, bias=True))
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (1, 1, 2)
        for shard_id, tensor in parts.items():
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
            layer.bias.weight_loader(layer.bias, tensor[:, 0], shard_id)
        q, k, v = layer.weight.split([d, d, d])
        head = r // 2  # ranks 0 and 1 share KV head 0, ranks 2 and 3 KV head 1
        assert torch.equal(q, parts["q"][d * r:d * (r + 1)])
        assert torch.equal(k, parts["k"][d * head:d * (head + 1)])
        assert torch.equal(v, parts["v"][d * head:d * (head + 1)])
        assert torch.equal(layer.bias, torch.cat([q[:, 0], k[:, 0], v[:, 0]]))
    with pytest.raises(ValueError, match="not a multiple of the 2 KV heads"):
        _as_rank(0, 3, lambda: QKVParallelLinear(hidden, d, 3, 2))


def test_vocab_parallel_embedding_and_head_shard_with_padding() -> None:
    vocab, hidden = 10, 3
    table = _rand(vocab, hidden)
    ids = torch.tensor([0, 3, 4, 7, 8, 9, 9])
    hid = _rand(2, hidden, seed=1)
    embeds = [_as_rank(r, 3, lambda: VocabParallelEmbedding(vocab, hidden)) for r in range(3)]
    for e in embeds:
        e.weight.weight_loader(e.weight, table)
    # 4 rows a rank: 0-3, 4-7, 8-9 and two zero rows of padding
    assert [(e.shard.start, e.shard.end, e.weight.shape[0]) for e in embeds] == [(0, 4, 4), (4, 8, 4), (8, 10, 4)]
    assert torch.equal(embeds[2].weight[2:], torch.zeros(2, hidden))
    assert torch.equal(sum(e.lookup_local(ids) for e in embeds), F.embedding(ids, table))  # the all-reduce's sum
    heads = [_as_rank(r, 3, lambda: ParallelLMHead(vocab, hidden)) for r in range(3)]
    for h in heads:
        h.weight.weight_loader(h.weight, table)
    local = [h.quant_method.apply(h, hid, None) for h in heads]  # [2, 4] each
    torch.testing.assert_close(torch.cat(local, dim=-1)[:, :vocab], hid @ table.T)  # the gather, trimmed
    # One rank: exactly [V, H], no padding; a tied head reuses the embedding's parameter.
    embed = VocabParallelEmbedding(vocab, hidden, prefix="model.embed_tokens")
    embed.weight.weight_loader(embed.weight, table)
    tied = ParallelLMHead(vocab, hidden, tied=embed)
    assert embed.weight.shape == (vocab, hidden) and tied.weight is embed.weight
    assert torch.equal(embed(ids), F.embedding(ids, table)) and torch.equal(tied(hid), F.linear(hid, table))


def _split_dim(module: nn.Module, param_name: str, param: torch.Tensor) -> int | None:
    if isinstance(module, RowParallelLinear):
        return 1 if param_name == "weight" else None
    return getattr(param, "output_dim", None)


def test_tiny_model_split_over_two_ranks_concatenates_back(tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir("llama")
    config = load_hf_config(path)

    def loaded(rank: int, size: int) -> nn.Module:
        with tensor_parallel_as(rank, size):
            model = build_model(LlamaForCausalLM, config, torch.float32, torch.device("cpu"), None)
            model.load_weights(iter_weights(path, torch.float32, "cpu"))
        return model

    full, shards = loaded(0, 1), [loaded(r, 2) for r in range(2)]
    ranks = [dict(m.named_parameters()) for m in shards]
    for name, param in full.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = shards[0].get_submodule(module_name)
        parts = [r[name] for r in ranks]
        dim = _split_dim(module, leaf, parts[0])
        if dim is None:
            assert all(torch.equal(p, param) for p in parts), name
            continue
        assert parts[0].shape[dim] * 2 >= param.shape[dim] and not torch.equal(parts[0], parts[1]), name
        sizes = getattr(module, "output_partition_sizes", None) if dim == 0 else None
        if sizes and len(sizes) > 1:  # fused: each rank holds [part0_r | part1_r | ...]
            pieces = [p.split(sizes, dim=0) for p in parts]
            rebuilt = torch.cat([torch.cat([pieces[r][i] for r in range(2)]) for i in range(len(sizes))])
        else:
            rebuilt = torch.cat(parts, dim=dim).narrow(dim, 0, param.shape[dim])
        assert torch.equal(rebuilt, param), name
    assert shards[1].model.layers[0].self_attn.num_heads == 2  # of 4
    assert shards[1].model.layers[0].self_attn.o_proj.weight.shape == (64, 32)


# A toy 4-bit scheme: qweight packs 8 input values (0..15) an int32, W = (q - 8) * weight_scale.

def _pack_int4(q: torch.Tensor) -> torch.Tensor:  # [out, in] 0..15 -> [out, in / 8] int32
    shifted = q.reshape(q.shape[0], -1, 8).to(torch.int64) << (4 * torch.arange(8))
    return shifted.sum(-1).to(torch.int32)  # wraps like the two's-complement int32 it is


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:  # [out, in / 8] int32 -> [out, in]
    return ((packed.to(torch.int64).unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF).reshape(packed.shape[0], -1)


class ToyInt4Method(LinearMethod):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        rows = sum(output_partition_sizes)
        qweight = nn.Parameter(torch.empty(rows, input_size_per_partition // 8, dtype=torch.int32),
                               requires_grad=False)
        set_weight_attrs(qweight, output_dim=0, input_dim=1, packed_dim=1, packed_factor=8,
                         weight_loader=weight_loader)
        scale = nn.Parameter(torch.empty(rows, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(scale, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.dense = (_unpack_int4(layer.qweight).float() - 8) * layer.weight_scale[:, None]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.dense, bias)


class ToyConfig(QuantizationConfig):
    """Serves the attention projections (qkv, o) with ToyInt4Method; the rest stays dense."""

    @classmethod
    def for_checkpoint(cls, model_dir: Path) -> bool:
        return (Path(model_dir) / "toy_quant.json").is_file()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return ToyInt4Method() if prefix.endswith(("qkv_proj", "o_proj")) else None


class _ToyPlugin:
    @hookimpl
    def loom_quantizers(self) -> Iterator[QuantizerSpec]:
        yield QuantizerSpec(name="toy-int4", summary="test scheme", load=lambda: ToyConfig)


def _toy_checkpoint(dense_dir: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny model with every q/k/v/o weight as ``qweight`` + ``weight_scale``; returns the
    dir and each quantized tensor's dense weight."""
    from safetensors.torch import save_file

    shutil.copytree(dense_dir, out)
    tensors: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for i, (name, w) in enumerate(iter_weights(dense_dir, torch.float32, "cpu")):
        if not name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            tensors[name] = w
            continue
        q = torch.randint(0, 16, w.shape, generator=torch.Generator().manual_seed(i))
        scale = torch.rand(w.shape[0], generator=torch.Generator().manual_seed(100 + i)) * 0.1
        stem = name.removesuffix(".weight")
        tensors[f"{stem}.qweight"], tensors[f"{stem}.weight_scale"] = _pack_int4(q), scale
        dense[stem] = (q.float() - 8) * scale[:, None]
    save_file(tensors, str(out / "model.safetensors"))
    (out / "toy_quant.json").write_text("{}")
    return out, dense


def _toy_registry() -> PluginRegistry:
    import loom_plugins.models

    registry = PluginRegistry()
    registry.register(loom_plugins.models, "loom-models", "loom-server")
    registry.register(_ToyPlugin(), "toy", "toy-dist")
    return registry


def test_pack_helpers_roundtrip() -> None:
    q = torch.randint(0, 16, (3, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_unpack_int4(_pack_int4(q)), q)


def test_packed_checkpoint_loads_into_methods_chosen_per_layer(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    path, dense = _toy_checkpoint(tiny_model_dir("llama"), tmp_path / "toy")
    for quantize in ("auto", "toy-int4"):
        loaded = load_model(path, torch.float32, "cpu", _toy_registry(), quantize=quantize)
        assert loaded.quantization == "toy-int4"
        model: Any = loaded.model
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        assert isinstance(attn.qkv_proj.quant_method, ToyInt4Method)
        assert isinstance(attn.o_proj.quant_method, ToyInt4Method)
        assert isinstance(mlp.gate_up_proj.quant_method, UnquantizedLinearMethod)
        assert isinstance(model.lm_head.quant_method, UnquantizedLinearMethod)
        assert not hasattr(attn.qkv_proj, "weight")  # the method's parameters only
        stem = "model.layers.1.self_attn"
        expected = torch.cat([dense[f"{stem}.{p}_proj"] for p in "qkv"])
        assert torch.equal(attn.qkv_proj.dense, expected)  # the three parts' packs, fused
        assert torch.equal(attn.o_proj.dense, dense[f"{stem}.o_proj"])
        x = _rand(3, 64)
        assert torch.equal(attn.qkv_proj(x), F.linear(x, expected))
    dense_model = load_model(tiny_model_dir("llama"), torch.float32, "cpu", _toy_registry())
    assert dense_model.quantization is None  # auto: the checkpoint is not in the toy format

    # Names a method does not declare are still refused, and missing packed parts are named.
    weights = list(iter_weights(path, torch.float32, "cpu"))
    with pytest.raises(ModelLoadError, match=r"does not know: model\.layers\.0\.self_attn\.q_proj\.g_idx"):
        model.load_weights([*weights, ("model.layers.0.self_attn.q_proj.g_idx", torch.zeros(64, dtype=torch.int32))])
    with pytest.raises(ModelLoadError, match=r"missing weights.*model\.layers\.0\.self_attn\.v_proj\.weight_scale"):
        model.load_weights([(n, t) for n, t in weights if n != "model.layers.0.self_attn.v_proj.weight_scale"])


def test_packed_parameters_shard_by_their_logical_size() -> None:
    """A row-parallel packed weight splits its packed input dimension in whole packs."""
    q = torch.randint(0, 16, (4, 32), generator=torch.Generator().manual_seed(0))
    packed, scale = _pack_int4(q), torch.rand(4)
    config = ToyConfig(Path("."), torch.device("cpu"), torch.float32)
    ranks = [_as_rank(r, 2, lambda: RowParallelLinear(32, 4, bias=False, quant_config=config, prefix="x.o_proj"))
             for r in range(2)]
    for layer in ranks:
        assert layer.qweight.shape == (4, 2)  # 16 inputs a rank, 8 an int32
        layer.qweight.weight_loader(layer.qweight, packed)
        layer.weight_scale.weight_loader(layer.weight_scale, scale)
    assert torch.equal(torch.cat([_unpack_int4(r.qweight) for r in ranks], dim=1), q)
    qkv = _as_rank(1, 2, lambda: QKVParallelLinear(16, 4, 2, 2, bias=False, quant_config=config, prefix="x.qkv_proj"))
    parts = {s: torch.randint(0, 16, (8, 16), generator=torch.Generator().manual_seed(i)) for i, s in enumerate("qkv")}
    for s, part in parts.items():
        qkv.qweight.weight_loader(qkv.qweight, _pack_int4(part), s)
    assert torch.equal(_unpack_int4(qkv.qweight), torch.cat([parts[s][4:] for s in "qkv"]))  # rank 1's head of each


def test_load_packed_weights_maps_parts_to_fused_parameters() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = MergedColumnParallelLinear(4, [3, 3], bias=True, prefix="blk.gate_up_proj")

    gate, up, gb, ub = _rand(3, 4), _rand(3, 4, seed=1), _rand(3, seed=2), _rand(3, seed=3)
    block = Block()
    load_packed_weights(block, [("gate_proj.weight", gate), ("up_proj.weight", up), ("gate_proj.bias", gb),
                                ("up_proj.bias", ub)], {"gate_up_proj": ["gate_proj", "up_proj"]})
    assert torch.equal(block.gate_up_proj.weight, torch.cat([gate, up]))
    assert torch.equal(block.gate_up_proj.bias, torch.cat([gb, ub]))
    with pytest.raises(ModelLoadError, match=r"'up_proj\.weight' has shape \(2, 4\).*expects \(3, 4\)"):
        load_packed_weights(block, [("up_proj.weight", up[:2])], {"gate_up_proj": ["gate_proj", "up_proj"]})


def _two_rank_worker(rank: int, init_file: str) -> None:
    """One of two gloo processes: the collectives of row-parallel, embedding and head for real."""
    import torch.distributed as dist

    from loom.distributed import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        parallel_state.init_tensor_parallel()
        assert (get_tp_rank(), get_tp_size()) == (rank, 2)
        w, b, x = _rand(5, 6), _rand(5, seed=1), _rand(3, 6, seed=2)
        row = RowParallelLinear(6, 5, bias=True, input_is_parallel=False)
        row.weight.weight_loader(row.weight, w)
        row.bias.weight_loader(row.bias, b)
        torch.testing.assert_close(row(x), F.linear(x, w, b))
        col = ColumnParallelLinear(6, 4, bias=False)
        col.weight.weight_loader(col.weight, w[:4])
        assert torch.equal(col(x), F.linear(x, w[:4].narrow(0, 2 * rank, 2)))  # its own rows, not gathered
        table, ids = _rand(7, 6, seed=3), torch.tensor([0, 3, 4, 6, 6, 1])
        embed = VocabParallelEmbedding(7, 6)
        embed.weight.weight_loader(embed.weight, table)
        assert torch.equal(embed(ids), F.embedding(ids, table))
        head = ParallelLMHead(7, 6, tied=embed)
        torch.testing.assert_close(head(x), F.linear(x, table))
    finally:
        dist.destroy_process_group()


def test_collectives_over_two_real_ranks(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_two_rank_worker, args=(str(tmp_path / "pg"),), nprocs=2, join=True)


def test_gguf_config_picks_its_method_per_layer_from_the_block_types(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    import json

    from safetensors.torch import save_file

    from loom_plugins.quant import gguf

    if not gguf.kernel_available():
        pytest.skip(f"GGUF CPU kernel unavailable: {gguf.cpu_unsupported_reason()}")
    path = tiny_model_dir("llama")
    types = {f"model.layers.0.self_attn.{p}.weight": "Q4_1" for p in ("q_proj", "k_proj", "v_proj")}
    types |= {"model.layers.1.self_attn.q_proj.weight": "Q4_1", "model.layers.1.self_attn.k_proj.weight": "Q8_0",
              "model.layers.1.self_attn.v_proj.weight": "Q4_1", "model.layers.0.mlp.down_proj.weight": "Q6_K",
              "lm_head.weight": "Q8_0"}
    save_file({"unused": torch.zeros(1)}, str(tmp_path / gguf.BLOCKS_FILE), metadata={"types": json.dumps(types)})
    config = gguf.GGUFConfig(tmp_path, torch.device("cpu"), torch.float32)
    config.packed_modules_mapping = dict(LlamaForCausalLM.packed_modules_mapping)
    model: Any = build_model(LlamaForCausalLM, load_hf_config(path), torch.float32, torch.device("cpu"), config)
    layers = model.model.layers

    def served(module: nn.Module) -> bool:
        return isinstance(module.quant_method, gguf.GGUFLinearMethod)

    assert served(layers[0].self_attn.qkv_proj) and served(model.lm_head)
    assert layers[0].self_attn.qkv_proj.blocks.shape == (128, 64 // 32 * 20)  # Q4_1: 20 bytes a block of 32
    assert not served(layers[1].self_attn.qkv_proj)  # parts of two types: one blocks tensor cannot hold them
    assert not served(layers[0].mlp.down_proj)  # Q6_K has no kernel
    assert not served(layers[0].self_attn.o_proj)  # no blocks: dense
    assert config.skips_checkpoint_tensor("model.layers.0.self_attn.k_proj.weight")
    assert not config.skips_checkpoint_tensor("model.layers.1.self_attn.k_proj.weight")
    assert config.served["model.layers.0.self_attn.v_proj.weight"] == "model.layers.0.self_attn.v_proj.blocks"
