"""A body in tiny chunks holds the event loop no longer than a slice (http_protocol.py): what one
read brings is parsed a slice a turn, so the loop-lag probe sees no stall, and the body is
read whole and answered as any other; a request pipelined behind an unanswered one waits, then
is parsed the same way; a parse error in a slice drops the connection."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket

import pytest
import uvicorn
from uvicorn.server import ServerState

from embedserve.transports.http_protocol import SLICE, SlicedH11Protocol
from tests.conftest import ServerProcess
from tests.server.test_route_budget import lag_counts


@pytest.fixture(scope="module")
def server():
    server = ServerProcess({"MODEL_PATH": "sim:5000000"}).wait_ready()
    yield server
    server.stop()


def test_a_body_in_one_byte_chunks_is_read_whole_and_answered(server):
    """End to end on a real server: reads of ~43 k chunks each (sent in one go, 6 bytes on the wire
    a byte of body), parsed a slice at a time, make the body the server embeds, and the loop-lag
    probe kept running meanwhile. (How long a turn takes is the bench's: bench/http_parse.)"""
    body = json.dumps({"inputs": "a" * (128 * 1024)}).encode()
    wire = b"".join(b"1\r\n%c\r\n" % byte for byte in body) + b"0\r\n\r\n"
    probed, _ = lag_counts(server)
    with socket.create_connection((server.host, server.http_port), timeout=60) as sock:
        sock.sendall(b"POST /embed HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + wire)
        response = http.client.HTTPResponse(sock, method="POST")
        response.begin()
        vectors = json.loads(response.read())
    assert response.status == 200 and len(vectors) == 1
    assert lag_counts(server)[0] > probed


# --- The protocol itself, on a transport that records what it is told ---------------------------

class Transport:
    """The surface of asyncio.Transport that uvicorn's protocol uses, recording what it is told."""

    def __init__(self):
        self.written, self.reading, self.closed, self.aborted = bytearray(), True, False, False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8001), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data):
        self.written += data

    def close(self):
        self.closed = True

    def abort(self):
        self.closed = self.aborted = True

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True

    def is_closing(self):
        return self.closed


def connection(app) -> tuple[SlicedH11Protocol, Transport]:
    config = uvicorn.Config(app, lifespan="off", http=SlicedH11Protocol, log_config=None)
    protocol, transport = SlicedH11Protocol(config, ServerState(), {}), Transport()
    protocol.connection_made(transport)
    return protocol, transport


async def turns(n: int = 1) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def chunked(path: str, body: bytes) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" % path.encode()
            + b"".join(b"1\r\n%c\r\n" % byte for byte in body) + b"0\r\n\r\n")


async def test_a_request_pipelined_behind_one_unanswered_waits_and_is_then_parsed_a_slice_a_turn():
    gate, bodies = asyncio.Event(), []

    async def app(scope, receive, send):
        if scope["path"] == "/first":
            await gate.wait()
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        bodies.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    protocol, transport = connection(app)
    body = bytes(range(256)) * 64  # 16 KiB: 96 KiB on the wire in 1-byte chunks
    wire = b"GET /first HTTP/1.1\r\nHost: t\r\n\r\n" + chunked("/second", body)
    protocol.data_received(wire)  # one read
    await turns(50)
    # The first is unanswered: the second waits whole, no more than a slice given to h11
    assert bodies == [] and len(protocol._backlog) >= len(wire) - SLICE and not transport.reading
    gate.set()
    left = [len(protocol._backlog)]
    while len(bodies) < 2:
        await turns()
        left.append(len(protocol._backlog))
    assert max(a - b for a, b in zip(left, left[1:])) < left[0] // 2  # over several turns, never at once
    assert bodies == [("/first", b""), ("/second", body)]
    assert transport.written.count(b"HTTP/1.1 200") == 2 and transport.reading


async def test_one_read_of_tiny_chunks_is_parsed_over_several_turns_and_arrives_whole():
    bodies = []

    async def app(scope, receive, send):
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    protocol, transport = connection(app)
    body = bytes(range(256)) * 128  # 32 KiB: 192 KiB on the wire, ~33 k chunks, one read
    protocol.data_received(chunked("/x", body))
    assert not transport.reading  # paused while the backlog is parsed
    await turns()
    assert protocol._backlog  # one turn parsed a part (~TURN_S of it), not the read
    turns_taken = 1
    while not bodies:
        await turns()
        turns_taken += 1
    assert bodies == [body] and turns_taken > 2 and transport.reading


async def test_a_parse_error_in_a_slice_drops_the_connection():
    """Answered while its body was still coming, then sent garbage: h11 raises while the protocol
    answers 400 (the answer was sent). Fed from the loop, the connection is aborted, as asyncio
    does when data_received raises, not left paused and counted forever."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    protocol, transport = connection(app)
    protocol.data_received(b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    await turns(20)
    assert b"200" in transport.written and not transport.closed
    loop, errors = asyncio.get_running_loop(), []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        protocol.data_received(b"zz\r\n" * SLICE)  # not a chunk's size; longer than a slice
        await turns(5)
    finally:
        loop.set_exception_handler(handler)
    assert transport.aborted and not protocol._backlog
