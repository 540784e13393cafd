"""TLS on the gRPC port and the API's HTTP port (TLS_CERT_FILE and TLS_KEY_FILE; with
TLS_CLIENT_CA_FILE, client certificates required), from files as cert-manager's Secret holds them
(tls.crt, tls.key, ca.crt). Without TLS_CERT_FILE none of this runs: the ports are plain. The
metrics port is always plain (transports/metrics_port.py says why).

The files are read again when they change (transports/reloads.py; cert-manager renews a
certificate weeks before it expires, and kubelet swaps the mounted files): each new handshake gets
the certificate as the files hold it now, connections already open keep theirs, nothing restarts.
Files that cannot be used (a key that is not the certificate's, a CA file with no certificate)
are refused whole with a warning, and handshakes keep the last good ones.

Each file is read once per (re)load, and both ports' material is made from those same bytes: a
second open of the paths could land after kubelet's next swap and pair the gRPC certificate with
another key than the one the HTTP context checked.

- gRPC: grpc.dynamic_ssl_server_credentials, whose fetcher gRPC core calls before every handshake
  (on its own threads, while reloads happen on the event loop): it hands over the configuration
  of a generation it has not handed over yet, else None (no change).
- HTTP: uvicorn listens with one SSLContext whose SNI callback, which OpenSSL calls in every
  handshake (with a server name or without), moves the connection to the context built whole at
  the last reload: certificate, key and client CAs switch together."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import ssl
from typing import Iterator

import grpc

from embedserve.config import ConfigError, Settings
from embedserve.transports.reloads import Watched

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Files:
    cert: str
    key: str
    client_ca: str = ""


@dataclasses.dataclass(frozen=True)
class Material:
    """The files' PEM bytes (for gRPC) and the server context made from the same bytes (for HTTP)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None
    context: ssl.SSLContext

    def grpc_config(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.client_ca)


def _read(variable: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{variable}={path!r}: cannot read it ({e.strerror or e})") from None


def _encrypted_key() -> str:
    # Called by OpenSSL for a key under a passphrase: without a callback it prompts on the
    # terminal (a server has none, and would hang).
    raise ConfigError("TLS_KEY_FILE is encrypted: give the key without a passphrase (as cert-manager writes it)")


@contextlib.contextmanager
def _in_memory(data: bytes) -> Iterator[str]:
    """A path whose content is `data`, for SSLContext.load_cert_chain (which takes paths only):
    an anonymous in-memory file (memfd, Linux), opened by OpenSSL through /proc/self/fd. Nothing
    is written to any filesystem (the pod's root is read-only), and OpenSSL itself checks that the
    key is the certificate's, on exactly the bytes gRPC gets."""
    with os.fdopen(os.memfd_create("embedserve-tls", os.MFD_CLOEXEC), "w+b") as f:
        f.write(data)
        f.flush()
        yield f"/proc/self/fd/{f.fileno()}"


def read(files: Files) -> Material:
    """Read each file once and check it; ConfigError names the variable whose file cannot be used."""
    cert, key = _read("TLS_CERT_FILE", files.cert), _read("TLS_KEY_FILE", files.key)
    ca = _read("TLS_CLIENT_CA_FILE", files.client_ca) if files.client_ca else None
    try:
        ssl.create_default_context(cadata=cert.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as e:
        raise ConfigError(f"TLS_CERT_FILE={files.cert!r}: no PEM certificate in it ({e})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])  # uvicorn serves HTTP/1.1
    try:
        with _in_memory(cert) as cert_path, _in_memory(key) as key_path:
            context.load_cert_chain(cert_path, key_path, password=_encrypted_key)
    except ssl.SSLError as e:
        raise ConfigError(f"TLS_KEY_FILE={files.key!r}: not a PEM private key of TLS_CERT_FILE's certificate ({e})") from None
    if ca is not None:
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            raise ConfigError(f"TLS_CLIENT_CA_FILE={files.client_ca!r}: no PEM certificate in it ({e})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return Material(cert, key, ca, context)


@dataclasses.dataclass(frozen=True)
class _Loaded:
    """What a (re)load made, replaced whole in one assignment: a reader on any thread sees one
    load's generation, material and gRPC configuration together, never a mix."""

    generation: int
    material: Material
    grpc_config: grpc.ServerCertificateConfiguration


class Tls:
    """The current certificate, key and client CAs, for both ports."""

    def __init__(self, files: Files):
        self.files = files
        self.client_auth = bool(files.client_ca)
        self._watched = Watched([p for p in dataclasses.astuple(files) if p])
        material = read(files)
        self._loaded = _Loaded(0, material, material.grpc_config())
        self._handed_out = 0  # the generation gRPC was last given (the initial one, at start)
        self.http_context = material.context  # what uvicorn listens with
        self.http_context.sni_callback = self._current_context

    @property
    def material(self) -> Material:
        return self._loaded.material

    def _current_context(self, connection, server_name, context) -> None:
        if self.material.context is not context:
            connection.context = self.material.context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """For one add_secure_port (one fetcher's memory of what it handed out)."""
        return grpc.dynamic_ssl_server_credentials(self._loaded.grpc_config, self._fetch,
                                                   require_client_authentication=self.client_auth)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # On gRPC core's threads, racing `reload` on the event loop. It reads `_loaded` (one
        # reference: one load whole) and writes only `_handed_out`, which `reload` never
        # touches: no reload can be lost between its read and its write, as one could if it
        # cleared a slot that `reload` fills. gRPC core calls a port's fetcher and installs what
        # it returns under that port's lock (try_fetch_ssl_server_credentials), so
        # `_handed_out` has one writer at a time and says what the port serves.
        loaded = self._loaded
        if loaded.generation == self._handed_out:
            return None
        self._handed_out = loaded.generation
        return loaded.grpc_config

    def reload(self) -> None:
        """Read the files again if any changed; new handshakes on both ports get them."""
        if not self._watched.changed():
            return
        try:
            material = read(self.files)
        except ConfigError as e:
            log.warning("the TLS files changed but cannot be used (%s): new handshakes keep the certificate "
                        "read before", e)
            return
        self._loaded = _Loaded(self._loaded.generation + 1, material, material.grpc_config())
        log.info("TLS certificate and key read again from %s", self.files.cert)


def from_settings(settings: Settings) -> Tls | None:
    """TLS as configured, or None (plain ports). Raises ConfigError, naming the variable, for files
    that cannot be used."""
    if not settings.tls_cert_file:
        return None
    return Tls(Files(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file))
