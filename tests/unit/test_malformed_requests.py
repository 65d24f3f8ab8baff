"""Requests whose bytes do not parse, Health/List and reflection v1, against Loom's own grpc.aio
server built in-process (LoomServer: its interceptors, services and reflection, no model loaded).

Raw bytes go through a real channel with identity serializers: garbage, a truncated message and a
string field holding invalid UTF-8, to every RPC. Each must end INVALID_ARGUMENT with Loom's message
(which RPC, that the message could not be parsed, the parser's reason) and be counted in the
per-RPC metrics; never UNKNOWN with a Python class name. Well-formed requests still reach the
servicer (UNAVAILABLE here: no model is loaded).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status

from loom.server.app import LoomServer
from loom.server.settings import ServerSettings
from loom_client.v1 import generation_pb2 as pb

SERVICE = "/loom.v1.GenerationService/"
KEY = "test-key"

# Field 2 of GenerateRequest / GenerateStreamRequest and field 1 of TokenizeRequest are `text`.
BAD_UTF8_TEXT = {"Generate": b"\x12\x02\xc3\x28", "GenerateStream": b"\x12\x02\xc3\x28", "Tokenize": b"\x0a\x02\xc3\x28"}
# Valid messages cut short: the declared length runs past the end.
TRUNCATED = {"Generate": pb.GenerateRequest(text="hello there").SerializeToString()[:-3],
             "GenerateStream": pb.GenerateStreamRequest(text="hello there").SerializeToString()[:-3],
             "Tokenize": pb.TokenizeRequest(text="hello there").SerializeToString()[:-3],
             "GetModelInfo": b"\x0a\x05ab"}  # an unknown length-delimited field with 2 of its 5 bytes
GARBAGE = b"\xff\xff\xff\xff"
STREAMING = {"GenerateStream"}
CASES = [(rpc, name, body) for rpc in ("Generate", "GenerateStream", "Tokenize", "GetModelInfo")
         for name, body in (("garbage", GARBAGE), ("truncated", TRUNCATED[rpc]), ("bad-utf8", BAD_UTF8_TEXT.get(rpc)))
         if body is not None]
REASONS = {"garbage": "wire format was corrupt", "truncated": "wire format was corrupt",
           "bad-utf8": "string field had bad UTF-8"}
REQUEST_TYPES = {"Generate": "loom.v1.GenerateRequest", "GenerateStream": "loom.v1.GenerateStreamRequest",
                 "Tokenize": "loom.v1.TokenizeRequest", "GetModelInfo": "loom.v1.GetModelInfoRequest"}
VALID = {"Generate": pb.GenerateRequest(text="hi"), "GenerateStream": pb.GenerateStreamRequest(text="hi"),
         "Tokenize": pb.TokenizeRequest(text="hi"), "GetModelInfo": pb.GetModelInfoRequest()}


def rpc_counts(server: LoomServer) -> dict[tuple[str, str], float]:
    return {(s.labels["method"], s.labels["code"]): s.value for f in server.metrics.registry.collect()
            for s in f.samples if s.name == "loom_grpc_requests_total"}


async def settled_counts(server: LoomServer, calls: int, timeout_s: float = 10.0) -> dict[tuple[str, str], float]:
    """``rpc_counts`` once it holds ``calls`` calls: the server counts a call when its handler
    returns, which can be after the client has read the call's status."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    counts = rpc_counts(server)
    while sum(counts.values()) < calls and loop.time() < deadline:
        await asyncio.sleep(0.01)
        counts = rpc_counts(server)
    return counts


async def started(api_key: str | None = None) -> tuple[LoomServer, grpc.aio.Channel]:
    """Loom's server with its services and interceptors, serving without a model (not run())."""
    server = LoomServer(ServerSettings(host="127.0.0.1", port=0, prometheus_port=0, api_key=api_key))
    server.port = server.server.add_insecure_port("127.0.0.1:0")
    await server.server.start()
    await server.health.serving()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")


