"""TLS on the gRPC port and the API's HTTP port (TLS_CERT_FILE and TLS_KEY_FILE; with
TLS_CLIENT_CA_FILE, client certificates required), from files as cert-manager's Secret holds them
(tls.crt, tls.key, ca.crt). Without TLS_CERT_FILE none of this runs: the ports are plain. The
metrics port is always plain (transports/metrics_port.py says why).

The files are read again when they change (transports/reloads.py; cert-manager renews a
certificate weeks before it expires, and kubelet swaps the mounted files): each new handshake gets
the certificate as the files hold it now, connections already open keep theirs, nothing restarts.
Files that cannot be used (a key that is not the certificate's, a CA file with no certificate)
are refused whole with a warning, and handshakes keep the last good ones.

- gRPC: grpc.dynamic_ssl_server_credentials, whose fetcher gRPC core calls before every handshake
  (on its own threads): it hands over the new configuration once, after a reload, else None (no
  change).
- HTTP: uvicorn listens with one SSLContext whose SNI callback, which OpenSSL calls in every
  handshake (with a server name or without), moves the connection to the context built whole at
  the last reload: certificate, key and client CAs switch together."""

from __future__ import annotations

import dataclasses
import logging
import ssl

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
    """The files' PEM bytes (for gRPC) and the server context they make (for HTTP)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None
    context: ssl.SSLContext


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


def read(files: Files) -> Material:
    """Read and check the files; ConfigError names the variable whose file cannot be used."""
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
        context.load_cert_chain(files.cert, files.key, password=_encrypted_key)
    except ssl.SSLError as e:
        raise ConfigError(f"TLS_KEY_FILE={files.key!r}: not a PEM private key of TLS_CERT_FILE's certificate ({e})") from None
    if ca is not None:
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            raise ConfigError(f"TLS_CLIENT_CA_FILE={files.client_ca!r}: no PEM certificate in it ({e})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return Material(cert, key, ca, context)


class Tls:
    """The current certificate, key and client CAs, for both ports."""

    def __init__(self, files: Files):
        self.files = files
        self.client_auth = bool(files.client_ca)
        self._watched = Watched([p for p in dataclasses.astuple(files) if p])
        self.material = read(files)
        self.http_context = self.material.context  # what uvicorn listens with
        self.http_context.sni_callback = self._current_context
        self._pending: grpc.ServerCertificateConfiguration | None = None

    def _current_context(self, connection, server_name, context) -> None:
        if self.material.context is not context:
            connection.context = self.material.context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._grpc_config(self.material), self._fetch,
                                                   require_client_authentication=self.client_auth)

    @staticmethod
    def _grpc_config(m: Material) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.client_ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        config, self._pending = self._pending, None
        return config

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
        self._pending, self.material = self._grpc_config(material), material
        log.info("TLS certificate and key read again from %s", self.files.cert)


def from_settings(settings: Settings) -> Tls | None:
    """TLS as configured, or None (plain ports). Raises ConfigError, naming the variable, for files
    that cannot be used."""
    if not settings.tls_cert_file:
        return None
    return Tls(Files(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file))
