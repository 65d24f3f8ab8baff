"""End-to-end fixtures: the real ``loom serve`` process on a free port, reached through the stubs.

Servers are shared per session (``tiny_server``: a random-weight 2-layer Llama with the real
SmolLM2 tokenizer; ``smol_server``: the embedded SmolLM2 default) or per module when a test
needs special limits, to keep the suite within a few minutes on 2 cores.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from .server_process import ServerProcess, start_server

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A random-weight 2-layer Llama whose vocabulary is SmolLM2's, with SmolLM2's tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-smol-vocab")
    from loom.frontend.tokenizer import Tokenizer

    vocab = Tokenizer.from_model_dir(default_model_dir).vocab_size
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096,
                         initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "tiny", "--max-total-tokens", "1024",
                          "--max-batch-total-tokens", "65536", "--max-input-tokens", "1000")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server(default_model_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(None, server_logs, "smol", "--max-batch-total-tokens", "8192", "--json-output")
    yield server
    server.stop()