async def call_raw(channel: grpc.aio.Channel, method: str, body: bytes, streaming: bool,
                   metadata: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError | None:
    """The error the call ends with (None if it succeeds); identity serializers both ways."""
    try:
        if streaming:
            call = channel.unary_stream(method)(body, timeout=10, metadata=metadata)
            async for _ in call:
                pass
        else:
            await channel.unary_unary(method)(body, timeout=10, metadata=metadata)
    except grpc.aio.AioRpcError as err:
        return err
    return None


def run(main: Callable[[], Any]) -> Any:
    return asyncio.run(main())


def error_info_reason(err: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no rich status"
    info = error_details_pb2.ErrorInfo()
    found = [d for d in status.details if d.Unpack(info)]
    assert found, status
    return info.reason


def test_malformed_requests_get_invalid_argument_and_are_counted() -> None:
    async def main() -> tuple[list[tuple[str, str, grpc.aio.AioRpcError | None]], dict[tuple[str, str], float]]:
        server, channel = await started()
        try:
            results = [(rpc, name, await call_raw(channel, SERVICE + rpc, body, rpc in STREAMING))
                       for rpc, name, body in CASES]
            # Well-formed requests still reach the servicer: UNAVAILABLE, no model loaded.
            for rpc, request in VALID.items():
                err = await call_raw(channel, SERVICE + rpc, request.SerializeToString(), rpc in STREAMING)
                assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, rpc
            return results, await settled_counts(server, len(CASES) + len(VALID))
        finally:
            await channel.close()
            await server.server.stop(0)

    results, counts = run(main)
    for rpc, name, err in results:
        assert err is not None, (rpc, name)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, name, err.code(), err.details())
        details = err.details() or ""
        assert details == (f"loom.v1.GenerationService/{rpc}: the request message could not be parsed as a "
                           f"{REQUEST_TYPES[rpc]}: {REASONS[name]}"), details
        assert "class" not in details and "DecodeError" not in details
        assert error_info_reason(err) == "MALFORMED_REQUEST"
    for rpc in REQUEST_TYPES:
        sent = sum(1 for r, _, _ in CASES if r == rpc)
        assert counts.get((SERVICE + rpc, "INVALID_ARGUMENT")) == sent, counts
        assert counts.get((SERVICE + rpc, "UNAVAILABLE")) == 1, counts
    assert not [k for k in counts if k[1] == "UNKNOWN"], counts


def test_authentication_comes_before_parsing() -> None:
    async def main() -> tuple[grpc.aio.AioRpcError | None, grpc.aio.AioRpcError | None]:
        server, channel = await started(api_key=KEY)
        try:
            anonymous = await call_raw(channel, SERVICE + "Generate", GARBAGE, False)
            keyed = await call_raw(channel, SERVICE + "Generate", GARBAGE, False, (("authorization", f"Bearer {KEY}"),))
            return anonymous, keyed
        finally:
            await channel.close()
            await server.server.stop(0)

    anonymous, keyed = run(main)
    assert anonymous is not None and anonymous.code() == grpc.StatusCode.UNAUTHENTICATED
    assert keyed is not None and keyed.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_list_and_malformed_health_and_reflection_requests() -> None:
    async def main() -> tuple[health_pb2.HealthListResponse, list[grpc.aio.AioRpcError | None]]:
        server, channel = await started()
        try:
            listed = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
            errors = [await call_raw(channel, "/grpc.health.v1.Health/Check", GARBAGE, False)]
            for version in ("v1", "v1alpha"):
                call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo")(
                    iter([GARBAGE]), timeout=10)
                try:
                    [m async for m in call]
                    errors.append(None)
                except grpc.aio.AioRpcError as err:
                    errors.append(err)
            await server.health.draining()
            drained = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
            assert {name: s.status for name, s in drained.statuses.items()} == {
                "": health_pb2.HealthCheckResponse.NOT_SERVING,
                "loom.v1.GenerationService": health_pb2.HealthCheckResponse.NOT_SERVING}
            return listed, errors
        finally:
            await channel.close()
            await server.server.stop(0)

    listed, errors = run(main)
    assert {name: s.status for name, s in listed.statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING, "loom.v1.GenerationService": health_pb2.HealthCheckResponse.SERVING}
    for err in errors:
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert "could not be parsed" in (err.details() or "")


