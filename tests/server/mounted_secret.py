"""What a pod is given: a Secret volume as kubelet writes and updates it, and certificates as
cert-manager issues them (a CA of the servers' certificates, another of the clients'), made
with trustme."""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import ssl
from pathlib import Path

import trustme
from cryptography import x509


class MountedSecret:
    """A Secret volume as kubelet's AtomicWriter lays it out: the files in a timestamped
    directory, `..data` a symlink to it, each key a symlink through `..data`. An update writes a
    new directory and renames a new `..data` link over the old one (one atomic step: a reader
    sees all the old files or all the new), then removes the old directory."""

    _versions = itertools.count(1)

    def __init__(self, root: Path, files: dict[str, bytes]):
        self.root = root
        root.mkdir(parents=True)
        self._current: Path | None = None
        self.update(files)
        for name in files:
            (root / name).symlink_to(Path("..data") / name)

    def path(self, name: str) -> str:
        return str(self.root / name)

    def update(self, files: dict[str, bytes]) -> None:
        version = self.root / f"..2026_12_02_16_00_00.{next(self._versions)}"
        version.mkdir()
        for name, data in files.items():
            (version / name).write_bytes(data)
        link = self.root / "..data_tmp"
        link.symlink_to(version.name)
        os.rename(link, self.root / "..data")
        if self._current is not None:
            shutil.rmtree(self._current)
        self._current = version


class Pki:
    """A CA for the servers' certificates (what clients trust: `ca_file`) and one for clients'."""

    def __init__(self, directory: Path):
        self.ca, self.client_ca = trustme.CA(), trustme.CA()
        self.ca_file = str(directory / "ca.pem")
        self.ca.cert_pem.write_to_path(self.ca_file)

    def server_files(self) -> dict[str, bytes]:
        """cert-manager's Secret: tls.crt, tls.key, and ca.crt (here: the clients' CA)."""
        cert = self.ca.issue_cert("127.0.0.1", "localhost")
        return {"tls.crt": b"".join(p.bytes() for p in cert.cert_chain_pems), "tls.key": cert.private_key_pem.bytes(),
                "ca.crt": self.client_ca.cert_pem.bytes()}

    def client_context(self, client_cert: trustme.LeafCert | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        if client_cert is not None:
            client_cert.configure_cert(context)
        return context


def serial(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


def served_serial(port: int, context: ssl.SSLContext, alpn: list[str] | None = None) -> int:
    """The serial number of the certificate a new handshake with 127.0.0.1:port is given."""
    if alpn:
        context.set_alpn_protocols(alpn)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def handed_serial(server: ssl.SSLContext, client: ssl.SSLContext) -> int:
    """The serial number of the certificate `server` hands `client` in a handshake, run in memory
    (the bytes passed between two memory BIOs: no socket, no thread)."""
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    ends = [(client.wrap_bio(client_in, client_out, server_hostname="127.0.0.1"), client_out, server_in),
            (server.wrap_bio(server_in, server_out, server_side=True), server_out, client_in)]
    for _ in range(8):  # a TLS 1.3 handshake takes two round trips; more means it is stuck
        done = 0
        for end, out, peer in ends:
            try:
                end.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            peer.write(out.read())
        if done == 2:
            return x509.load_der_x509_certificate(ends[0][0].getpeercert(binary_form=True)).serial_number
    raise AssertionError("the in-memory handshake did not finish")
