"""Asyncio client for ``loom.v1.GenerationService``: the same surface as :class:`LoomClient`.

    async with AsyncLoomClient("localhost:50051") as client:
        reply = await client.generate("The capital of France is", max_new_tokens=8)
        async for chunk in client.stream("Once upon a time", max_new_tokens=64):
            print(chunk.text, end="", flush=True)

Create the client inside a running event loop (in a coroutine) and use it on that loop only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

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

__all__ = ["AsyncLoomClient"]


class AsyncLoomClient:
    """An asyncio connection to one Loom server. Arguments as for :class:`loom_client.LoomClient`."""

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
            self._channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        self._stub = GenerationServiceStub(self._channel)

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel

    def _call_kwargs(self, timeout: float | None, metadata: Metadata | None) -> dict[str, Any]:
        return {
            "timeout": self.timeout if timeout is None else timeout,
            "metadata": merge_metadata(self.metadata, metadata),
        }

    async def generate(
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
        """Generate and wait for every completion (see :meth:`loom_client.LoomClient.generate`)."""
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
        response: pb.GenerateResponse = await self._stub.Generate(
            request, **self._call_kwargs(timeout, metadata)
        )
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
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """An async iterator of new text and tokens (see :meth:`loom_client.LoomClient.stream`).

        Arguments are checked at once; the call starts on the first ``__anext__``. Leaving the
        ``async for`` early (or ``aclose()``) cancels it on the server.
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
        return self._stream(request, self._call_kwargs(timeout, metadata))

    async def _stream(
        self, request: pb.GenerateStreamRequest, call_kwargs: dict[str, Any]
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        call = self._stub.GenerateStream(request, **call_kwargs)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def tokenize(
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
        """Tokenize ``text`` or chat ``messages`` as generate would."""
        request = tokenize_request(
            text,
            messages,
            add_generation_prompt=add_generation_prompt,
            add_special_tokens=add_special_tokens,
            return_offsets=return_offsets,
            parse_special_tokens=parse_special_tokens,
        )
        response: pb.TokenizeResponse = await self._stub.Tokenize(
            request, **self._call_kwargs(timeout, metadata)
        )
        return response

    async def model_info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> pb.GetModelInfoResponse:
        """The served model, the server's limits and its plugins."""
        response: pb.GetModelInfoResponse = await self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), **self._call_kwargs(timeout, metadata)
        )
        return response

    async def load_adapter(
        self, adapter_id: str, path: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> pb.Adapter:
        """Load the PEFT LoRA directory ``path`` (on the server) as ``adapter_id``; returns once it serves."""
        response: pb.LoadAdapterResponse = await self._stub.LoadAdapter(
            pb.LoadAdapterRequest(adapter_id=adapter_id, path=path), **self._call_kwargs(timeout, metadata)
        )
        return response.adapter

    async def unload_adapter(
        self, adapter_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> pb.Adapter:
        """Unload a LoRA adapter (FAILED_PRECONDITION while requests use it)."""
        response: pb.UnloadAdapterResponse = await self._stub.UnloadAdapter(
            pb.UnloadAdapterRequest(adapter_id=adapter_id), **self._call_kwargs(timeout, metadata)
        )
        return response.adapter

    async def list_adapters(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> pb.ListAdaptersResponse:
        """The LoRA adapters loaded now, and the server's limits on them."""
        response: pb.ListAdaptersResponse = await self._stub.ListAdapters(
            pb.ListAdaptersRequest(), **self._call_kwargs(timeout, metadata)
        )
        return response

    async def close(self, grace: float | None = None) -> None:
        """Close the channel; calls in flight are cancelled after ``grace`` seconds (None: at once)."""
        await self._channel.close(grace)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
