"""Credentials for the clients: an API key as bearer metadata, TLS and mutual-TLS channels.

A Loom server started with ``--api-key`` wants ``authorization: Bearer <key>`` on every call but
health checks; one started with ``--tls-cert``/``--tls-key`` speaks TLS only, and with
``--tls-client-ca`` also wants a client certificate.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from ._requests import Metadata

__all__ = ["api_key_metadata", "read_pem", "tls_credentials"]


def api_key_metadata(api_key: str | None, metadata: Metadata | None) -> tuple[tuple[str, str | bytes], ...]:
    """``metadata`` with the bearer token of ``api_key`` in front (unchanged without a key)."""
    base = tuple(metadata or ())
    if api_key is None:
        return base
    if not api_key or any(c in api_key for c in "\r\n"):
        raise ValueError("api_key must be a non-empty single-line string")
    if any(key.lower() == "authorization" for key, _ in base):
        raise ValueError("give either api_key or an 'authorization' metadata entry, not both")
    return (("authorization", f"Bearer {api_key}"), *base)


def read_pem(path: str | Path) -> bytes:
    """The bytes of a PEM file, for ``root_certificates``, ``certificate_chain`` or ``private_key``."""
    return Path(path).read_bytes()


def tls_credentials(
    root_certificates: bytes | None = None,
    certificate_chain: bytes | None = None,
    private_key: bytes | None = None,
) -> grpc.ChannelCredentials:
    """TLS credentials: the server is checked against ``root_certificates`` (None: the system's
    roots); ``certificate_chain`` and ``private_key`` (both or neither) are the client's own
    certificate for a server that asks for mutual TLS."""
    if (certificate_chain is None) != (private_key is None):
        raise ValueError("a client certificate needs both certificate_chain and private_key")
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def resolve_credentials(
    credentials: grpc.ChannelCredentials | None,
    root_certificates: bytes | None,
    certificate_chain: bytes | None,
    private_key: bytes | None,
) -> grpc.ChannelCredentials | None:
    """The channel's credentials from the clients' arguments; None for plaintext."""
    pems = (root_certificates, certificate_chain, private_key)
    if all(p is None for p in pems):
        return credentials
    if credentials is not None:
        raise ValueError("give either credentials or root_certificates/certificate_chain/private_key, not both")
    return tls_credentials(*pems)
