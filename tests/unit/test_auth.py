"""The API-key check and the TLS settings, without a server (the e2e tests cover the wire)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.config import ConfigError
from loom.server.auth import ApiKeyInterceptor, auth_interceptors, bearer_token
from loom.server.settings import ServerSettings
from loom.server.tls import TlsFiles, server_credentials


@pytest.mark.parametrize(("metadata", "token"), [
    ([("authorization", "Bearer s3cret")], "s3cret"),
    ([("authorization", "bearer   s3cret ")], "s3cret"),
    ([("x-other", "1"), ("authorization", b"Bearer s3cret")], "s3cret"),
    ([], None),
    (None, None),
    ([("authorization", "Basic czNjcmV0")], None),
    ([("authorization", "Bearer")], None),
    ([("authorization", "Bearer a"), ("authorization", "Bearer b")], None),
])
def test_bearer_token(metadata: list[tuple[str, str | bytes]] | None, token: str | None) -> None:
    found, why = bearer_token(metadata)
    assert found == token
    assert bool(why) == (token is None)


def test_check_messages() -> None:
    interceptor = ApiKeyInterceptor("s3cret")
    assert interceptor.check([("authorization", "Bearer s3cret")]) == ""
    assert interceptor.check([("authorization", "Bearer nope")]) == "invalid API key"
    assert "Bearer <key>" in interceptor.check([])
    assert interceptor.check([("authorization", "Bearer s3crét")]) == "invalid API key"  # non-ASCII is no crash
    assert auth_interceptors(None) == []
    with pytest.raises(ValueError):
        ApiKeyInterceptor("")


def test_key_is_not_in_the_settings_repr() -> None:
    assert "s3cret" not in repr(ServerSettings(api_key="s3cret"))
    with pytest.raises(ConfigError):
        ServerSettings(api_key=" ")


@pytest.mark.parametrize(("files", "flag"), [
    (TlsFiles(cert="c.pem"), "--tls-key"),
    (TlsFiles(key="k.pem"), "--tls-cert"),
    (TlsFiles(client_ca="ca.pem"), "--tls-client-ca"),
])
def test_tls_flags_go_together(files: TlsFiles, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        files.validate()


def test_tls_files_are_checked_at_start(tmp_path: Path) -> None:
    assert server_credentials(TlsFiles()) is None
    missing = TlsFiles(cert=str(tmp_path / "none.pem"), key=str(tmp_path / "none.key"))
    with pytest.raises(ConfigError, match="--tls-cert: cannot read"):
        server_credentials(missing)
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("hello")
    with pytest.raises(ConfigError, match="not a PEM file"):
        server_credentials(TlsFiles(cert=str(not_pem), key=str(not_pem)))
