"""LoRA adapters through a real server (tiny random Llama with SmolLM2's vocabulary, CPU, fp32):
outputs equal peft's merged model, adapters loaded and unloaded while a stream runs, every error
with its status, the API key required, GetModelInfo / ListAdapters and the per-adapter metric."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from helpers.lora_adapters import greedy_tokens, merged_model, save_peft_adapter
from prometheus_client.parser import text_string_to_metric_families

from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

KEY = "lora-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]
NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-adapters")
    return {"a": save_peft_adapter(tiny_llama_dir, root / "a", r=8, targets=("q_proj", "v_proj", "down_proj"), seed=3),
            "b": save_peft_adapter(tiny_llama_dir, root / "b", r=4, alpha=8, use_rslora=True,
                                   targets=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=4)}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, server_logs: Path, adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    s = start_server(tiny_llama_dir, server_logs, "lora", "--max-total-tokens", "1024",
                     "--max-batch-total-tokens", "8192", "--api-key", KEY,
                     "--lora-adapters", f"a={adapters['a']}", "--max-loras", "2", "--max-lora-rank", "8")
    yield s
    s.stop()


def _generate(server: ServerProcess, adapter: str, new: int = NEW) -> list[int]:
    params = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=new, ignore_eos=True),
                           response=pb.ResponseParameters(tokens=True))
    resp = server.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), parameters=params,
                                                   adapter_id=adapter), metadata=AUTH, timeout=60)
    return [t.id for t in resp.completions[0].tokens]


def _error(call: Any) -> tuple[grpc.StatusCode, str, list[str]]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    fields: list[str] = []
    for md in err.trailing_metadata() or ():
        if md.key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(md.value)
            for detail in status.details:
                if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad = error_details_pb2.BadRequest()
                    detail.Unpack(bad)
                    fields += [v.field for v in bad.field_violations]
    return err.code(), err.details() or "", fields


def _metric(server: ServerProcess, name: str, adapter: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("adapter") == adapter:
                return float(sample.value)
    return 0.0


def test_outputs_equal_peft_merged_and_the_adapter_is_listed(server: ServerProcess, tiny_llama_dir: Path,
                                                             adapters: dict[str, Path]) -> None:
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=10)
    assert [a.adapter_id for a in info.adapters] == ["a"] and info.max_loras == 2 and info.max_lora_rank == 8
    assert list(info.adapters[0].target_modules) == ["down_proj", "q_proj", "v_proj"] and info.adapters[0].rank == 8
    lora = [p for p in info.plugins if p.kind == "lora"]
    assert [(p.name, dict(p.settings)) for p in lora] == [("torch", {"max_loras": "2", "max_lora_rank": "8"})]
    expected_a = greedy_tokens(merged_model(tiny_llama_dir, adapters["a"]), PROMPT, NEW)
    expected_base = greedy_tokens(merged_model(tiny_llama_dir, None), PROMPT, NEW)
    assert expected_a != expected_base
    before = _metric(server, "loom_adapter_requests_total", "a")
    assert _generate(server, "a") == expected_a
    assert _generate(server, "") == expected_base
    assert _metric(server, "loom_adapter_requests_total", "a") == before + 1


def test_unknown_adapter_is_not_found_naming_it(server: ServerProcess) -> None:
    code, message, _ = _error(lambda: _generate(server, "nosuch"))
    assert code is grpc.StatusCode.NOT_FOUND and "'nosuch'" in message
    code, _, fields = _error(lambda: _generate(server, "bad name!"))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and fields == ["adapter_id"]


def test_adapter_rpcs_need_the_api_key(server: ServerProcess, adapters: dict[str, Path]) -> None:
    for call in (lambda: server.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10),
                 lambda: server.stub.LoadAdapter(pb.LoadAdapterRequest(adapter_id="x", path=str(adapters["b"])),
                                                 timeout=10),
                 lambda: server.stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id="a"), timeout=10)):
        assert _error(call)[0] is grpc.StatusCode.UNAUTHENTICATED


def test_load_and_unload_while_requests_run(server: ServerProcess, tiny_llama_dir: Path,
                                            adapters: dict[str, Path], tmp_path: Path) -> None:
    stub = server.stub
    long_params = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=600, ignore_eos=True),
                                response=pb.ResponseParameters(tokens=True))
    stream = stub.GenerateStream(pb.GenerateStreamRequest(token_ids=pb.TokenIds(ids=PROMPT), parameters=long_params,
                                                          adapter_id="a"), metadata=AUTH, timeout=300)
    received: list[int] = []
    first = threading.Event()

    def drain() -> None:
        for msg in stream:
            received.extend(t.id for t in msg.tokens)
            first.set()

    reader = threading.Thread(target=drain)
    reader.start()
    assert first.wait(60)
    # While "a" streams: unloading it is refused, loading "b" works, and "b" serves at once.
    code, message, _ = _error(lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id="a"), metadata=AUTH,
                                                         timeout=30))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "in use" in message
    loaded = stub.LoadAdapter(pb.LoadAdapterRequest(adapter_id="b", path=str(adapters["b"])), metadata=AUTH,
                              timeout=60)
    assert loaded.adapter.rank == 4 and loaded.adapter.use_rslora
    assert _generate(server, "b") == greedy_tokens(merged_model(tiny_llama_dir, adapters["b"]), PROMPT, NEW)
    listed = stub.ListAdapters(pb.ListAdaptersRequest(), metadata=AUTH, timeout=10)
    assert [a.adapter_id for a in listed.adapters] == ["a", "b"]
    # Both slots taken: a third adapter is refused before its files are read; the stream goes on.
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text('{"r": 8,')
    code, message, fields = _error(lambda: stub.LoadAdapter(
        pb.LoadAdapterRequest(adapter_id="c", path=str(tmp_path / "bad")), metadata=AUTH, timeout=30))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-loras" in message
    code, _, _ = _error(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(adapter_id="a", path=str(adapters["b"])),
                                                 metadata=AUTH, timeout=30))
    assert code is grpc.StatusCode.ALREADY_EXISTS
    reader.join(300)
    assert len(received) == 600
    # The stream over, "a" unloads; then it is NOT_FOUND, and a bad adapter names its field.
    unloaded = stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id="a"), metadata=AUTH, timeout=30)
    assert unloaded.adapter.adapter_id == "a"
    assert _error(lambda: _generate(server, "a"))[0] is grpc.StatusCode.NOT_FOUND
    code, message, fields = _error(lambda: stub.LoadAdapter(
        pb.LoadAdapterRequest(adapter_id="c", path=str(tmp_path / "bad")), metadata=AUTH, timeout=30))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and fields == ["adapter_config.json"] and "JSON" in message
    code, message, fields = _error(lambda: stub.LoadAdapter(
        pb.LoadAdapterRequest(adapter_id="c", path=str(tmp_path / "none")), metadata=AUTH, timeout=30))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and fields == ["path"]
    assert _error(lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id="a"), metadata=AUTH,
                                             timeout=30))[0] is grpc.StatusCode.NOT_FOUND
    assert _generate(server, "") == greedy_tokens(merged_model(tiny_llama_dir, None), PROMPT, NEW)  # still serving


def test_python_client_names_the_adapter(server: ServerProcess, tiny_llama_dir: Path,
                                         adapters: dict[str, Path]) -> None:
    from loom_client import LoomClient

    expected = greedy_tokens(merged_model(tiny_llama_dir, adapters["b"]), PROMPT, 4)
    with LoomClient(server.address, api_key=KEY, timeout=60) as client:
        if "b" not in [a.adapter_id for a in client.list_adapters().adapters]:
            assert client.load_adapter("b", str(adapters["b"])).adapter_id == "b"
        reply = client.generate(token_ids=PROMPT, adapter_id="b", max_new_tokens=4, ignore_eos=True, tokens=True)
        assert [t.id for t in reply.completions[0].tokens] == expected
        streamed = [t.id for m in client.stream(token_ids=PROMPT, adapter_id="b", max_new_tokens=4, ignore_eos=True,
                                                tokens=True) for t in m.tokens]
        assert streamed == expected
        assert client.unload_adapter("b").adapter_id == "b"
        assert "b" not in [a.adapter_id for a in client.list_adapters().adapters]
