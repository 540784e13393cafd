"""A body in tiny chunks holds the event loop no longer than a slice (http_protocol.py): what one
read brings is parsed a slice a turn, so the loop-lag probe sees no stall, and the body is
read whole and answered as any other."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from tests.conftest import ServerProcess
from tests.server.test_route_budget import MAX_STALL_S, lag_counts


@pytest.fixture(scope="module")
def server():
    server = ServerProcess({"MODEL_PATH": "sim:5000000"}).wait_ready()
    yield server
    server.stop()


def test_a_body_in_one_byte_chunks_stalls_no_loop(server):
    body = json.dumps({"inputs": "a" * (128 * 1024)}).encode()
    # Sent in one go (6 bytes a byte of body on the wire), so each read the server makes is as
    # large as asyncio reads (256 KiB: ~43 k chunks, most of a second for h11 in one piece).
    wire = b"".join(b"1\r\n%c\r\n" % byte for byte in body) + b"0\r\n\r\n"
    probed, stalls = lag_counts(server)
    with socket.create_connection((server.host, server.http_port), timeout=60) as sock:
        sock.sendall(b"POST /embed HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + wire)
        response = http.client.HTTPResponse(sock, method="POST")
        response.begin()
        vectors = json.loads(response.read())
    assert response.status == 200 and len(vectors) == 1
    probed_after, stalls_after = lag_counts(server)
    assert probed_after > probed  # the probe ran meanwhile
    assert stalls_after == stalls, f"the event loop stalled over {MAX_STALL_S} s {stalls_after - stalls} times"
