"""Synchronous client for ``loom.v1.GenerationService``.

    with LoomClient("localhost:50051") as client:
        reply = client.generate("The capital of France is", max_new_tokens=8)
        print(reply.completions[0].text)
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi!"}], temperature=0.7):
            print(chunk.text, end="", flush=True)

Failed calls raise ``grpc.RpcError`` (``.code()``, ``.details()``); bad arguments raise
``ValueError`` or ``TypeError`` before anything is sent.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from ._balancing import channel_options
from ._requests import (
    ChannelOptions,
    ChatMessageLike,
    Metadata,
    generate_request,
    merge_metadata,
    tokenize_request,
)
from ._security import api_key_metadata, resolve_credentials
from .v1 import generation_pb2 as pb
from .v1.generation_pb2_grpc import GenerationServiceStub

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

    from .parameters import ParameterOptions

__all__ = ["LoomClient"]


class LoomClient:
    """A connection to one Loom server; thread-safe, so one client can serve many threads.

    ``target`` is a gRPC target (``host:port``, ``unix:/path``, ``dns:///host:port``).
    ``timeout`` (seconds) and ``metadata`` apply to every call unless the call passes its own
    timeout or extra metadata. ``api_key`` is sent as ``authorization: Bearer <key>`` (servers
    started with ``--api-key``). Without credentials the channel is plaintext. For TLS pass
    ``root_certificates`` (PEM bytes of the CA that signed the server's certificate; see
    :func:`loom_client.read_pem`) and, for a server that wants mutual TLS, the client's
    ``certificate_chain`` and ``private_key``; or pass any ``credentials``
    (``grpc.ssl_channel_credentials()``: TLS with the system's roots). ``options`` are gRPC
    channel arguments.

    Several servers: give a target that resolves to all of them (``dns:///loom-headless:50051``
    or ``ipv4:10.0.0.1:50051,10.0.0.2:50051``) with ``load_balancing="round_robin"`` (gRPC's own
    policy: calls in turn over every connected server; the default, ``pick_first``, uses one).
    ``max_attempts`` (up to 5) retries a call the server answered UNAVAILABLE before sending
    anything, e.g. one that is draining, on the next server; a stream that fails after its first
    token is raised, not replayed.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: ChannelOptions | None = None,
        api_key: str | None = None,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        load_balancing: str | None = None,
        max_attempts: int = 1,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.metadata = api_key_metadata(api_key, metadata)
        credentials = resolve_credentials(credentials, root_certificates, certificate_chain, private_key)
        options = channel_options(options, load_balancing, max_attempts)
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self._stub = GenerationServiceStub(self._channel)

    @property
    def channel(self) -> grpc.Channel:
        return self._channel

    def _call_kwargs(self, timeout: float | None, metadata: Metadata | None) -> dict[str, Any]:
        return {
            "timeout": self.timeout if timeout is None else timeout,
            "metadata": merge_metadata(self.metadata, metadata),
        }

    def generate(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessageLike] | None = None,
        add_generation_prompt: bool = True,
        parse_special_tokens: bool | None = None,
        adapter_id: str = "",
        request_id: str = "",
        parameters: pb.Parameters | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Unpack[ParameterOptions],
    ) -> pb.GenerateResponse:
        """Generate and wait for every completion.

        Give exactly one prompt: ``text``, ``token_ids`` or chat ``messages`` (rendered with the
        model's chat template; ``add_generation_prompt`` opens the assistant's turn). Markup in
        ``text`` that spells a special token ("<|im_start|>") becomes that token unless
        ``parse_special_tokens=False`` (text input only; None: the server's default, true): set it
        for text from people who must not forge chat turns. Generation parameters are keyword
        options named after their proto fields (``max_new_tokens=64``, ``temperature=0.7``,
        ``stop_sequences=["\\n"]``...) applied over ``parameters``.
        """
        request = generate_request(
            pb.GenerateRequest,
            text,
            token_ids,
            messages,
            add_generation_prompt=add_generation_prompt,
            request_id=request_id,
            parameters=parameters,
            options=options,
            parse_special_tokens=parse_special_tokens,
            adapter_id=adapter_id,
        )
        response: pb.GenerateResponse = self._stub.Generate(request, **self._call_kwargs(timeout, metadata))
        return response

    def stream(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessageLike] | None = None,
        add_generation_prompt: bool = True,
        parse_special_tokens: bool | None = None,
        adapter_id: str = "",
        request_id: str = "",
        parameters: pb.Parameters | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Unpack[ParameterOptions],
    ) -> Iterator[pb.GenerateStreamResponse]:
        """Generate, yielding new text and tokens as they are produced (same arguments as generate).

        The call starts at once. Leaving the loop early (``break``, an exception, or ``close()``
        on the returned iterator) cancels it on the server. ``timeout`` bounds the whole stream.
        """
        request = generate_request(
            pb.GenerateStreamRequest,
            text,
            token_ids,
            messages,
            add_generation_prompt=add_generation_prompt,
            request_id=request_id,
            parameters=parameters,
            options=options,
            parse_special_tokens=parse_special_tokens,
            adapter_id=adapter_id,
        )
        call = self._stub.GenerateStream(request, **self._call_kwargs(timeout, metadata))
        return _cancelling(call)

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[ChatMessageLike] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool | None = None,
        parse_special_tokens: bool | None = None,
        return_offsets: bool = False,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> pb.TokenizeResponse:
        """Tokenize ``text`` or chat ``messages`` as generate would (``add_special_tokens=None``
        and ``parse_special_tokens=None``: the server's defaults, as for generate)."""
        request = tokenize_request(
            text,
            messages,
            add_generation_prompt=add_generation_prompt,
            add_special_tokens=add_special_tokens,
            return_offsets=return_offsets,
            parse_special_tokens=parse_special_tokens,
        )
        response: pb.TokenizeResponse = self._stub.Tokenize(request, **self._call_kwargs(timeout, metadata))
        return response

    def model_info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> pb.GetModelInfoResponse:
        """The served model, the server's limits and its plugins."""
        response: pb.GetModelInfoResponse = self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), **self._call_kwargs(timeout, metadata)
        )
        return response

    def load_adapter(
        self, adapter_id: str, path: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> pb.Adapter:
        """Load the PEFT LoRA directory ``path`` (on the server) as ``adapter_id``; returns once it serves."""
        response: pb.LoadAdapterResponse = self._stub.LoadAdapter(
            pb.LoadAdapterRequest(adapter_id=adapter_id, path=path), **self._call_kwargs(timeout, metadata)
        )
        return response.adapter

    def unload_adapter(
        self, adapter_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> pb.Adapter:
        """Unload a LoRA adapter (FAILED_PRECONDITION while requests use it)."""
        response: pb.UnloadAdapterResponse = self._stub.UnloadAdapter(
            pb.UnloadAdapterRequest(adapter_id=adapter_id), **self._call_kwargs(timeout, metadata)
        )
        return response.adapter

    def list_adapters(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> pb.ListAdaptersResponse:
        """The LoRA adapters loaded now, and the server's limits on them."""
        response: pb.ListAdaptersResponse = self._stub.ListAdapters(
            pb.ListAdaptersRequest(), **self._call_kwargs(timeout, metadata)
        )
        return response

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _cancelling(call: Any) -> Iterator[pb.GenerateStreamResponse]:
    """Iterate a server-streaming call, cancelling it if the consumer stops early."""
    try:
        yield from call
    finally:
        call.cancel()
