"""The loom-client distribution: torch-free, parameters with field presence, and the sync, async
and command-line clients against an in-process fake server on the loopback interface."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import pytest

from loom_client import AsyncLoomClient, ChatMessageLike, LoomClient, build_parameters
from loom_client import cli as loom_cli
from loom_client.parameters import PARAMETER_FIELDS, ParameterOptions
from loom_client.v1 import generation_pb2 as pb
from loom_client.v1 import generation_pb2_grpc as pb_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENT_ROOT = REPO_ROOT / "clients" / "python"
ALLOWED_DEPENDENCIES = {"grpcio", "protobuf"}


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match is not None, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


# --- the distribution -----------------------------------------------------------------------------


def test_source_pyproject_depends_only_on_grpcio_and_protobuf() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((CLIENT_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["name"] == "loom-client"
    assert project["version"] == "0.1.0"
    assert {_requirement_name(r) for r in project["dependencies"]} == ALLOWED_DEPENDENCIES
    assert not project.get("optional-dependencies")
    assert project["scripts"] == {"loom-client": "loom_client.cli:main"}


def test_installed_distribution_does_not_require_torch() -> None:
    try:
        requires = metadata.requires("loom-client") or []
    except metadata.PackageNotFoundError:
        pytest.skip("loom-client is not installed: pip install -e clients/python")
    names = {_requirement_name(r) for r in requires}
    assert "torch" not in names
    assert "transformers" not in names
    assert names == ALLOWED_DEPENDENCIES
    assert metadata.version("loom-client") == "0.1.0"


def test_importing_the_client_imports_neither_torch_nor_the_server(tmp_path: Path) -> None:
    code = (
        "import loom_client, loom_client.client, loom_client.aio, loom_client.cli, sys; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'transformers' not in sys.modules, 'transformers imported'; "
        "assert 'loom' not in sys.modules, 'the server package loom imported'"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CLIENT_ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_package_ships_its_typing_marker_and_stub_files() -> None:
    package = CLIENT_ROOT / "src" / "loom_client"
    assert (package / "py.typed").is_file()
    assert (package / "v1" / "generation_pb2.pyi").is_file()
    assert (package / "v1" / "generation_pb2_grpc.pyi").is_file()


# --- parameters -----------------------------------------------------------------------------------


def test_no_options_give_an_empty_message() -> None:
    params = build_parameters()
    assert params.ListFields() == []
    for group in ("sampling", "stopping", "penalties", "response"):
        assert not params.HasField(group)


def test_optional_fields_are_present_only_when_passed() -> None:
    params = build_parameters(max_new_tokens=32, temperature=0.0, seed=0)
    assert params.HasField("stopping") and params.HasField("sampling")
    assert params.stopping.HasField("max_new_tokens") and params.stopping.max_new_tokens == 32
    # zero is a value, not "unset"
    assert params.sampling.HasField("temperature") and params.sampling.temperature == 0.0
    assert params.sampling.HasField("seed") and params.sampling.seed == 0
    for name in ("top_k", "top_p", "typical_p", "min_p"):
        assert not params.sampling.HasField(name)
    assert not params.stopping.HasField("time_limit_ms")
    assert not params.HasField("penalties")
    assert not params.HasField("response")
    for name in ("n", "best_of", "truncate_input_tokens"):
        assert not params.HasField(name)  # type: ignore[arg-type]


def test_none_means_unset() -> None:
    params = build_parameters(temperature=None, n=None, stop_sequences=None, logprobs=None)
    assert params.ListFields() == []
    params = build_parameters(n=1, repetition_penalty=1.0)
    assert params.HasField("n") and params.n == 1
    assert params.penalties.HasField("repetition_penalty")
    assert not params.penalties.HasField("frequency_penalty")


def test_every_group_is_reached() -> None:
    params = build_parameters(
        do_sample=True,
        top_k=5,
        stop_sequences=["\n\n", "END"],
        stop_token_ids=[2],
        ignore_eos=True,
        presence_penalty=-0.5,
        logprobs=True,
        top_n_tokens=3,
        best_of=2,
        priority=-1,
    )
    assert params.sampling.do_sample and params.sampling.top_k == 5
    assert list(params.stopping.stop_sequences) == ["\n\n", "END"]
    assert list(params.stopping.stop_token_ids) == [2]
    assert params.stopping.ignore_eos
    assert params.penalties.presence_penalty == pytest.approx(-0.5)
    assert params.response.logprobs and params.response.top_n_tokens == 3
    assert params.best_of == 2 and params.priority == -1


def test_a_single_stop_string_is_one_sequence_and_empty_lists_add_nothing() -> None:
    assert list(build_parameters(stop_sequences="\n").stopping.stop_sequences) == ["\n"]
    assert not build_parameters(stop_sequences=[], stop_token_ids=[]).HasField("stopping")


def test_options_override_a_base_without_mutating_it() -> None:
    base = build_parameters(top_k=5, stop_sequences=["a"], max_new_tokens=10)
    params = build_parameters(base, temperature=0.5, stop_sequences=["b"])
    assert params.sampling.top_k == 5 and params.sampling.temperature == pytest.approx(0.5)
    assert list(params.stopping.stop_sequences) == ["b"]
    assert params.stopping.max_new_tokens == 10
    assert not base.sampling.HasField("temperature")
    assert list(base.stopping.stop_sequences) == ["a"]


def test_bad_options_are_rejected() -> None:
    with pytest.raises(TypeError, match="unknown generation parameter 'max_tokens'"):
        build_parameters(max_tokens=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="takes a number"):
        build_parameters(max_new_tokens=True)
    with pytest.raises(ValueError):
        build_parameters(max_new_tokens=-1)


def test_options_cover_every_parameter_field() -> None:
    covered: set[tuple[str | None, str]] = set(PARAMETER_FIELDS.values())
    expected: set[tuple[str | None, str]] = set()
    for field in pb.Parameters.DESCRIPTOR.fields:
        if field.message_type is None:
            expected.add((None, field.name))
        else:
            expected |= {(field.name, sub.name) for sub in field.message_type.fields}
    assert covered == expected
    assert all(name == field for name, (_, field) in PARAMETER_FIELDS.items())
    assert set(ParameterOptions.__annotations__) == set(PARAMETER_FIELDS)


# --- a fake server --------------------------------------------------------------------------------


class FakeGeneration(pb_grpc.GenerationServiceServicer):
    """Echoes requests back; "fail" as text aborts with INVALID_ARGUMENT."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.metadata: list[dict[str, str | bytes]] = []
        self.stream_cancelled = threading.Event()

    def _record(self, request: Any, context: grpc.ServicerContext) -> None:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        has_input = any(o.name == "input" for o in request.DESCRIPTOR.oneofs)
        if has_input and request.WhichOneof("input") == "text" and request.text == "fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text must not be 'fail'")

    @staticmethod
    def _prompt(request: Any) -> str:
        which = request.WhichOneof("input")
        if which == "text":
            return str(request.text)
        if which == "token_ids":
            return ",".join(str(i) for i in request.token_ids.ids)
        return "|".join(f"{m.role}:{m.content}" for m in request.chat.messages)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        self._record(request, context)
        n = request.parameters.n if request.parameters.HasField("n") else 1
        completions = [
            pb.Completion(
                index=i,
                text=f"echo[{i}]:{self._prompt(request)}",
                finish_reason=pb.FINISH_REASON_LENGTH,
                generated_tokens=3,
                seed=7 + i,
            )
            for i in range(n)
        ]
        return pb.GenerateResponse(
            request_id=request.request_id or "srv-1",
            completions=completions,
            usage=pb.Usage(prompt_tokens=4, generated_tokens=3 * n),
        )

    def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        self._record(request, context)
        context.add_callback(self.stream_cancelled.set)
        if request.text == "forever":
            while context.is_active():
                yield pb.GenerateStreamResponse(request_id="srv-2", text="x")
                time.sleep(0.01)
            return
        words = ["Hello", ",", " world"]
        for i, word in enumerate(words):
            last = i == len(words) - 1
            yield pb.GenerateStreamResponse(
                request_id=request.request_id or "srv-2",
                text=word,
                tokens=[pb.Token(id=100 + i, text=word)],
                finish_reason=pb.FINISH_REASON_EOS_TOKEN if last else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=4, generated_tokens=3) if last else None,
            )

    def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext) -> pb.ListAdaptersResponse:
        self._record(request, context)
        return pb.ListAdaptersResponse(max_loras=4, max_lora_rank=16, adapters=[pb.Adapter(
            adapter_id="sql", path="/m/sql", rank=8, alpha=16, target_modules=["q_proj", "v_proj"])])

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        self._record(request, context)
        words = request.text.split()
        return pb.TokenizeResponse(
            tokens=[
                pb.TokenizedToken(
                    id=i,
                    text=w,
                    offset=pb.TextOffset(start=0, end=len(w)) if request.return_offsets else None,
                )
                for i, w in enumerate(words)
            ],
            token_count=len(words),
        )

    def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetModelInfoResponse:
        self._record(request, context)
        return pb.GetModelInfoResponse(
            model_id="fake/model",
            architecture="LlamaForCausalLM",
            dtype="float32",
            device="cpu",
            limits=pb.ModelLimits(max_input_tokens=1023, max_total_tokens=1024, default_max_new_tokens=20),
            block_size=16,
            plugins=[
                pb.PluginInUse(kind="attention", name="sdpa", distribution="loom-server", version="0.1.0")
            ],
            server_version="0.1.0",
            eos_token_ids=[2],
            vocab_size=49152,
        )


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeGeneration]]:
    servicer = FakeGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


