"""The API contract: buf lint passes, and the checked-in stubs are what the protos generate."""

from __future__ import annotations

import filecmp
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTOS = REPO_ROOT / "protos"
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"
STUBS = REPO_ROOT / "clients" / "python" / "src" / "loom_client" / "v1"
GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py", "generation_pb2_grpc.pyi")


def _buf() -> str:
    beside_python = Path(sys.executable).parent / "buf"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("buf")
    if found is None:
        pytest.fail("the buf binary is missing: pip install buf-bin (part of the test extras)")
    return found


def test_buf_lint_passes() -> None:
    proc = subprocess.run(
        [_buf(), "lint"], cwd=PROTOS, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"buf lint failed:\n{proc.stdout}{proc.stderr}"


def test_checked_in_stubs_match_the_protos(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip(
            "grpc_tools is not importable: pip install grpcio-tools==1.84.0 to check the generated stubs"
        )
    proc = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"gen_protos.py failed:\n{proc.stdout}{proc.stderr}"
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == sorted(GENERATED)
    checked_in = sorted(p.name for p in STUBS.iterdir() if "_pb2" in p.name)
    assert checked_in == sorted(GENERATED), "unexpected generated files are checked in"
    stale = [name for name in GENERATED if not filecmp.cmp(tmp_path / name, STUBS / name, shallow=False)]
    assert not stale, f"stale stubs {stale}: run `python scripts/gen_protos.py` and commit the result"


@pytest.mark.parametrize("name", GENERATED)
def test_stubs_never_import_the_loom_package(name: str) -> None:
    source = (STUBS / name).read_text(encoding="utf-8")
    assert not re.search(r"^\s*(from|import)\s+loom(\.|\s|$)", source, re.MULTILINE)


def test_service_has_exactly_the_contracted_rpcs() -> None:
    from loom_client.v1 import generation_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    assert service.full_name == "loom.v1.GenerationService"
    rpcs = {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods}
    assert rpcs == {
        "Generate": ("GenerateRequest", "GenerateResponse", False),
        "GenerateStream": ("GenerateStreamRequest", "GenerateStreamResponse", True),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False),
        "LoadAdapter": ("LoadAdapterRequest", "LoadAdapterResponse", False),
        "UnloadAdapter": ("UnloadAdapterRequest", "UnloadAdapterResponse", False),
        "ListAdapters": ("ListAdaptersRequest", "ListAdaptersResponse", False),
        "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False),
    }
    assert not any(m.client_streaming for m in service.methods)


def test_both_generate_requests_share_one_layout() -> None:
    from loom_client.v1 import generation_pb2 as pb

    def layout(message: type) -> list[tuple[str, int, int]]:
        return [(f.name, f.number, f.type) for f in message.DESCRIPTOR.fields]  # type: ignore[attr-defined]

    assert layout(pb.GenerateRequest) == layout(pb.GenerateStreamRequest)
    assert [f.name for f in pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"].fields] == [
        "text",
        "token_ids",
        "chat",
    ]


def test_finish_reasons() -> None:
    from loom_client.v1 import generation_pb2 as pb

    assert list(pb.FinishReason.keys()) == [
        "FINISH_REASON_UNSPECIFIED",
        "FINISH_REASON_LENGTH",
        "FINISH_REASON_EOS_TOKEN",
        "FINISH_REASON_STOP_SEQUENCE",
        "FINISH_REASON_TIME_LIMIT",
    ]


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        ("SamplingParameters", {"temperature", "top_k", "top_p", "typical_p", "min_p", "seed"}),
        ("StoppingParameters", {"max_new_tokens", "time_limit_ms"}),
        ("PenaltyParameters", {"repetition_penalty", "frequency_penalty", "presence_penalty"}),
        ("Parameters", {"truncate_input_tokens", "n", "best_of", "speculation"}),
    ],
)
def test_fields_whose_unset_differs_from_zero_have_presence(message: str, fields: set[str]) -> None:
    from loom_client.v1 import generation_pb2 as pb

    descriptor = pb.DESCRIPTOR.message_types_by_name[message]
    with_presence = {f.name for f in descriptor.fields if f.has_presence and f.message_type is None}
    assert with_presence == fields
