"""What a serving process holds open at once is bounded (MAX_CONCURRENT_REQUESTS; the health
Watch streams, open without a key, MAX_HEALTH_WATCHES): past the bound a caller is told at once
(HTTP 503, RESOURCE_EXHAUSTED), the metrics port still answers, and what was admitted is served."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.transports.grpc_server import MAX_HEALTH_WATCHES
from tests.conftest import ServerProcess

LIMIT = 3


@pytest.fixture(scope="module")
def server():
    # 2,000 tokens a second: a request of 4 texts of 252 tokens takes half a second of device.
    server = ServerProcess({"MODEL_PATH": "sim:2000", "BATCH_CAPS": "16:4,32:4,64:4,128:4,256:4",
                            "MAX_DRAIN_TIME_MS": "600000", "MAX_CONCURRENT_REQUESTS": str(LIMIT)}).wait_ready()
    yield server
    server.stop()


def test_http_connections_past_the_limit_are_answered_503_and_the_metrics_port_answers(server):
    # uvicorn refuses a request once the connections (its own included) reach the limit.
    held = [socket.create_connection((server.host, server.http_port)) for _ in range(LIMIT - 1)]
    try:
        for s in held:  # each an open connection uvicorn counts, as a keep-alive client's are
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.http + "/v1/models", timeout=10)
        assert e.value.code == 503
        assert urllib.request.urlopen(server.metrics + "/health", timeout=10).status == 200
    finally:
        for s in held:
            s.close()
    assert urllib.request.urlopen(server.http + "/v1/models", timeout=10).status == 200  # room again


def test_grpc_calls_past_the_limit_are_refused_at_once_and_those_admitted_are_served(server):
    # A connection each (gRPC shares one between channels to the same target by default, and one
    # connection's calls past its streams wait for a stream, queued by the client, not refused).
    own = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(server.target, options=own) for _ in range(LIMIT + 1)]
    try:
        slow = [pb_grpc.InferenceStub(c).Embed.future(pb.EmbedRequest(texts=["word " * 250] * 4), timeout=60)
                for c in channels[:LIMIT]]
        deadline = time.monotonic() + 30
        while server.health()[1]["in_flight_requests"] < LIMIT:  # all three inside (1.5 s of device)
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.InferenceStub(channels[LIMIT]).HealthCheck(pb.HealthCheckRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [f.result().shape[0] for f in slow] == [4] * LIMIT
    finally:
        for c in channels:
            c.close()


def test_health_watch_streams_are_bounded():
    """Open without a key (as kubelet's Check must be), each held as long as its caller likes."""
    server = ServerProcess({"MODEL_PATH": "sim:50000"}).wait_ready()
    try:
        watch_many(server)
    finally:
        server.stop()


def watch_many(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(MAX_HEALTH_WATCHES)]
        try:
            for w in watches:  # each open, its first status read
                assert next(w).status == health_pb2.HealthCheckResponse.SERVING
            extra = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
            with pytest.raises(grpc.RpcError) as e:
                next(extra)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Watch" in e.value.details()
            # Check, the probes' call, still answers
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        finally:
            for w in watches:
                w.cancel()
