"""loom-client: a small, torch-free Python client for Loom's gRPC API.

    from loom_client import LoomClient

    with LoomClient("localhost:50051") as client:
        print(client.generate("Hello", max_new_tokens=16).completions[0].text)

The messages are in :mod:`loom_client.v1.generation_pb2`; the asyncio client is
:class:`loom_client.aio.AsyncLoomClient`.
"""

from __future__ import annotations

from ._requests import ChannelOptions, ChatMessageLike, Metadata
from ._security import read_pem, tls_credentials
from .aio import AsyncLoomClient
from .client import LoomClient
from .parameters import ParameterOptions, build_parameters

__version__ = "0.1.0"

__all__ = [
    "AsyncLoomClient",
    "ChannelOptions",
    "ChatMessageLike",
    "LoomClient",
    "Metadata",
    "ParameterOptions",
    "__version__",
    "build_parameters",
    "read_pem",
    "tls_credentials",
]
