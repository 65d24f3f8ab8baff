"""Quantized checkpoints of a tiny dense model, written by packers of the tests' own (not Loom's),
and reference readers written from the published format descriptions.

The packers and readers here use NumPy and explicit bit loops, deliberately unlike Loom's torch
code (``loom_plugins.quant.int_packing``), so a shared mistake would need two different wrong
implementations that agree.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dense_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


# ---- int packing (NumPy, bit by bit) --------------------------------------------------------------


def np_pack_words(values: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Pack ``values`` (unsigned, < 2^bits) along ``axis``: word slot j holds element ``order[j]`` of
    its group (identity when None), slot 0 in the lowest bits."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    groups = v.shape[0] // per
    out = np.zeros((groups, *v.shape[1:]), dtype=np.uint32)
    for g in range(groups):
        for slot in range(per):
            element = (order[slot] if order else slot)
            out[g] |= v[g * per + element] << np.uint32(slot * bits)
    return np.moveaxis(out, 0, axis).view(np.int32)


def np_unpack_words(words: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    per = 32 // bits
    w = np.moveaxis(words.view(np.uint32), axis, 0)
    out = np.zeros((w.shape[0] * per, *w.shape[1:]), dtype=np.int64)
    for g in range(w.shape[0]):
        for slot in range(per):
            element = (order[slot] if order else slot)
            out[g * per + element] = (w[g] >> np.uint32(slot * bits)) & np.uint32((1 << bits) - 1)
    return np.moveaxis(out, 0, axis)


AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: slot j holds column AWQ_PACK_ORDER[j]


# ---- quantizing a dense weight (round to nearest), the tests' own ---------------------------------


def rtn_groups(w: np.ndarray, bits: int, group: int, sym: bool, rng: np.random.Generator,
               act_order: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``w [out, in]`` -> (q [in, out], zeros [G, out], scales fp16 [G, out], g_idx [in])."""
    out_f, in_f = w.shape
    g_size = in_f if group == -1 else group
    n_groups = in_f // g_size
    perm = rng.permutation(in_f) if act_order else np.arange(in_f)
    g_idx = np.empty(in_f, dtype=np.int32)
    g_idx[perm] = np.arange(in_f) // g_size  # the i-th input in quantization order joins group i // size
    maxq = (1 << bits) - 1
    q = np.zeros((in_f, out_f), dtype=np.int64)
    zeros = np.zeros((n_groups, out_f), dtype=np.int64)
    scales = np.zeros((n_groups, out_f), dtype=np.float16)
    for g in range(n_groups):
        cols = np.nonzero(g_idx == g)[0]
        block = w[:, cols].astype(np.float32)  # [out, size]
        if sym:
            s = np.maximum(np.abs(block).max(axis=1), 1e-6) * 2 / maxq
            z = np.full(out_f, (maxq + 1) // 2)
        else:
            lo, hi = np.minimum(block.min(axis=1), 0), np.maximum(block.max(axis=1), 0)
            s = np.maximum(hi - lo, 1e-6) / maxq
            z = np.clip(np.round(-lo / s), 1, maxq)  # >= 1: v1 stores z - 1 (0 would wrap to 2^bits)
        s16 = s.astype(np.float16)
        q[cols] = np.clip(np.round(block / s16.astype(np.float32)[:, None]) + z[:, None], 0, maxq).T
        zeros[g], scales[g] = z, s16
    return q, zeros, scales, g_idx


def ref_dequant(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> torch.Tensor:
    """W [out, in] float32 from codes [in, out], zeros / scales [G, out], g_idx [in]; elementwise."""
    wt = (q - zeros[g_idx]).astype(np.float32) * scales[g_idx].astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(wt.T))


# ---- checkpoints ------------------------------------------------------------------------------


def _write(dense_dir: Path, out: Path, tensors: dict[str, torch.Tensor], qconfig: dict[str, Any],
           **config_changes: Any) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in dense_dir.iterdir():
        if name.name not in ("model.safetensors", "config.json"):
            shutil.copy(name, out / name.name)
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = qconfig
    config.update(config_changes)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def gptq_checkpoint(dense_dir: Path, out: Path, *, bits: int = 4, group: int = 32, sym: bool = True,
                    desc_act: bool = False, v2: bool = False, seed: int = 0,
                    lm_head: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """The dense model's linears as GPTQ; returns the dir and each linear's reference dequantized weight.
    ``lm_head``: the head too, as GPTQModel writes it with ``lm_head=True`` (a tied head gets
    ``lm_head.*`` tensors of its own from the embedding's matrix, and the config is untied)."""
    rng = np.random.default_rng(seed)
    tensors, expected = {}, {}
    dense = dense_tensors(dense_dir)
    config = json.loads((dense_dir / "config.json").read_text())
    if lm_head and "lm_head.weight" not in dense:  # tied: the head's matrix is the embedding's
        dense["lm_head.weight"] = dense["model.embed_tokens.weight"]
    for name, w in dense.items():
        if not is_linear(name) and not (lm_head and name == "lm_head.weight"):
            tensors[name] = w
            continue
        stem = name.removesuffix(".weight")
        q, z, s, g_idx = rtn_groups(w.float().numpy(), bits, group, sym, rng, desc_act)
        stored_z = z if v2 else (z - 1) & ((1 << bits) - 1)
        tensors[f"{stem}.qweight"] = torch.from_numpy(np_pack_words(q, bits, axis=0))
        tensors[f"{stem}.qzeros"] = torch.from_numpy(np_pack_words(stored_z, bits, axis=1))
        tensors[f"{stem}.scales"] = torch.from_numpy(s)
        tensors[f"{stem}.g_idx"] = torch.from_numpy(g_idx)
        expected[stem] = ref_dequant(q, z, s, g_idx)
    qconfig = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
               "checkpoint_format": "gptq_v2" if v2 else "gptq", "lm_head": lm_head}
    untie = {"tie_word_embeddings": False} if lm_head and config.get("tie_word_embeddings") else {}
    return _write(dense_dir, out, tensors, qconfig, **untie), expected


def awq_checkpoint(dense_dir: Path, out: Path, *, group: int = 32, seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    tensors, expected = {}, {}
    for name, w in dense_tensors(dense_dir).items():
        if not is_linear(name):
            tensors[name] = w
            continue
        stem = name.removesuffix(".weight")
        q, z, s, g_idx = rtn_groups(w.float().numpy(), 4, group, False, rng, False)
        tensors[f"{stem}.qweight"] = torch.from_numpy(np_pack_words(q, 4, axis=1, order=AWQ_PACK_ORDER))
        tensors[f"{stem}.qzeros"] = torch.from_numpy(np_pack_words(z, 4, axis=1, order=AWQ_PACK_ORDER))
        tensors[f"{stem}.scales"] = torch.from_numpy(s)
        expected[stem] = ref_dequant(q, z, s, g_idx)
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return _write(dense_dir, out, tensors, qconfig), expected


def fp8_checkpoint(dense_dir: Path, out: Path, *, per_channel: bool, static: bool,
                   layout: str = "compressed-tensors", weight_only: bool = False,
                   torch_writer: bool = False,
                   block: tuple[int, int] | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """FP8 made with compressed-tensors' own quantize / dequantize (the independent reference).
    Every ``LINEARS`` module is quantized, the experts of an MoE checkpoint included.
    ``weight_only``: compressed-tensors with no ``input_activations`` (``static`` ignored).
    ``torch_writer``: the same arithmetic in plain torch (``w / scale`` clamped to +-448, cast to
    e4m3; ``codes * scale``), for machines without compressed-tensors (the GPU's).
    ``block = (bn, bk)``: block-wise scales (each block's max |w| / 448), named ``weight_scale_inv``
    with ``weight_block_size`` in the ``fp8`` layout (DeepSeek's and Qwen3's releases), ``weight_scale``
    with ``strategy: block`` in compressed-tensors' (LLM Compressor's FP8_BLOCK); dynamic activations."""
    if block is not None:
        return _fp8_block_checkpoint(dense_dir, out, block, layout, torch_writer)
    if torch_writer:
        def quantize(w: torch.Tensor, scale: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
            return (w.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

        def dequantize(q: torch.Tensor, scale: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
            return q.float() * scale

        args = None
    else:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

        args = QuantizationArgs(num_bits=8, type="float", symmetric=True,
                                strategy="channel" if per_channel else "tensor")
    tensors, expected = {}, {}
    for i, (name, w) in enumerate(dense_tensors(dense_dir).items()):
        if not is_linear(name):
            tensors[name] = w
            continue
        stem = name.removesuffix(".weight")
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
        scale = (amax / 448.0).float()
        q = quantize(w, scale, torch.zeros_like(scale), args, dtype=torch.float8_e4m3fn)
        tensors[name] = q
        tensors[f"{stem}.weight_scale"] = scale if per_channel else scale.reshape(())
        if static and not weight_only:
            tensors[f"{stem}.input_scale"] = torch.tensor(0.05 + 0.01 * i, dtype=torch.float32)
        expected[stem] = dequantize(q, scale, None, args, dtype=torch.float32)
    if layout == "fp8":
        qconfig: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    else:
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                "strategy": "tensor" if static else "token"}
        qconfig = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                   "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "weights": {
                       "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                       "strategy": "channel" if per_channel else "tensor"}}}}
        if weight_only:
            qconfig["config_groups"]["group_0"]["input_activations"] = None
    return _write(dense_dir, out, tensors, qconfig), expected


def _fp8_block_checkpoint(dense_dir: Path, out: Path, block: tuple[int, int], layout: str,
                          torch_writer: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    bn, bk = block
    if not torch_writer:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[bn, bk])
    scale_name = "weight_scale_inv" if layout == "fp8" else "weight_scale"
    tensors, expected = {}, {}
    for name, w in dense_tensors(dense_dir).items():
        if not is_linear(name):
            tensors[name] = w
            continue
        rows, cols = w.shape
        assert rows % bn == 0 and cols % bk == 0, (name, tuple(w.shape), block)
        scale = (w.float().reshape(rows // bn, bn, cols // bk, bk).abs().amax(dim=(1, 3)) / 448.0).float()
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        if torch_writer:
            q = (w.float() / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            deq = q.float() * full
        else:
            q = quantize(w, scale, torch.zeros_like(scale), args, dtype=torch.float8_e4m3fn)
            deq = dequantize(q, scale, None, args, dtype=torch.float32)
        stem = name.removesuffix(".weight")
        tensors[name], tensors[f"{stem}.{scale_name}"] = q, scale
        expected[stem] = deq
    if layout == "fp8":
        qconfig: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [bn, bk], "modules_to_not_convert": ["lm_head"]}
    else:
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
                "group_size": bk}
        qconfig = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                   "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "weights": {
                       "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                       "strategy": "block", "block_structure": [bn, bk]}}}}
    return _write(dense_dir, out, tensors, qconfig), expected


def nf4_checkpoint(dense_dir: Path, out: Path, *, double_quant: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    """NF4 packed by bitsandbytes itself; the reference is bitsandbytes' own dequantize_4bit."""
    import bitsandbytes.functional as bnbf

    tensors, expected = {}, {}
    for name, w in dense_tensors(dense_dir).items():
        if not is_linear(name):
            tensors[name] = w
            continue
        packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
        tensors[name] = packed
        for key, value in state.as_dict(packed=True).items():
            tensors[f"{name}.{key}"] = value
        expected[name.removesuffix(".weight")] = bnbf.dequantize_4bit(packed, state).float()
    qconfig = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
               "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": double_quant,
               "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8"}
    return _write(dense_dir, out, tensors, qconfig), expected


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def dequantized_linears(model: Any) -> dict[str, torch.Tensor]:
    """Each quantized linear layer's dequantized weight (float32) split back into its checkpoint
    modules: ``{stem: [out, in]}``."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf not in FUSED or not hasattr(module.quant_method, "dequantize"):
            continue
        w = module.quant_method.dequantize(module, torch.float32)
        parts = FUSED[leaf]
        for part, rows in zip(parts, w.split(module.output_partition_sizes), strict=True):
            out[f"{name.rpartition('.')[0]}.{part}"] = rows
    return out


def dense_with(dense_dir: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """The dense model with each linear replaced by ``weights[stem]`` (a transformers reference)."""
    from safetensors.torch import save_file

    shutil.copytree(dense_dir, out)
    tensors = dense_tensors(dense_dir)
    for stem, w in weights.items():
        tensors[f"{stem}.weight"] = w.float().contiguous()
    config = json.loads((out / "config.json").read_text())
    if "lm_head" in weights and config.get("tie_word_embeddings"):  # a head of its own: untied
        config["tie_word_embeddings"] = False
        (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def wna16_checkpoint(dense_dir: Path, out: Path, *, bits: int = 4, group: int = 32, sym: bool = True,
                     actorder: str | None = None, seed: int = 0,
                     lm_head: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """compressed-tensors ``pack-quantized`` (LLM Compressor's W4A16 / W8A16), packed by
    compressed-tensors' own code, bf16 scales as it saves a bf16 model's; the expected weights are
    its own decompression (with the scales in float32: exact). ``actorder="group"`` (the layout
    compressed-tensors wrote before 0.20): a ``weight_g_idx`` of random order, packed with its
    pack_to_int32 and dequantized by its elementwise helper (its newer compressor has no g_idx)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward_helpers import _dequantize

    rng = np.random.default_rng(seed)
    strategy = "channel" if group == -1 else "group"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=None if group == -1 else group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    half = 1 << (bits - 1)
    tensors, expected = {}, {}
    for name, w in dense_tensors(dense_dir).items():
        if not is_linear(name) and not (lm_head and name == "lm_head.weight"):  # (lm_head: not in ignore)
            tensors[name] = w
            continue
        stem = name.removesuffix(".weight")
        q, z, s, g_idx = rtn_groups(w.float().numpy(), bits, group, sym, rng, actorder == "group")
        scale = torch.from_numpy(s.astype(np.float32)).t().contiguous().to(torch.bfloat16)  # [out, G]
        codes = torch.from_numpy(q.T - half).to(torch.int8).contiguous()  # [out, in], signed
        zp = torch.from_numpy(z.T - half).to(torch.int8).contiguous()  # [out, G], signed
        if actorder == "group":
            g = torch.from_numpy(g_idx).long()
            packed = {"weight_packed": pack_to_int32(codes, bits), "weight_scale": scale,
                      "weight_g_idx": torch.from_numpy(g_idx)}
            if not sym:
                packed["weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
            expected[stem] = _dequantize(codes, scale.float()[:, g], None if sym else zp[:, g])
        else:
            # the dense weight these codes round to, then compressed-tensors' own compression
            dense = _dequantize(codes, scale.float().repeat_interleave(w.shape[1] // scale.shape[1], 1),
                                None if sym else zp.repeat_interleave(w.shape[1] // zp.shape[1], 1))
            state = {"weight": dense, "weight_scale": scale.float(), "weight_zero_point": zp}
            packed = dict(PackedQuantizationCompressor.compress(state, scheme))
            # (its codes are the ones rounded here: the tests' own unpacker reads them back)
            assert np.array_equal(np_unpack_words(packed["weight_packed"].numpy(), bits, axis=1), q.T)
            expected[stem] = PackedQuantizationCompressor.decompress(
                {**packed, "weight_scale": scale.float()}, scheme)["weight"].float()
            packed["weight_scale"] = scale
        tensors.update({f"{stem}.{k}": v for k, v in packed.items() if k != "weight"})
    qconfig = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
               "ignore": [] if lm_head else ["lm_head"], "config_groups": {"group_0": {
                   "targets": ["Linear"], "input_activations": None, "output_activations": None,
                   "weights": {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
                               "group_size": None if group == -1 else group, "dynamic": False,
                               "actorder": actorder, "observer": "minmax"}}}}
    return _write(dense_dir, out, tensors, qconfig), expected
