"""End-to-end fixtures: the real ``loom serve`` process on a free port, reached through the stubs.

Servers are shared per session (``tiny_server``: a random-weight 2-layer Llama with the real
SmolLM2 tokenizer; ``smol_server``: the embedded SmolLM2 default) or per module when a test
needs special limits, to keep the suite within a few minutes on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .server_process import ServerProcess, start_server


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
    # A compile limit well above the default 10 s: test_structured_output's slow regex compiles
    # in 4-6 s on 2 cores while two streams decode (its compile threads niced), and once took
    # longer than 10 s on a CI machine, which refused it instead of showing that it did not delay
    # the streams. The limit itself is tested on a server of its own.
    server = start_server(None, server_logs, "smol", "--max-batch-total-tokens", "8192", "--json-output",
                          "--grammar-compile-timeout", "60")
    yield server
    server.stop()
