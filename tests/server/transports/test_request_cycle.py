"""An HTTP request whose caller leaves is cancelled where it is, as a gRPC call is: on real
processes, one process and FRONTENDS=2. Five /embed calls of 20,200 tokens in all, on a device
that computes 2,000 tokens a second, whose sockets close after 50 ms: before, all 20,200 were
computed (10 s of device time for nobody); now their rows leave the queue, and each is counted
with status 499."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.conftest import ServerProcess, counter
from tests.server.frontends.test_frontend import children, kill_front_ends

MODES = {"one process": {}, "FRONTENDS=2": {"FRONTENDS": "2"}}
TEXT = "word " * 250  # 252 tokens with [CLS] and [SEP]


@pytest.fixture(scope="module", params=list(MODES))
def slow_server(request):
    server = ServerProcess({"MODEL_PATH": "sim:2000", "BATCH_CAPS": "16:4,32:4,64:4,128:4,256:4",
                            "MAX_DRAIN_TIME_MS": "600000", **MODES[request.param]}).wait_ready()
    fronts = children(server.proc.pid)
    yield server
    server.stop()
    kill_front_ends(fronts)


def leave_after(server: ServerProcess, body: bytes, seconds: float) -> None:
    """Send a whole request, then close the socket without reading its answer."""
    sock = socket.create_connection((server.host, server.http_port))
    sock.sendall(b"POST /embed HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(seconds)  # the caller's own timeout: the scenario, not a synchronisation
    sock.close()


def idle(server: ServerProcess, timeout: float = 60.0) -> None:
    """Until nothing is queued or in flight on the model process."""
    deadline = time.monotonic() + timeout
    while True:
        health = server.health()[1]
        if health["in_flight_requests"] == 0 and health["queued_tokens"] == 0:
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.05)


def test_a_caller_that_leaves_is_not_computed_for(slow_server):
    body = json.dumps({"inputs": [TEXT] * 16}).encode()  # 16 × 252 = 4,032 tokens
    idle(slow_server)
    computed = counter(slow_server.metrics, "embedfleet_tokens_total", kind="real")
    gone = counter(slow_server.metrics, "embedfleet_requests_total", rpc="HTTP /embed", code="499")
    for _ in range(5):
        leave_after(slow_server, body, 0.05)
    idle(slow_server)
    computed = counter(slow_server.metrics, "embedfleet_tokens_total", kind="real") - computed
    # What was on the device or formed for it when the callers left (a batch of 4 rows is 1,008
    # tokens, half a second here), not the 20,160 they asked for.
    assert computed <= 3 * 1008, computed
    assert counter(slow_server.metrics, "embedfleet_requests_total", rpc="HTTP /embed", code="499") - gone == 5
    assert slow_server.health()[0] == 200


def test_a_grpc_call_past_its_deadline_is_not_computed_for_either(slow_server):
    """gRPC cancels a call at its deadline; with FRONTENDS > 1 that cancel must reach the model
    process: the front end's link had never sent it (a task cancelled while it awaits a future
    cancels the future too, and the link only sent a cancel for a future not done)."""
    import grpc

    from embedfleet.v1 import inference_pb2 as pb
    from embedfleet.v1 import inference_pb2_grpc as pb_grpc

    idle(slow_server)
    computed = counter(slow_server.metrics, "embedfleet_tokens_total", kind="real")
    with grpc.insecure_channel(slow_server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for _ in range(5):
            with pytest.raises(grpc.RpcError) as e:
                stub.Embed(pb.EmbedRequest(texts=[TEXT] * 16), timeout=0.3)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    idle(slow_server)
    # Each call's batch on the device when its deadline passed (0.3 s of a 0.5 s batch) and the one
    # formed behind it, at most: not the 20,160 tokens asked for.
    assert counter(slow_server.metrics, "embedfleet_tokens_total", kind="real") - computed <= 5 * 2 * 1008
