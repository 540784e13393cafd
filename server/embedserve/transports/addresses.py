"""Where the listeners bind. BIND_HOST empty (the default) means every address of the pod, IPv4
and IPv6: an IPv6 wildcard socket with IPV6_V6ONLY off takes both families, so the same server
is reachable in IPv4-only, dual-stack and IPv6-only clusters (a 0.0.0.0 socket is not reachable
on an IPv6-only pod's address: kubelet's probes and the autoscaler's scrape would fail there).
A host without IPv6 at all (the module disabled) gets 0.0.0.0."""

from __future__ import annotations

import functools
import socket

IPV4_ANY = "0.0.0.0"
IPV6_ANY = "::"


@functools.cache
def _ipv6_available() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind((IPV6_ANY, 0))
        return True
    except OSError:
        return False


def bind_host(host: str) -> str:
    """BIND_HOST → the address to bind: "" is every address (see the module docstring); an IPv6
    literal may come bracketed, as in a URL ("[::]")."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host:
        return host
    return IPV6_ANY if _ipv6_available() else IPV4_ANY


def listening_socket(host: str) -> socket.socket:
    """A TCP socket bound to `host` (already through bind_host): IPv6 ones also take IPv4 when
    the host is the IPv6 wildcard (IPV6_V6ONLY off, whatever net.ipv6.bindv6only says)."""
    ipv6 = ":" in host
    sock = socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET)
    if host == IPV6_ANY:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    return sock


def grpc_address(host: str, port: int) -> str:
    """gRPC's address syntax: an IPv6 literal in brackets ("[::]:50051" is gRPC's dual-stack wildcard)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