# --- the sync client ------------------------------------------------------------------------------


def test_generate_sends_text_parameters_and_metadata(fake_server: tuple[str, FakeGeneration]) -> None:
    target, servicer = fake_server
    with LoomClient(target, timeout=10, metadata=[("x-tenant", "a")]) as client:
        reply = client.generate("hi", max_new_tokens=5, temperature=0.0, metadata=[("x-extra", "b")])
    assert reply.completions[0].text == "echo[0]:hi"
    assert reply.request_id == "srv-1"
    sent = servicer.requests[-1]
    assert isinstance(sent, pb.GenerateRequest)
    assert sent.parameters.stopping.max_new_tokens == 5
    assert sent.parameters.sampling.HasField("temperature")
    assert not sent.parameters.HasField("penalties")
    assert servicer.metadata[-1]["x-tenant"] == "a" and servicer.metadata[-1]["x-extra"] == "b"


def test_generate_inputs(fake_server: tuple[str, FakeGeneration]) -> None:
    target, servicer = fake_server
    with LoomClient(target, timeout=10) as client:
        assert client.generate(token_ids=[1, 2, 3], request_id="r1").request_id == "r1"
        sent = servicer.requests[-1]
        assert sent.WhichOneof("input") == "token_ids" and not sent.HasField("parameters")
        chat: list[ChatMessageLike] = [
            {"role": "system", "content": "be brief"},
            ("user", "hi"),
            pb.ChatMessage(role="assistant", content="yo"),
        ]
        reply = client.generate(messages=chat, add_generation_prompt=False)
        assert reply.completions[0].text == "echo[0]:system:be brief|user:hi|assistant:yo"
        assert servicer.requests[-1].chat.HasField("add_generation_prompt")
        assert not servicer.requests[-1].chat.add_generation_prompt
        with pytest.raises(ValueError, match="exactly one"):
            client.generate("a", token_ids=[1])
        with pytest.raises(ValueError, match="exactly one"):
            client.generate()
        with pytest.raises(ValueError, match="'role' and 'content'"):
            client.generate(messages=[{"content": "no role"}])


