"""Random-weight models for benchmarking: ``--model-id random:llama-8b`` and friends.

Speed does not depend on the values of the weights, so a benchmark needs no hub download and no
16 GB checkpoint on disk. ``random:NAME`` resolves to a cached directory holding the shape
(config.json with a ``loom_random_weights`` marker), a generation config and a word-level
tokenizer (so that ``loom serve`` can serve it too), and no weights. The loader sees the marker
and draws every parameter in place, on the target device and in the target dtype, from a seeded
generator on that device: no host copy, no fp32 detour, and the same seed gives the same model.

The shapes are those of ../shared/bench/WORKLOADS.md (the Hugging Face LlamaConfig fields the
peer benchmark uses), plus small ones for CPU runs and tests. A shape of another architecture
names its ``model_type`` and ``architectures`` (``random:qwen3-30b-a3b``: Qwen3-30B-A3B's
published config.json, a Mixture-of-Experts model of 30.5B parameters, 3.3B active).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import ModelLoadError

PREFIX = "random:"
MARKER = "loom_random_weights"  # config.json field: {"seed": int, "std": float}
LAYOUT_VERSION = 1  # bump when the directory contents change, so stale caches are rebuilt
DEFAULT_SEED = 0
DEFAULT_STD = 0.02  # HF's initializer_range for Llama; what the peer's random init draws from

# Token ids every shape shares (the peer benchmark's LlamaConfig uses the same).
_SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

SHAPES: dict[str, dict[str, Any]] = {
    # The Llama-3.1-8B shape: 16.06 GB of bf16 weights.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                     max_position_embeddings=8192),
    # The Llama-3.2-1B shape: 2.47 GB, tied embeddings.
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                     max_position_embeddings=8192, tie_word_embeddings=True),
    # SmolLM2-135M's shape, for CPU runs without the GGUF conversion.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5),
    # For tests: milliseconds a step on CPU, yet room for W1/W2 prompts (ids < 1000, 1,280 tokens).
    "tiny-llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1024, rope_theta=10000.0,
                       max_position_embeddings=2048, rms_norm_eps=1e-5),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers of 128 experts, 8 chosen per token,
    # each expert 768 wide; 32 query heads and 4 KV heads of 128. 61.1 GB in bf16; a batch-1 decode
    # step reads 6.1 GB of it (its 8 experts a layer, the attention, the router and the head).
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
                          rms_norm_eps=1e-6, tie_word_embeddings=False),
    # The same architecture in miniature, for tests.
    "tiny-moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64,
                     intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     vocab_size=1024, rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-6),
}
_ARCHITECTURE_FIELDS = ("model_type", "architectures")


@dataclass(frozen=True)
class RandomWeights:
    seed: int = DEFAULT_SEED
    std: float = DEFAULT_STD


def is_random_model_id(model_id: str | None) -> bool:
    return model_id is not None and model_id.startswith(PREFIX)


def random_shape(model_id: str) -> dict[str, Any]:
    """The config fields of ``random:NAME`` (or of a bare NAME); ``model_type`` and
    ``architectures`` when it is not a Llama."""
    name = model_id.removeprefix(PREFIX)
    if name not in SHAPES:
        raise ModelLoadError(f"--model-id {model_id!r}: unknown random-weight shape {name!r}; "
                             f"known: {', '.join(PREFIX + n for n in SHAPES)}")
    return {**SHAPES[name], **_SPECIAL_IDS}


def _cache_root() -> Path:
    base = os.environ.get("LOOM_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "loom"
    return root / "random"


def _write_tokenizer(vocab_size: int, out: Path) -> None:
    """A word-level tokenizer over the whole vocabulary: id i is the word ``w<i>``.

    Benchmarks send token ids; the tokenizer only lets the server decode what it generates
    (and encode warm-up text: unknown words map to ``<unk>``).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, matching _SPECIAL_IDS
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>", unk_token="<unk>")
    hf.model_max_length = 1 << 30
    hf.save_pretrained(str(out))


def _write_model_dir(model_id: str, out: Path, weights: RandomWeights) -> None:
    from transformers import AutoConfig, GenerationConfig

    shape = random_shape(model_id)
    model_type = shape.get("model_type", "llama")
    fields: dict[str, Any] = {k: v for k, v in shape.items() if k not in _ARCHITECTURE_FIELDS}
    fields.update(architectures=shape.get("architectures", ["LlamaForCausalLM"]), dtype="bfloat16",
                  **{MARKER: {"seed": weights.seed, "std": weights.std}})
    config = AutoConfig.for_model(model_type, **fields)
    config.save_pretrained(str(out))
    GenerationConfig(**_SPECIAL_IDS).save_pretrained(str(out))
    _write_tokenizer(int(shape["vocab_size"]), out)


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in ("config.json", "generation_config.json", "tokenizer.json"))


def random_model_dir(model_id: str) -> Path:
    """The cached directory of ``random:NAME``, written on first use (about a second)."""
    name = model_id.removeprefix(PREFIX)
    random_shape(model_id)  # unknown names fail before anything is written
    root = _cache_root()
    final = root / f"{name}-v{LAYOUT_VERSION}"
    if _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    # Built aside and renamed, so a concurrent process never sees half a directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        _write_model_dir(model_id, tmp, RandomWeights())
        tmp.chmod(0o755)
        if final.exists() and not _complete(final):
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):  # else another process won the race with the same contents
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def random_weights_of(config: Any) -> RandomWeights | None:
    """The marker of a random-weight model's config, or None for a model with a checkpoint."""
    value = getattr(config, MARKER, None)
    if value is None:
        return None
    if isinstance(value, str):  # tolerate a hand-written JSON string
        value = json.loads(value)
    return RandomWeights(seed=int(value.get("seed", DEFAULT_SEED)), std=float(value.get("std", DEFAULT_STD)))


@torch.no_grad()
def init_random_weights(model: nn.Module, weights: RandomWeights) -> None:
    """Draw every parameter in place: normal(0, std) for matrices, ones for norms, zeros for biases.

    The generator lives on the parameters' device, so nothing is drawn on the host and copied;
    a fixed parameter order makes the result a function of the seed alone (per device type).
    """
    params = list(model.named_parameters())  # tied parameters appear once
    if not params:
        return
    generator = torch.Generator(device=params[0][1].device).manual_seed(weights.seed)
    for name, param in params:
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, weights.std, generator=generator)
