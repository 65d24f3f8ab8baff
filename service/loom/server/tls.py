"""TLS and mutual TLS for the gRPC port (--tls-cert, --tls-key, --tls-client-ca).

With --tls-cert and --tls-key the port speaks TLS only; without them it is plaintext (fine on
loopback or behind a TLS-terminating proxy, nowhere else). --tls-client-ca turns on mutual TLS:
a client must present a certificate signed by that CA, or the handshake fails before any RPC
(clients see UNAVAILABLE). Every file is PEM; they are read once, at start-up, so a bad path
fails the start instead of the first connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from loom.config import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    cert: str | None = None  # the server's certificate chain, PEM
    key: str | None = None  # its private key, PEM
    client_ca: str | None = None  # CA bundle that client certificates must chain to (mTLS)

    def validate(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
        if self.client_ca and not self.cert:
            raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca)


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag}: {path} is not a PEM file")
    return data


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials | None:
    """The port's credentials; None for plaintext."""
    files.validate()
    if not files.enabled:
        return None
    assert files.cert is not None and files.key is not None
    chain = _read(files.cert, "--tls-cert")
    key = _read(files.key, "--tls-key")
    client_ca = _read(files.client_ca, "--tls-client-ca") if files.client_ca else None
    return grpc.ssl_server_credentials(
        [(key, chain)],
        root_certificates=client_ca,
        # Without this gRPC would only *ask* for a client certificate; mTLS must insist.
        require_client_auth=client_ca is not None,
    )