def test_server_errors_raise_rpc_error(fake_server: tuple[str, FakeGeneration]) -> None:
    target, _ = fake_server
    with LoomClient(target, timeout=10) as client, pytest.raises(grpc.RpcError) as info:
        client.generate("fail")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_stream_tokenize_and_model_info(fake_server: tuple[str, FakeGeneration]) -> None:
    target, servicer = fake_server
    with LoomClient(target, timeout=10) as client:
        chunks = list(client.stream("hi", tokens=True))
        assert "".join(c.text for c in chunks) == "Hello, world"
        assert chunks[-1].finish_reason == pb.FINISH_REASON_EOS_TOKEN
        assert chunks[-1].usage.generated_tokens == 3
        sent = servicer.requests[-1]
        assert isinstance(sent, pb.GenerateStreamRequest) and sent.parameters.response.tokens
        tokens = client.tokenize("a bb ccc", return_offsets=True)
        assert tokens.token_count == 3 and tokens.tokens[2].offset.end == 3
        assert not servicer.requests[-1].HasField("add_special_tokens")
        info = client.model_info()
        assert info.model_id == "fake/model" and info.limits.max_total_tokens == 1024


def test_leaving_a_stream_early_cancels_it(fake_server: tuple[str, FakeGeneration]) -> None:
    target, servicer = fake_server
    servicer.stream_cancelled.clear()
    with LoomClient(target, timeout=10) as client:
        for count, _chunk in enumerate(client.stream("forever"), start=1):
            if count == 3:
                break
        assert servicer.stream_cancelled.wait(5)


