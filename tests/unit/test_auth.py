"""The API-key check and the TLS settings, without a server (the e2e tests cover the wire)."""

from __future__ import annotations

from pathlib import Path

import grpc
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


def test_client_api_key_and_tls_arguments() -> None:
    from loom_client._security import api_key_metadata, resolve_credentials

    assert api_key_metadata("k", [("x-a", "1")]) == (("authorization", "Bearer k"), ("x-a", "1"))
    assert api_key_metadata(None, None) == ()
    for bad in ("", "a\nb"):
        with pytest.raises(ValueError):
            api_key_metadata(bad, None)
    with pytest.raises(ValueError, match="not both"):
        api_key_metadata("k", [("authorization", "Bearer other")])
    assert resolve_credentials(None, None, None, None) is None
    with pytest.raises(ValueError, match="both certificate_chain and private_key"):
        resolve_credentials(None, None, b"chain", None)
    with pytest.raises(ValueError, match="not both"):
        resolve_credentials(grpc.ssl_channel_credentials(), b"ca", None, None)


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from loom.cli import build_parser
    from loom.server.serve_command import settings_from_args

    monkeypatch.setenv("LOOM_API_KEY", "from-env")
    parser = build_parser()
    assert settings_from_args(parser.parse_args(["serve"])).api_key == "from-env"
    assert settings_from_args(parser.parse_args(["serve", "--api-key", "flag"])).api_key == "flag"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "from-env" not in capsys.readouterr().out  # --help never shows the key
