"""API keys, TLS, mutual TLS and size limits against the real server, with certificates made here.

Two servers: one with TLS, an API key and small size limits; one with mutual TLS.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from loom_client import LoomClient
from loom_client.cli import main as client_main
from loom_client.v1 import generation_pb2 as pb
from loom_client.v1 import generation_pb2_grpc as pb_grpc

from .pki import Pki, make_pki
from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

KEY = "loom-test-key-7f3a9c"
QUICK = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=3))
MAX_REQUEST_BYTES = 64 * 1024
MAX_INPUT_CHARS = 5000


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(tiny_llama_dir: Path, server_logs: Path, pki: Pki) -> Iterator[ServerProcess]:
    # The fixture's own channel trusts the CA but sends no key: health must still answer.
    server = start_server(tiny_llama_dir, server_logs, "tls-api-key", "--api-key", KEY,
                          "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
                          "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-input-chars", str(MAX_INPUT_CHARS),
                          "--max-batch-total-tokens", "8192",
                          credentials=grpc.ssl_channel_credentials(pki.ca.cert_pem))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mtls_server(tiny_llama_dir: Path, server_logs: Path, pki: Pki) -> Iterator[ServerProcess]:
    creds = grpc.ssl_channel_credentials(pki.ca.cert_pem, pki.client.key_pem, pki.client.cert_pem)
    server = start_server(tiny_llama_dir, server_logs, "mtls", "--tls-cert", str(pki.server.cert),
                          "--tls-key", str(pki.server.key), "--tls-client-ca", str(pki.ca.cert),
                          "--max-batch-total-tokens", "8192", credentials=creds)
    yield server
    server.stop()


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def reflection_list(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                          metadata=metadata, timeout=10)
    return [s.name for r in responses for s in r.list_services_response.service]


# -- API key (over TLS) ---------------------------------------------------------------------------
def test_health_needs_no_key(tls_server: ServerProcess) -> None:
    assert tls_server.health_status() == "SERVING"
    assert tls_server.health_status("loom.v1.GenerationService") == "SERVING"
    # The start-up probe sent no key: it was refused for that, not served.
    assert tls_server.generate_while_loading in (None, grpc.StatusCode.UNAUTHENTICATED)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong-key"),), (("authorization", KEY),),
                                      (("authorization", f"Basic {KEY}"),)],
                         ids=["no-key", "wrong-key", "no-scheme", "basic"])
def test_every_rpc_without_the_right_key_is_unauthenticated(tls_server: ServerProcess,
                                                            metadata: tuple[tuple[str, str], ...]) -> None:
    stub = tls_server.stub
    unknown: Any = tls_server.channel.unary_unary("/loom.v1.GenerationService/Nope")
    calls = {
        "Generate": lambda: stub.Generate(pb.GenerateRequest(text="Hi", parameters=QUICK), metadata=metadata, timeout=10),
        "GenerateStream": lambda: list(stub.GenerateStream(pb.GenerateStreamRequest(text="Hi", parameters=QUICK),
                                                           metadata=metadata, timeout=10)),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="Hi"), metadata=metadata, timeout=10),
        "GetModelInfo": lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10),
        "reflection": lambda: reflection_list(tls_server.channel, metadata),
        "unknown method": lambda: unknown(b"", metadata=metadata, timeout=10),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        details = info.value.details() or ""
        assert ("Bearer <key>" in details) if metadata[:1] != (("authorization", "Bearer wrong-key"),) \
            else details == "invalid API key"
        assert KEY not in details


def test_right_key_is_served(tls_server: ServerProcess, pki: Pki) -> None:
    with LoomClient(tls_server.address, api_key=KEY, root_certificates=pki.ca.cert_pem, timeout=30) as client:
        reply = client.generate("Hello", max_new_tokens=3)
        assert reply.completions[0].generated_tokens == 3
        chunks = list(client.stream("Hello", max_new_tokens=3))
        assert "".join(c.text for c in chunks) == reply.completions[0].text
        assert client.tokenize("Hello").token_count > 0
        services = reflection_list(client.channel, (("authorization", f"Bearer {KEY}"),))
        assert "loom.v1.GenerationService" in services


def test_plaintext_or_untrusting_client_cannot_reach_a_tls_port(tls_server: ServerProcess, pki: Pki) -> None:
    meta = (("authorization", f"Bearer {KEY}"),)
    request = pb.GetModelInfoRequest()
    with grpc.insecure_channel(tls_server.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        assert code_of(lambda: stub.GetModelInfo(request, metadata=meta, timeout=5)) == grpc.StatusCode.UNAVAILABLE
    # Trusting another CA: the server's certificate does not verify.
    with grpc.secure_channel(tls_server.address, grpc.ssl_channel_credentials(pki.rogue_client.cert_pem)) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        assert code_of(lambda: stub.GetModelInfo(request, metadata=meta, timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_size_limits(tls_server: ServerProcess, pki: Pki) -> None:
    with LoomClient(tls_server.address, api_key=KEY, root_certificates=pki.ca.cert_pem, timeout=30) as client:
        # Over --max-request-bytes: gRPC refuses the message before it is parsed.
        with pytest.raises(grpc.RpcError) as info:
            client.generate("x" * (MAX_REQUEST_BYTES + 1), max_new_tokens=1)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Under it but over --max-input-chars: a field violation, before any tokenizing.
        for call in (lambda: client.generate("y" * (MAX_INPUT_CHARS + 1), max_new_tokens=1),
                     lambda: client.tokenize("y" * (MAX_INPUT_CHARS + 1)),
                     lambda: client.generate(messages=[("user", "z" * (MAX_INPUT_CHARS + 1))], max_new_tokens=1)):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--max-input-chars" in (info.value.details() or "")
        assert client.generate("y" * 500, max_new_tokens=1).completions[0].generated_tokens == 1


# -- mutual TLS ------------------------------------------------------------------------------------
def test_mtls_client_with_a_certificate_is_served(mtls_server: ServerProcess, pki: Pki) -> None:
    assert mtls_server.health_status() == "SERVING"
    with LoomClient(mtls_server.address, root_certificates=pki.ca.cert_pem, certificate_chain=pki.client.cert_pem,
                    private_key=pki.client.key_pem, timeout=30) as client:
        assert client.generate("Hello", max_new_tokens=2).completions[0].generated_tokens == 2


@pytest.mark.parametrize("who", ["no-certificate", "rogue-certificate", "plaintext"])
def test_mtls_refuses_clients_without_a_trusted_certificate(mtls_server: ServerProcess, pki: Pki, who: str) -> None:
    if who == "plaintext":
        channel = grpc.insecure_channel(mtls_server.address)
    elif who == "no-certificate":
        channel = grpc.secure_channel(mtls_server.address, grpc.ssl_channel_credentials(pki.ca.cert_pem))
    else:
        channel = grpc.secure_channel(mtls_server.address, grpc.ssl_channel_credentials(
            pki.ca.cert_pem, pki.rogue_client.key_pem, pki.rogue_client.cert_pem))
    with channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        assert code_of(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_cli_speaks_mtls_and_api_key(mtls_server: ServerProcess, tls_server: ServerProcess, pki: Pki) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = client_main(["--target", mtls_server.address, "--tls-ca", str(pki.ca.cert), "--tls-cert",
                        str(pki.client.cert), "--tls-key", str(pki.client.key), "info"], out=out, err=err)
    assert code == 0, err.getvalue()
    assert "max_total_tokens" in out.getvalue()
    out, err = io.StringIO(), io.StringIO()
    args = ["--target", tls_server.address, "--tls-ca", str(pki.ca.cert), "--api-key", KEY,
            "generate", "Hello", "--max-new-tokens", "2"]
    assert client_main(args, out=out, err=err) == 0, err.getvalue()
    assert client_main(args[:4] + args[6:], out=out, err=err) == 1
    assert "UNAUTHENTICATED" in err.getvalue()


def test_buf_curl_with_an_api_key_needs_the_reflect_header_too(tls_server: ServerProcess, pki: Pki) -> None:
    """What the README says: reflection is behind the key, and buf curl sends -H headers only with
    the call itself, so --reflect-header must carry the key as well."""
    import shutil
    import subprocess
    import sys

    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    if not Path(buf).exists():
        pytest.skip("buf (PyPI buf-bin) is not installed")
    header = f"authorization: Bearer {KEY}"
    base = [buf, "curl", "--protocol", "grpc", "--cacert", str(pki.ca.cert), "-H", header,
            "-d", "{}", f"https://{tls_server.address}/loom.v1.GenerationService/GetModelInfo"]
    only_h = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert only_h.returncode != 0
    both = subprocess.run([*base, "--reflect-header", header], capture_output=True, text=True, timeout=60)
    assert both.returncode == 0, both.stderr
    assert '"modelId"' in both.stdout
