"""``loom serve`` on a quantized checkpoint other tools write, as a real process: a compressed-tensors
pack-quantized model (LLM Compressor's W4A16, packed by compressed-tensors itself) is served by
the ``wna16`` quantizer that ``--quantize auto`` picks from its config, GetModelInfo names it with
its settings, and greedy tokens through gRPC equal transformers' on the same dequantized weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

PROMPT = [1, 504, 3458, 314, 4649, 28, 253, 1345, 282]
NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    from helpers.quant_checkpoints import wna16_checkpoint

    return wna16_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("wna16") / "ct", group=32, sym=False)


@pytest.fixture(scope="module")
def server(checkpoint: tuple[Path, dict], server_logs: Path) -> Iterator[ServerProcess]:
    s = start_server(checkpoint[0], server_logs, "wna16", "--max-total-tokens", "512", "--max-batch-total-tokens", "4096")
    yield s
    s.stop()


def test_a_compressed_tensors_checkpoint_is_served_and_named(server: ServerProcess, checkpoint: tuple[Path, dict],
                                                             tiny_llama_dir: Path, tmp_path: Path) -> None:
    from helpers.lora_adapters import greedy_tokens
    from helpers.quant_checkpoints import dense_with
    from helpers.tiny_models import load_hf_reference

    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    quantizers = [(p.name, dict(p.settings)) for p in info.plugins if p.kind == "quantizer"]
    assert quantizers == [("wna16", {"format": "pack-quantized", "bits": "4", "group_size": "32", "sym": "false",
                                     "actorder": "none"})]
    params = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=NEW, ignore_eos=True),
                           response=pb.ResponseParameters(tokens=True))
    resp = server.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), parameters=params), timeout=60)
    ours = [t.id for t in resp.completions[0].tokens]
    reference = load_hf_reference(dense_with(tiny_llama_dir, tmp_path / "hf", checkpoint[1]))
    assert ours == greedy_tokens(reference, PROMPT, NEW)