async def _reflect(channel: grpc.aio.Channel, version: str,
                   requests: list[reflection_pb2.ServerReflectionRequest]) -> list[reflection_pb2.ServerReflectionResponse]:
    # v1 and v1alpha are the same messages under two package names: one encoding serves both.
    call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                 request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    return [m async for m in call(iter(requests), timeout=10)]


def test_reflection_v1_and_v1alpha() -> None:
    async def main() -> dict[str, list[reflection_pb2.ServerReflectionResponse]]:
        server, channel = await started()
        try:
            asked = [reflection_pb2.ServerReflectionRequest(list_services=""),
                     reflection_pb2.ServerReflectionRequest(file_containing_symbol="loom.v1.GenerationService"),
                     reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection")]
            return {version: await _reflect(channel, version, asked) for version in ("v1", "v1alpha")}
        finally:
            await channel.close()
            await server.server.stop(0)

    answers = run(main)
    for version, (services, loom_file, reflection_file) in answers.items():
        assert {s.name for s in services.list_services_response.service} == {
            "loom.v1.GenerationService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"}, version
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in loom_file.file_descriptor_response.file_descriptor_proto]
        assert files[0].package == "loom.v1" and files[0].service[0].name == "GenerationService"
        v1 = descriptor_pb2.FileDescriptorProto.FromString(reflection_file.file_descriptor_response.file_descriptor_proto[0])
        assert (v1.name, v1.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
        method = v1.service[0].method[0]
        assert (method.name, method.input_type, method.output_type) == (
            "ServerReflectionInfo", ".grpc.reflection.v1.ServerReflectionRequest",
            ".grpc.reflection.v1.ServerReflectionResponse")
        assert not v1.options.deprecated


def _buf() -> str:
    beside_python = Path(sys.executable).parent / "buf"
    found = str(beside_python) if beside_python.is_file() else shutil.which("buf")
    if found is None:
        pytest.fail("the buf binary is missing: pip install buf-bin (part of the test extras)")
    return found


@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
def test_buf_curl_reflects_with_each_protocol(protocol: str) -> None:
    """buf curl, an independent reflection client, made to use one protocol only."""
    async def buf(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(_buf(), "curl", "--protocol", "grpc", "--http2-prior-knowledge",
                                                    "--reflect-protocol", protocol, *args,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def main() -> tuple[tuple[int, str, str], tuple[int, str, str]]:
        server, channel = await started()
        await channel.close()
        url = f"http://127.0.0.1:{server.port}"
        try:
            listed = await buf("--list-methods", url)
            health = await buf("-d", "{}", f"{url}/grpc.health.v1.Health/List")
            return listed, health
        finally:
            await server.server.stop(0)

    (code, out, err), (health_code, health_out, health_err) = run(main)
    assert code == 0, err
    # every method of the service as the proto declares it (generation, Tokenize, GetModelInfo, adapters)
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    assert {line for line in out.split() if line.startswith("loom.")} == {
        f"loom.v1.GenerationService/{m.name}" for m in service.methods}
    assert {"Generate", "GenerateStream", "Tokenize", "GetModelInfo", "LoadAdapter"} <= {m.name for m in service.methods}
    assert "grpc.health.v1.Health/List" in out
    assert health_code == 0, health_err
    assert json.loads(health_out)["statuses"]["loom.v1.GenerationService"]["status"] == "SERVING"
