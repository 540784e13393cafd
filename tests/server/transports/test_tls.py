"""TLS material (transports/tls.py): files that cannot be used are a start-up error naming the
variable (an encrypted key too: OpenSSL would otherwise prompt on a terminal the server does not
have); after kubelet swaps the files, gRPC's fetcher hands the new configuration over once and the
HTTP context changes; files swapped to something unusable keep the last good ones; a swap between
the reads of one load cannot pair gRPC's certificate with another key than HTTP's; a renewal
reaches the next gRPC handshake while other handshakes race the reload. Handshakes with running
servers: tests/server/test_keys_and_tls.py."""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cryptography.hazmat.primitives import serialization

from embedserve.config import ConfigError
from embedserve.transports import tls
from tests.server.mounted_secret import MountedSecret, Pki, handed_serial, serial, served_serial


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


def test_both_ports_get_the_bytes_of_one_read_though_kubelet_swaps_the_files_between_reads(tmp_path, pki):
    """kubelet swaps the Secret while a load is between its reads: here at the moment the load
    opens the client CA file (a FIFO: its writer wakes when it is opened), after the certificate
    and key were read. Whatever the load built must be the pair it read: gRPC's PEM and the HTTP
    context hand out the same certificate (reading the paths again would pick the new pair)."""
    first, second = pki.server_files(), pki.server_files()
    secret = MountedSecret(tmp_path / "tls", first)
    client_ca = tmp_path / "ca.crt"
    os.mkfifo(client_ca)

    def swap_when_opened():
        with open(client_ca, "wb") as ca:  # returns once the load opens it
            secret.update(second)
            ca.write(first["ca.crt"])

    swapper = threading.Thread(target=swap_when_opened, daemon=True)
    swapper.start()
    try:
        material = tls.read(tls.Files(secret.path("tls.crt"), secret.path("tls.key"), str(client_ca)))
    finally:
        os.close(os.open(client_ca, os.O_RDONLY | os.O_NONBLOCK))  # frees the writer if the load never opened it
        swapper.join(timeout=10)
    assert serial(material.cert) == serial(first["tls.crt"])  # the swap came after the certificate was read
    assert open(secret.path("tls.crt"), "rb").read() == second["tls.crt"]  # ... and before the load ended
    client = pki.client_context(pki.client_ca.issue_cert("client@embedfleet.test"))
    assert handed_serial(material.context, client) == serial(material.cert)


def test_every_renewal_reaches_the_next_grpc_handshake_while_others_race_the_reload(tmp_path, pki):
    """gRPC core asks the fetcher on its own threads, before each handshake, while reloads run on
    the event loop: no interleaving may lose a renewal (gRPC would keep the old certificate until
    the next one, possibly past its expiry)."""
    secret = MountedSecret(tmp_path / "tls", pki.server_files())
    current = tls.Tls(files_of(secret))
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_secure_port("127.0.0.1:0", current.grpc_credentials())
    server.start()
    stop, failures = threading.Event(), []

    def handshakes():
        while not stop.is_set():
            try:
                served_serial(port, pki.client_context(), ["h2"])
            except Exception as e:  # noqa: BLE001 - reported by the test below
                failures.append(e)

    racing = [threading.Thread(target=handshakes) for _ in range(3)]
    for thread in racing:
        thread.start()
    try:
        for _ in range(6):
            renewed = pki.server_files()
            secret.update(renewed)
            current.reload()
            assert served_serial(port, pki.client_context(), ["h2"]) == serial(renewed["tls.crt"])
    finally:
        stop.set()
        for thread in racing:
            thread.join()
        server.stop(None)
    assert failures == []
