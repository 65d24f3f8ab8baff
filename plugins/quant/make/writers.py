"""Writing a quantized model as a standard checkpoint directory that Loom (and other servers) load:
config.json with its ``quantization_config``, ``model.safetensors``, and the source's tokenizer
and generation files copied."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..fp8 import FP8_MAX, quantize_fp8
from ..int_packing import AWQ_ORDER, pack_cols, pack_rows
from ..nf4 import BLOCKSIZE, STATE_KEY, nf4_table, quantize_nf4
from .group_quant import QuantizedLinear

# Files of a model directory that are not the weights or the config: copied as they are.
_NOT_COPIED = {"config.json", "model.safetensors", "model.safetensors.index.json", "gguf_blocks.safetensors"}


def gptq_tensors(stem: str, ql: QuantizedLinear) -> dict[str, torch.Tensor]:
    """GPTQ v1 ("gptq"): zeros stored minus one (see ``loom_plugins.quant.gptq``)."""
    mask = (1 << ql.bits) - 1
    return {
        f"{stem}.qweight": pack_rows(ql.codes.t(), ql.bits),  # [in / f, out]
        f"{stem}.qzeros": pack_cols((ql.zeros.t() - 1) & mask, ql.bits),  # [G, out / f]
        f"{stem}.scales": ql.scales.t().contiguous().half(),  # [G, out]
        f"{stem}.g_idx": ql.g_idx.to(torch.int32).clone(),  # [in] (a fused group shares one: saved apart)
    }


def awq_tensors(stem: str, ql: QuantizedLinear) -> dict[str, torch.Tensor]:
    return {
        f"{stem}.qweight": pack_cols(ql.codes.t(), 4, AWQ_ORDER),  # [in, out / 8]
        f"{stem}.qzeros": pack_cols(ql.zeros.t(), 4, AWQ_ORDER),  # [G, out / 8]
        f"{stem}.scales": ql.scales.t().contiguous().half(),  # [G, out]
    }


def fp8_tensors(stem: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors FP8, one scale per output channel."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [out, 1]
    return {f"{stem}.weight": quantize_fp8(weight, scale), f"{stem}.weight_scale": scale}


def nf4_tensors(stem: str, weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """bitsandbytes NF4 as transformers saves it (blocks of 64, no double quantization)."""
    packed, absmax = quantize_nf4(weight, BLOCKSIZE)
    state = {"quant_type": "nf4", "blocksize": BLOCKSIZE, "dtype": str(dtype).removeprefix("torch."),
             "shape": list(weight.shape)}
    return {
        f"{stem}.weight": packed.reshape(-1, 1),
        f"{stem}.weight.absmax": absmax,
        f"{stem}.weight.quant_map": nf4_table(),
        f"{stem}.weight.{STATE_KEY}": torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8),
    }


def quantization_config(method: str, bits: int, group_size: int, act_order: bool, dtype: torch.dtype,
                        lm_head: bool = False) -> dict[str, Any]:
    if method in ("gptq", "rtn"):
        # RTN is GPTQ's format with plain rounding: any GPTQ reader serves it. lm_head: whether
        # the head is quantized too (GPTQModel's field; vLLM reads it as well).
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": True,
                "checkpoint_format": "gptq", "lm_head": lm_head, "quantizer": f"loom quantize --method {method}"}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if method == "fp8":
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "ignore": ["lm_head"], "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                          "strategy": "token"}}}}
    if method == "nf4":
        return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False,
                "bnb_4bit_compute_dtype": str(dtype).removeprefix("torch."), "bnb_4bit_quant_storage": "uint8",
                "llm_int8_skip_modules": ["lm_head"]}
    raise ValueError(f"unknown method {method!r}")


def write_checkpoint(source_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor], qconfig: dict[str, Any],
                     dtype: torch.dtype, untie: bool = False) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for path in source_dir.iterdir():
        if path.is_file() and path.name not in _NOT_COPIED and path.suffix != ".safetensors":
            shutil.copy(path, out_dir / path.name)
    config = json.loads((source_dir / "config.json").read_text())
    config.pop("loom_random_weights", None)  # the weights are written now
    config["quantization_config"] = qconfig
    if untie:  # the head has tensors of its own now (quantized), not the embedding's
        config["tie_word_embeddings"] = False
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
