"""What a serving process holds at once is bounded, and idle connections are not what counts:
- MAX_CONCURRENT_REQUESTS requests in progress (HTTP: the next answered 429 in the API's shape;
  gRPC: RESOURCE_EXHAUSTED), while idle keep-alive connections (a client's pool, a load
  balancer's, or sockets opened on purpose) lock nobody out and probes are always answered;
- streaming gRPC calls, open without a key (health Watch, reflection): MAX_OPEN_STREAMS at once;
- a body trickled slower than BODY_READ_S is refused (408).
Past a bound a caller is told at once, and what was admitted is served."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.transports.grpc_budget import MAX_OPEN_STREAMS
from tests.conftest import ServerProcess

LIMIT = 3
SLOW = pb.EmbedRequest(texts=["word " * 250] * 4)  # 1,008 tokens: half a second at 2,000 a second
OWN = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own (gRPC shares one per target)


@pytest.fixture(scope="module")
def server():
    server = ServerProcess({"MODEL_PATH": "sim:2000", "BATCH_CAPS": "16:4,32:4,64:4,128:4,256:4",
                            "MAX_DRAIN_TIME_MS": "600000", "MAX_CONCURRENT_REQUESTS": str(LIMIT)}).wait_ready()
    yield server
    server.stop()


def in_flight(server: ServerProcess, n: int) -> None:
    """Until the model process has `n` requests admitted and not answered."""
    deadline = time.monotonic() + 30
    while server.health()[1]["in_flight_requests"] < n:
        assert time.monotonic() < deadline, server.health()[1]
        time.sleep(0.02)


def test_idle_connections_lock_nobody_out(server):
    idle = [socket.create_connection((server.host, server.http_port)) for _ in range(4 * LIMIT)]
    try:
        for _ in range(3):
            assert urllib.request.urlopen(server.http + "/v1/models", timeout=10).status == 200
        assert urllib.request.urlopen(server.http + "/health", timeout=10).status == 200
    finally:
        for s in idle:
            s.close()


def test_http_requests_past_the_limit_are_answered_429_and_probes_still_200(server):
    body = json.dumps({"inputs": ["word " * 250] * 4}).encode()
    slow = []
    for _ in range(LIMIT):  # each holding its request in progress, answers unread
        s = socket.create_connection((server.host, server.http_port))
        s.sendall(b"POST /embed HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                  % len(body) + body)
        slow.append(s)
    try:
        in_flight(server, LIMIT)
        request = urllib.request.Request(server.http + "/embed", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == 429 and e.value.headers["Retry-After"] == "1"
        assert json.loads(e.value.read())["error"]["code"] == "too_many_requests_in_progress"
        assert urllib.request.urlopen(server.http + "/health", timeout=10).status == 200  # the API port's probe
        for s in slow:  # what was admitted is served
            assert s.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        for s in slow:
            s.close()


def test_grpc_calls_past_the_limit_are_refused_at_once_wave_after_wave(server):
    """Two waves: grpc aio's limiter once counted refusals back down past zero (grpc/grpc#41531),
    so a second wave went through."""
    channels = [grpc.insecure_channel(server.target, options=OWN) for _ in range(LIMIT + 1)]
    try:
        for _ in range(2):
            slow = [pb_grpc.InferenceStub(c).Embed.future(SLOW, timeout=60) for c in channels[:LIMIT]]
            in_flight(server, LIMIT)
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as e:
                    pb_grpc.InferenceStub(channels[LIMIT]).HealthCheck(pb.HealthCheckRequest(), timeout=10)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert [f.result().shape[0] for f in slow] == [4] * LIMIT
    finally:
        for c in channels:
            c.close()


def test_streaming_calls_open_without_a_key_are_bounded():
    """Health Watch and reflection hold a call for as long as their caller likes, without a key:
    MAX_OPEN_STREAMS at once, every streaming method together; Check (the probes' call) still
    answers, and so does the API."""
    server = ServerProcess({"MODEL_PATH": "sim:50000"}).wait_ready()
    try:
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            half, done = MAX_OPEN_STREAMS // 2, threading.Event()
            watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(half)]
            listings = [reflection.ServerReflectionInfo(_open_stream(done), timeout=60)
                        for _ in range(MAX_OPEN_STREAMS - half)]
            try:
                for w in watches:
                    assert next(w).status == health_pb2.HealthCheckResponse.SERVING
                for r in listings:
                    assert next(r).list_services_response.service
                for extra in (health.Watch(health_pb2.HealthCheckRequest(), timeout=60),
                              reflection.ServerReflectionInfo(iter([]), timeout=60)):
                    with pytest.raises(grpc.RpcError) as e:
                        next(extra)
                    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING
                assert pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=["hi"]), timeout=10).shape[0] == 1
            finally:
                done.set()
                for call in watches + listings:
                    call.cancel()
    finally:
        server.stop()


def _open_stream(done: threading.Event):
    """A request stream that stays open (after its first message, the next comes when `done`)."""
    yield reflection_pb2.ServerReflectionRequest(list_services="")
    done.wait(60)


def test_a_trickled_body_is_refused_in_time():
    """A body sent a byte at a time is refused once HTTP_BODY_TIMEOUT_S has passed (here 1 s),
    not read for ever."""
    server = ServerProcess({"MODEL_PATH": "sim:50000", "HTTP_BODY_TIMEOUT_S": "1"}).wait_ready()
    try:
        s = socket.create_connection((server.host, server.http_port), timeout=30)
        s.sendall(b"POST /embed HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
        answer = b""
        for _ in range(999):
            try:
                s.sendall(b" ")
            except OSError:
                break
            s.settimeout(0.05)
            try:
                answer += s.recv(4096)
            except TimeoutError:
                continue
            if answer:
                break
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        server.stop()
