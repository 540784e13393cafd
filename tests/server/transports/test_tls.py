"""TLS material (transports/tls.py): files that cannot be used are a start-up error naming the
variable (an encrypted key too: OpenSSL would otherwise prompt on a terminal the server does not
have); after kubelet swaps the files, gRPC's fetcher hands the new configuration over once and the
HTTP context changes; files swapped to something unusable keep the last good ones. Handshakes over
real sockets: tests/server/test_keys_and_tls.py."""

import pytest
from cryptography.hazmat.primitives import serialization

from embedserve.config import ConfigError
from embedserve.transports import tls
from tests.server.mounted_secret import MountedSecret, Pki, serial


@pytest.fixture
def pki(tmp_path):
    return Pki(tmp_path)


def files_of(secret: MountedSecret, client_ca: bool = False) -> tls.Files:
    return tls.Files(secret.path("tls.crt"), secret.path("tls.key"), secret.path("ca.crt") if client_ca else "")


def encrypted(key_pem: bytes) -> bytes:
    key = serialization.load_pem_private_key(key_pem, None)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.BestAvailableEncryption(b"passphrase"))


@pytest.mark.parametrize("damage, variable", [
    (lambda f, other: {**f, "tls.crt": b"not a certificate"}, "TLS_CERT_FILE"),
    (lambda f, other: {**f, "tls.key": other["tls.key"]}, "TLS_KEY_FILE"),  # another certificate's key
    (lambda f, other: {**f, "tls.key": b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"}, "TLS_KEY_FILE"),
    (lambda f, other: {**f, "tls.key": encrypted(f["tls.key"])}, "TLS_KEY_FILE.*encrypted"),
    (lambda f, other: {**f, "ca.crt": b""}, "TLS_CLIENT_CA_FILE"),
], ids=["garbage certificate", "another certificate's key", "garbage key", "encrypted key", "empty client CA"])
def test_files_that_cannot_be_used_name_their_variable(tmp_path, pki, damage, variable):
    secret = MountedSecret(tmp_path / "tls", damage(pki.server_files(), pki.server_files()))
    with pytest.raises(ConfigError, match=variable):
        tls.Tls(files_of(secret, client_ca=True))


def test_changed_files_reach_both_ports_once_and_unusable_ones_keep_the_last(tmp_path, pki):
    first = pki.server_files()
    secret = MountedSecret(tmp_path / "tls", first)
    current = tls.Tls(files_of(secret, client_ca=True))
    listening = current.http_context
    assert current._fetch() is None and current.material.cert == first["tls.crt"]
    current.reload()  # nothing changed
    assert current._fetch() is None

    second = pki.server_files()
    secret.update(second)
    current.reload()
    assert serial(current.material.cert) == serial(second["tls.crt"]) != serial(first["tls.crt"])
    assert current._fetch() is not None and current._fetch() is None  # handed to gRPC once
    assert current.material.context is not listening and current.http_context is listening

    secret.update({**pki.server_files(), "tls.key": second["tls.key"]})  # a torn update: key of another
    current.reload()
    assert current.material.cert == second["tls.crt"] and current._fetch() is None
