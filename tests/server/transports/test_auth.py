"""API keys (transports/auth.py) on real files laid out as kubelet mounts a Secret: which
Authorization values pass, what a refusal is counted as, the file read again after kubelet's
symlink swap, the last good keys kept when the file is emptied or gone, a line of keys written the
API_KEYS way (with commas) named by its number, and no key in the log.
Over real gRPC and HTTP: tests/server/test_keys_and_tls.py."""

import dataclasses
import logging
import secrets

import pytest

from embedserve.config import ConfigError, Settings
from embedserve.transports import auth
from tests.server.mounted_secret import MountedSecret


def test_key_lines_skip_blank_lines_and_comments_and_keep_their_numbers():
    assert auth.numbered_keys("# rotated 2026-12\n\n  alpha  \n#beta\nga#mma\r\n") == ((3, "alpha"), (5, "ga#mma"))


@pytest.mark.parametrize("value, key", [
    ("Bearer abc", "abc"), ("bearer abc", "abc"), ("BEARER  abc ", "abc"), ("Bearer", None), ("Bearer   ", None),
    ("Basic YWxhZGRpbjpvcGVu", None), ("abc", None), ("", None), (None, None),
])
def test_bearer(value, key):
    assert auth.bearer(value) == key


@pytest.fixture
def secret(tmp_path):
    return MountedSecret(tmp_path / "auth", {"api-keys": b"# the fleet's keys\nfile-key-1\n\nfile-key-2\n"})


def test_keys_from_both_sources_pass_and_refusals_are_counted_by_reason(secret):
    refused = []
    keys = auth.ApiKeys(("env-key",), secret.path("api-keys"), refused.append)
    assert [keys.check(f"Bearer {k}") for k in ("env-key", "file-key-1", "file-key-2")] == [None, None, None]
    assert keys.check(None) == "missing" and keys.check("Basic eDp5") == "missing"
    assert keys.check("Bearer file-key-") == "invalid" and keys.check("Bearer file-key-1x") == "invalid"
    assert refused == ["missing", "missing", "invalid", "invalid"]


def test_the_file_is_read_again_after_kubelets_swap_and_a_bad_one_keeps_the_last_keys(secret, caplog):
    keys = auth.ApiKeys(("env-key",), secret.path("api-keys"))
    keys.reload()  # nothing changed: nothing read
    secret.update({"api-keys": b"file-key-3\n"})
    keys.reload()
    assert keys.check("Bearer file-key-3") is None and keys.check("Bearer file-key-1") == "invalid"
    assert keys.check("Bearer env-key") is None  # API_KEYS' stay whatever the file says
    with caplog.at_level(logging.INFO, logger="embedserve"):
        secret.update({"api-keys": b"# all gone\n\n"})  # a Secret emptied by mistake: not an open server
        keys.reload()
        assert keys.check("Bearer file-key-3") is None and keys.check(None) == "missing"
        (secret.root / "..data").unlink()  # the mount gone: unreadable
        keys.reload()
        assert keys.check("Bearer file-key-3") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "holds no key now" in warnings[0] and "cannot be read" in warnings[1]
    assert not any(k in caplog.text for k in ("file-key", "env-key"))


def test_a_key_with_a_comma_or_whitespace_is_warned_of_by_line_number_at_load_and_reload(tmp_path, caplog):
    """Keys written the API_KEYS way in the file are one key no client sends: every client would
    get "invalid API key" with nothing saying why. The warning names the line, never the key."""
    first, second, third, spaced = (secrets.token_urlsafe(12) for _ in range(4))

    def warned() -> list[str]:
        messages = [r.getMessage() for r in caplog.records]
        caplog.clear()
        logged.extend(messages)
        return messages

    logged = []
    with caplog.at_level(logging.WARNING, logger="embedserve"):
        secret = MountedSecret(tmp_path / "auth", {"api-keys": f"# keys\n{first}\n{second},{third}\n".encode()})
        keys = auth.ApiKeys((), secret.path("api-keys"))
        path = secret.path("api-keys")
        assert warned() == [f"API_KEYS_FILE {path}, line 3: a key with a comma or whitespace in it, taken whole as "
                            "one key (the file has one key a line: put each on a line of its own)"]
        assert keys.check(f"Bearer {second},{third}") is None and keys.check(f"Bearer {second}") == "invalid"

        secret.update({"api-keys": f"{second}, {third}\n\n{first}\n{spaced[:6]}\t{spaced[6:]}\n".encode()})
        keys.reload()
        assert [m.split(": ")[0] for m in warned()] == [f"API_KEYS_FILE {path}, lines 1, 4"]

        secret.update({"api-keys": f"{first}\n{second}\n".encode()})
        keys.reload()
        assert warned() == [] and keys.check(f"Bearer {second}") is None
    assert not any(k in m for m in logged for k in (first, second, third, spaced[:6], spaced[6:]))


def test_a_key_file_without_keys_is_a_config_error(tmp_path):
    (tmp_path / "keys").write_text("# none yet\n")
    settings = Settings.from_env({"API_KEYS_FILE": str(tmp_path / "keys")})
    with pytest.raises(ConfigError, match="API_KEYS_FILE=.*holds no key"):
        auth.from_settings(settings)


def test_no_key_configured_is_no_check():
    assert auth.from_settings(Settings.from_env({})) is None


async def test_with_nothing_configured_nothing_is_in_the_request_path():  # grpc.aio builds its server on the running loop
    """No key, no TLS: no key middleware, no interceptor, no reload task, plain ports (the host
    path costs what it did before keys and TLS existed, but the drain header)."""
    from embedserve.app import Server
    from embedserve.transports import drain

    server = Server(dataclasses.replace(Settings(), host="127.0.0.1", grpc_port=0, http_port=0, metrics_port=0,
                                        warm_start="false"))
    t = server.transports  # built, not started
    assert t.keys is None and t.tls is None and t._reloads == []
    config = t.http._uvicorn.config
    # ConnectionAge, the drain header every answer carries (drain.py), then the routes: no key check.
    assert config.ssl_context_factory is None and isinstance(config.app.app, drain.DrainHeader)
    assert config.app.app.app is t.api