# --- the asyncio client ---------------------------------------------------------------------------


def test_async_client(fake_server: tuple[str, FakeGeneration]) -> None:
    target, servicer = fake_server

    async def scenario() -> None:
        async with AsyncLoomClient(target, timeout=10, metadata=[("x-tenant", "async")]) as client:
            reply = await client.generate("hi", n=2, do_sample=True)
            assert [c.text for c in reply.completions] == ["echo[0]:hi", "echo[1]:hi"]
            assert servicer.metadata[-1]["x-tenant"] == "async"
            texts = [chunk.text async for chunk in client.stream(messages=[("user", "hi")], max_new_tokens=3)]
            assert "".join(texts) == "Hello, world"
            assert (await client.tokenize("a b")).token_count == 2
            assert (await client.model_info()).vocab_size == 49152
            with pytest.raises(ValueError, match="exactly one"):
                client.stream()
            with pytest.raises(grpc.RpcError):
                await client.generate("fail")
            servicer.stream_cancelled.clear()
            stream = client.stream("forever")
            async for _chunk in stream:
                break
            await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(scenario())
    assert servicer.stream_cancelled.wait(5)


# --- the command line -----------------------------------------------------------------------------


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = loom_cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_cli_generate(fake_server: tuple[str, FakeGeneration]) -> None:
    target, servicer = fake_server
    code, out, err = _cli("--target", target, "generate", "hi", "--max-new-tokens", "4", "--stop", "\n", "-v")
    assert (code, out) == (0, "echo[0]:hi\n")
    assert "finish=length" in err and "seed=7" in err
    params = servicer.requests[-1].parameters
    assert params.stopping.max_new_tokens == 4 and list(params.stopping.stop_sequences) == ["\n"]
    assert not params.HasField("sampling")

    code, out, _ = _cli("generate", "--target", target, "--token-ids", "1,2", "-n", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert [c["text"] for c in data["completions"]] == ["echo[0]:1,2", "echo[1]:1,2"]
    assert data["completions"][0]["finish_reason"] == "FINISH_REASON_LENGTH"

    code, out, _ = _cli("--target", target, "generate", "--chat", "--system", "sys", "hello")
    assert (code, out) == (0, "echo[0]:system:sys|user:hello\n")


def test_cli_stream_tokenize_info(fake_server: tuple[str, FakeGeneration]) -> None:
    target, _ = fake_server
    code, out, _ = _cli("--target", target, "stream", "hi", "--temperature", "0.5")
    assert (code, out) == (0, "Hello, world\n")
    code, out, _ = _cli("--target", target, "stream", "hi", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(lines) == 3 and lines[-1]["finish_reason"] == "FINISH_REASON_EOS_TOKEN"
    code, out, _ = _cli("--target", target, "tokenize", "a bb", "--offsets")
    assert code == 0 and out.splitlines() == ["0\t'a'\t0:1", "1\t'bb'\t0:2", "2 tokens"]
    code, out, _ = _cli("--target", target, "info")
    assert code == 0 and "model_id: fake/model" in out and "  max_total_tokens: 1024" in out
    assert "  attention: sdpa (loom-server 0.1.0)" in out
    code, out, _ = _cli("--target", target, "info", "--json")
    assert code == 0 and json.loads(out)["limits"]["max_best_of"] == 0


def test_cli_errors(fake_server: tuple[str, FakeGeneration]) -> None:
    target, _ = fake_server
    code, _, err = _cli("--target", target, "generate", "fail")
    assert code == 1 and "INVALID_ARGUMENT" in err
    code, _, err = _cli("--target", target, "generate")
    assert code == 2 and "give a prompt" in err
    code, _, err = _cli("--target", target, "generate", "x", "--system", "s")
    assert code == 2 and "--system needs --chat" in err
    with pytest.raises(SystemExit) as exit_info:
        _cli("generate", "x", "--max-new-tokens", "many")
    assert exit_info.value.code == 2


def test_parse_special_tokens_reaches_the_server_for_text_only(fake_server: tuple[str, FakeGeneration]) -> None:
    target, servicer = fake_server
    with LoomClient(target, timeout=10) as client:
        client.generate("<|im_start|>hi")
        assert not servicer.requests[-1].HasField("parse_special_tokens")  # unset: the server's default
        client.generate("<|im_start|>hi", parse_special_tokens=False)
        assert servicer.requests[-1].HasField("parse_special_tokens")
        assert not servicer.requests[-1].parse_special_tokens
        list(client.stream("hi", parse_special_tokens=False))
        sent = servicer.requests[-1]
        assert isinstance(sent, pb.GenerateStreamRequest) and not sent.parse_special_tokens
        assert sent.HasField("parse_special_tokens")
        client.tokenize("a b", parse_special_tokens=False)
        assert servicer.requests[-1].HasField("parse_special_tokens")
        with pytest.raises(ValueError, match="text input only"):
            client.generate(messages=[("user", "hi")], parse_special_tokens=False)
        with pytest.raises(ValueError, match="text input only"):
            client.tokenize(messages=[("user", "hi")], parse_special_tokens=True)

    async def scenario() -> None:
        async with AsyncLoomClient(target, timeout=10) as client:
            await client.generate("hi", parse_special_tokens=False)
            assert servicer.requests[-1].HasField("parse_special_tokens")
            _ = [c async for c in client.stream("hi", parse_special_tokens=False)]
            assert servicer.requests[-1].HasField("parse_special_tokens")
            await client.tokenize("hi", parse_special_tokens=False)
            assert servicer.requests[-1].HasField("parse_special_tokens")
            with pytest.raises(ValueError, match="text input only"):
                client.stream(token_ids=[1], parse_special_tokens=False)

    asyncio.run(scenario())

    for command in ("generate", "stream", "tokenize"):
        code, _, err = _cli("--target", target, command, "<|im_start|>x", "--no-parse-special-tokens")
        assert code == 0, err
        assert servicer.requests[-1].HasField("parse_special_tokens")
        assert not servicer.requests[-1].parse_special_tokens
        code, _, _ = _cli("--target", target, command, "<|im_start|>x")
        assert code == 0 and not servicer.requests[-1].HasField("parse_special_tokens")
    code, _, err = _cli("--target", target, "generate", "--chat", "x", "--no-parse-special-tokens")
    assert code == 2 and "text prompt only" in err


# --- structured output ----------------------------------------------------------------------------


def test_constraint_options_fill_the_oneof() -> None:
    params = build_parameters(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert params.constraint.WhichOneof("kind") == "json_schema"
    assert json.loads(params.constraint.json_schema) == {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert build_parameters(json_schema='{"type": "string"}').constraint.json_schema == '{"type": "string"}'
    assert build_parameters(json_object=True).constraint.WhichOneof("kind") == "json_object"
    assert not build_parameters(json_object=False).HasField("constraint")
    assert build_parameters(regex=r"\d+").constraint.regex == r"\d+"
    assert build_parameters(grammar='root ::= "a"').constraint.grammar == 'root ::= "a"'
    assert list(build_parameters(choice=["yes", "no"]).constraint.choice.choices) == ["yes", "no"]
    # a keyword option replaces the base's kind: one oneof
    base = build_parameters(regex="a+", max_new_tokens=4)
    params = build_parameters(base, choice=["b"])
    assert params.constraint.WhichOneof("kind") == "choice" and params.stopping.max_new_tokens == 4
    assert base.constraint.WhichOneof("kind") == "regex"


def test_constraint_options_are_checked() -> None:
    with pytest.raises(ValueError, match="at most one constraint; got regex, choice"):
        build_parameters(regex="a", choice=["b"])
    with pytest.raises(TypeError, match="sequence of strings"):
        build_parameters(choice="yes")
    with pytest.raises(TypeError, match="takes a bool"):
        build_parameters(json_object=1)  # type: ignore[arg-type]


def test_cli_constraints(fake_server: tuple[str, FakeGeneration], tmp_path: Path) -> None:
    target, servicer = fake_server
    schema = tmp_path / "person.schema.json"
    schema.write_text('{"type": "object", "properties": {"name": {"type": "string"}}}')
    code, _, err = _cli("--target", target, "generate", "hi", "--json-schema", str(schema))
    assert code == 0, err
    assert servicer.requests[-1].parameters.constraint.json_schema == schema.read_text()
    code, _, _ = _cli("--target", target, "stream", "hi", "--choice", "yes", "--choice", "no")
    assert code == 0 and list(servicer.requests[-1].parameters.constraint.choice.choices) == ["yes", "no"]
    code, _, _ = _cli("--target", target, "generate", "hi", "--regex", "[0-9]+")
    assert code == 0 and servicer.requests[-1].parameters.constraint.regex == "[0-9]+"
    code, _, _ = _cli("--target", target, "generate", "hi", "--json-object")
    assert code == 0 and servicer.requests[-1].parameters.constraint.HasField("json_object")
    code, _, err = _cli("--target", target, "generate", "hi", "--json-schema", str(tmp_path / "missing.json"))
    assert code == 2 and "--json-schema: cannot read" in err
    code, _, err = _cli("--target", target, "generate", "hi", "--regex", "a", "--choice", "b")
    assert code == 2 and "at most one constraint" in err


def test_cli_adapter_id_and_adapters(fake_server: tuple[str, FakeGeneration]) -> None:
    target, servicer = fake_server
    code, _, _ = _cli("--target", target, "generate", "hi", "--adapter-id", "sql")
    assert code == 0 and servicer.requests[-1].adapter_id == "sql"
    code, _, _ = _cli("--target", target, "stream", "hi", "--adapter-id", "sql")
    assert code == 0 and servicer.requests[-1].adapter_id == "sql"
    code, _, _ = _cli("--target", target, "generate", "hi")
    assert code == 0 and servicer.requests[-1].adapter_id == ""  # the base model
    code, out, _ = _cli("--target", target, "adapters")
    assert (code, out) == (0, "max_loras: 4, max_lora_rank: 16\nsql\trank 8\talpha 16\tq_proj,v_proj\t/m/sql\n")
    code, out, _ = _cli("--target", target, "adapters", "--json")
    assert code == 0 and json.loads(out)["adapters"][0]["adapter_id"] == "sql"
