"""BIND_HOST's default binds every address: a server is reachable over IPv4 and IPv6 on all three
ports (IPv6-only pods are probed and scraped on their IPv6 address), in both modes."""

import json
import socket
import urllib.request

import pytest

from embedserve.client import Client
from embedserve.transports import addresses
from tests.conftest import ONE_ROW_CAPS, ServerProcess

pytestmark = pytest.mark.skipif(not addresses._ipv6_available(), reason="this host has no IPv6")


def test_an_explicit_host_is_kept_and_the_default_is_the_dual_stack_wildcard():
    assert addresses.bind_host("127.0.0.1") == "127.0.0.1"
    assert addresses.bind_host("") == "::"
    assert addresses.bind_host("[::]") == "::" and addresses.bind_host("[::1]") == "::1"  # URL-style brackets
    assert addresses.grpc_address("::", 50051) == "[::]:50051"
    assert addresses.grpc_address("10.0.0.1", 50051) == "10.0.0.1:50051"


def test_the_wildcard_socket_takes_both_families():
    sock = addresses.listening_socket("::")
    with sock:
        sock.bind(("::", 0))
        sock.listen()
        port = sock.getsockname()[1]
        for host in ("127.0.0.1", "::1"):
            socket.create_connection((host, port), timeout=2).close()


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        json.loads(r.read())
        return r.status


@pytest.mark.parametrize("frontends", ["1", "2"])
async def test_the_default_bind_serves_ipv4_and_ipv6_on_every_port(frontends):
    server = ServerProcess({"BIND_HOST": "", "MODEL_PATH": "sim:200000", "BATCH_CAPS": ONE_ROW_CAPS,
                            "FRONTENDS": frontends})
    try:
        server.host = "127.0.0.1"  # wait_ready's probe: IPv4 loopback
        server.wait_ready(120)
        for host in ("127.0.0.1", "[::1]"):
            assert _get(f"http://{host}:{server.metrics_port}/health") == 200
            assert _get(f"http://{host}:{server.http_port}/health") == 200
        for target in (f"ipv4:127.0.0.1:{server.grpc_port}", f"ipv6:[::1]:{server.grpc_port}"):
            async with Client(target) as client:
                assert (await client.embed(["hello"])).shape[0] == 1
    finally:
        server.stop()
