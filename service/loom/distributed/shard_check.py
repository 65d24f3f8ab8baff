"""Whether a model splits over ``--num-shard`` ranks, checked before any rank starts.

The layers would refuse too, while each rank builds its model (``layers/linear.py``'s
``divide``), but one message at start that names the flag and every number is better than the
first layer's error from N processes at once.
"""

from __future__ import annotations

from typing import Any

from loom.config import ConfigError


def shard_problems(hf_config: Any, num_shard: int) -> list[str]:
    """Why ``num_shard`` ranks cannot split this model (empty: they can)."""
    from loom.model_loader.hf_config import head_dim_of, num_kv_heads_of

    if num_shard == 1:
        return []
    problems: list[str] = []
    heads, kv_heads = int(hf_config.num_attention_heads), num_kv_heads_of(hf_config)
    if heads % num_shard:
        problems.append(f"{heads} attention heads are not divisible by {num_shard}")
    if num_shard >= kv_heads and num_shard % kv_heads:
        problems.append(f"{num_shard} is not a multiple of the {kv_heads} KV heads (each rank needs whole, "
                        "replicated KV heads)")
    if num_shard < kv_heads and kv_heads % num_shard:
        problems.append(f"{kv_heads} KV heads are not divisible by {num_shard}")
    sizes = {"intermediate_size": getattr(hf_config, "intermediate_size", None),
             "moe_intermediate_size": getattr(hf_config, "moe_intermediate_size", None)}
    for name, size in sizes.items():
        if isinstance(size, int) and size % num_shard:
            problems.append(f"{name} {size} is not divisible by {num_shard}")
    # Grouped quantization (GPTQ / AWQ): a row-parallel layer's slice of the input must be whole
    # groups, or a group's scale would be split between ranks. GPTQ act-order (desc_act) is the
    # exception: its groups are scattered over the input anyway, so every rank keeps every group.
    qconfig = getattr(hf_config, "quantization_config", None)
    group = _row_group_size(qconfig) if isinstance(qconfig, dict) else None
    if isinstance(group, int) and group > 0:
        inputs = {"o_proj's input": heads * head_dim_of(hf_config)}
        if isinstance(sizes["intermediate_size"], int):
            inputs["down_proj's input"] = sizes["intermediate_size"]
        for name, size in inputs.items():
            if size % num_shard == 0 and (size // num_shard) % group:
                problems.append(f"{name} per rank ({size} / {num_shard} = {size // num_shard}) is not a whole "
                                f"number of quantization groups of {group}")
    # A quantized head (GPTQ's lm_head: true) packs 32 / bits vocabulary columns a word of its zero
    # points: each rank's share of the vocabulary, ceil(V / N), must fill whole words.
    if isinstance(qconfig, dict) and str(qconfig.get("quant_method", "")).lower() == "gptq" \
            and qconfig.get("lm_head") is True and isinstance(qconfig.get("bits"), int) and qconfig["bits"] > 0:
        per_word, vocab = 32 // qconfig["bits"], int(hf_config.vocab_size)
        rows = -(-vocab // num_shard)
        if rows % per_word:
            problems.append(f"the quantized head's vocabulary per rank (ceil({vocab} / {num_shard}) = {rows}) is not "
                            f"a multiple of the {per_word} columns a packed word of its zero points holds")
    return problems


def _row_group_size(qconfig: dict[str, Any]) -> Any:
    """The inputs a quantization group spans, where a row-parallel rank must hold whole groups
    (None: no such constraint): GPTQ / AWQ's ``group_size``, or the weights' ``group_size`` of a
    compressed-tensors pack-quantized scheme; not with act-order's g_idx (GPTQ ``desc_act``,
    compressed-tensors ``actorder: group``)."""
    method = str(qconfig.get("quant_method", "")).lower()
    if method == "gptq" and qconfig.get("desc_act") is True:
        return None
    if method == "compressed-tensors":
        groups = qconfig.get("config_groups")
        weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
        sizes = [w.get("group_size") for w in weights
                 if isinstance(w, dict) and w.get("strategy") == "group" and w.get("actorder") not in ("group", "dynamic")]
        return sizes[0] if sizes else None
    return qconfig.get("group_size")


def check_shardable(hf_config: Any, num_shard: int) -> None:
    """Raise :class:`ConfigError` naming every number that ``num_shard`` does not divide."""
    problems = shard_problems(hf_config, num_shard)
    if problems:
        raise ConfigError(f"--num-shard {num_shard} cannot split this model: " + "; ".join(problems))
