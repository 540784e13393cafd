"""The server's edges on real processes: a device that hangs, texts and bodies far too large,
SIGTERM in every phase, the HTTP API while starting, and TEI's clients unchanged."""

import http.client
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.model.simulated import HANG_TOKEN
from tests.conftest import ServerProcess
from tests.server.test_reliability import CAPS, infer_request, serving

SIM = {"MODEL_PATH": "sim:50000", "BATCH_CAPS": CAPS}


def post(url, body: bytes, headers=None):
    req = urllib.request.Request(url, body, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read() or b"{}")


def stopped_within(server: ServerProcess, seconds: float) -> int:
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(30)
    elapsed = time.monotonic() - t0
    assert elapsed < seconds, f"exited after {elapsed:.1f} s"
    server.stop()
    return code


def test_a_hung_device_fails_its_requests_and_health_asks_for_a_restart():
    server = ServerProcess({**SIM, "WATCHDOG_FLOOR_S": "1", "WATCHDOG_MULTIPLE": "2"}).wait_ready()
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.target))
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.Infer(infer_request([101, HANG_TOKEN, 102]), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "stopped responding" in e.value.details()
        assert time.monotonic() - t0 < 10
        code, fields = server.health()
        assert code == 503 and fields["status"] == "degraded"
        assert serving(server.target) == health_pb2.HealthCheckResponse.NOT_SERVING  # liveness restarts it
        with pytest.raises(grpc.RpcError) as e:  # new work goes elsewhere at once
            stub.Embed(pb.EmbedRequest(texts=["anyone there?"]), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert stopped_within(server, 2.0) == 0  # the stuck device thread does not hold the exit


def test_sigterm_while_warming_up_exits_at_once():
    server = ServerProcess({"MODEL_PATH": "sim:200", "BATCH_CAPS": "16:64,32:64,64:64,128:64,256:64"})
    deadline, status = time.monotonic() + 60, None
    while time.monotonic() < deadline and status != "starting":  # up, warming up for tens of seconds
        try:
            status = server.health()[1].get("status")
        except OSError:
            pass
        time.sleep(0.05)
    assert status == "starting"
    assert stopped_within(server, 2.0) == 0


def test_sigterm_while_downloading_exits_at_once():
    """The model store accepts the connection and never answers (a stuck download)."""
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(16)
    port = blackhole.getsockname()[1]
    server = ServerProcess({"MODEL_PATH": "s3://models/stuck", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                            "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        deadline, status = time.monotonic() + 60, None
        while time.monotonic() < deadline and status is None:
            try:
                status, _ = server.health()
            except OSError:
                time.sleep(0.05)
        assert status == 503
        status, headers, body = post(server.http + "/v1/embeddings", b'{"model": "x", "input": "hi"}')
        assert status == 503 and headers["Retry-After"] == "5" and "warming up" in body["error"]["message"]
        assert stopped_within(server, 2.0) == 0
    finally:
        blackhole.close()


def test_sigterm_behind_a_client_that_never_finishes_its_body_exits_within_the_grace():
    """uvicorn's graceful stop waits for every connection's request to finish: a client that
    sends its headers and never its whole body held the process for ever (until a SIGKILL)."""
    server = ServerProcess({**SIM, "SHUTDOWN_GRACE_S": "2"}).wait_ready()
    try:
        with socket.create_connection((server.host, server.http_port)) as slow:
            slow.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"inputs\": ")
            # Answered after those bytes arrived, on the same event loop: they have been read.
            assert server.health()[0] == 200
            assert stopped_within(server, 2 + 5) == 0
    finally:
        server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def small_body_server():
    server = ServerProcess({**SIM, "HTTP_MAX_BODY_BYTES": str(64 * 1024), "MAX_DRAIN_TIME_MS": "600000"}).wait_ready()
    yield server
    server.stop()


def test_an_oversized_http_body_is_413_and_the_server_keeps_serving(small_body_server):
    big = json.dumps({"inputs": "word " * 20_000}).encode()  # 100 KiB
    req = urllib.request.Request(small_body_server.http + "/embed", big, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 413
    # No Content-Length (chunked): refused once the bytes pass the limit.
    conn = http.client.HTTPConnection(small_body_server.host, small_body_server.http_port, timeout=30)
    conn.request("POST", "/embed", body=iter([big[i:i + 8192] for i in range(0, len(big), 8192)]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    assert conn.getresponse().status == 413
    status, _, vectors = post(small_body_server.http + "/embed", b'{"inputs": "still serving"}')
    assert status == 200 and len(vectors[0]) == 384


def sent_whole_then_answered(host: str, port: int, path: str, body: bytes, chunked: bool = False) -> int:
    """The status of a POST whose body was all sent before its answer is read: as a client that
    writes its request and only then reads (most do). A server that answers early and closes with
    the body unread has the kernel reset the connection: the send fails, or the answer is lost."""
    with socket.create_connection((host, port), timeout=30) as sock:
        length = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body)
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\n%s\r\nConnection: close\r\n\r\n" % (path.encode(), length))
        if chunked:
            for i in range(0, len(body), 1 << 16):
                sock.sendall(b"%x\r\n%s\r\n" % (len(body[i:i + (1 << 16)]), body[i:i + (1 << 16)]))
            sock.sendall(b"0\r\n\r\n")
        else:
            sock.sendall(body)
        response = http.client.HTTPResponse(sock, method="POST")
        response.begin()
        response.read()
        return response.status


def test_a_refused_body_is_read_and_dropped_so_its_answer_arrives(small_body_server):
    # 12 MiB: more than loopback's socket buffers hold, so an unread remainder is certain at close
    body = json.dumps({"inputs": "word " * (12 * 2**20 // 5)}).encode()
    host, api, metrics = small_body_server.host, small_body_server.http_port, small_body_server.metrics_port
    assert sent_whole_then_answered(host, api, "/embed", body) == 413
    assert sent_whole_then_answered(host, api, "/embed", body, chunked=True) == 413
    assert sent_whole_then_answered(host, metrics, "/health", body) == 404  # the metrics port reads no body
    # A caller that waits for 100 Continue before its body: refused at once, never asked for it
    for port, path in ((api, "/embed"), (metrics, "/health")):
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n"
                         % (path.encode(), len(body)))
            assert sock.recv(64).startswith(b"HTTP/1.1 413" if port == api else b"HTTP/1.1 404"), path
    status, _, vectors = post(small_body_server.http + "/embed", b'{"inputs": "still serving"}')
    assert status == 200 and len(vectors[0]) == 384


def test_token_ids_outside_int32_are_a_400(small_body_server):
    body = json.dumps({"model": "sim:50000", "input": [[101, 2**31, 102]]}).encode()
    status, _, reply = post(small_body_server.http + "/v1/embeddings", body)
    assert status == 400 and "token ids must be in [0, 30522)" in reply["error"]["message"]
    status, _, reply = post(small_body_server.http + "/v1/embeddings", body.replace(b"2147483648", b"99999999999999999999999"))
    assert status == 400


def test_a_lone_surrogate_is_refused_by_name_and_the_server_keeps_serving(small_body_server):
    """JSON may carry a lone surrogate, which no tokenizer (nor UTF-8) can read: the schema
    refuses it (422, the field named), and the answer, which echoes the input, is still sent
    (it was a 500: the echo could not be encoded)."""
    for path, body in (("/v1/embeddings", b'{"model": "sim:50000", "input": ["fine", "bad \\ud800 text"]}'),
                       ("/embed", b'{"inputs": "bad \\udfff"}')):
        status, _, reply = post(small_body_server.http + path, body)
        assert status == 422 and "unicode" in json.dumps(reply), reply
    status, _, vectors = post(small_body_server.http + "/embed", b'{"inputs": "still serving"}')
    assert status == 200 and len(vectors[0]) == 384


def test_a_huge_text_costs_about_what_a_full_length_text_costs(default_server):
    """The tokenizer reads a whole text before truncating: a 4 MiB text is cut at a bound from
    max_seq_length first. Same vectors as the text cut there, at a comparable cost."""
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(default_server.target))
    words = " ".join(f"token{i % 97}" for i in range(800_000))[: 4 << 20]  # 4 MiB
    cut = words[: 256 * 16]

    def timed(text):
        t0 = time.perf_counter()
        out = np.frombuffer(stub.Embed(pb.EmbedRequest(texts=[text]), timeout=60).embeddings, "<f4")
        return out, time.perf_counter() - t0

    huge, huge_s = min((timed(words) for _ in range(3)), key=lambda r: r[1])
    full, full_s = min((timed(cut) for _ in range(3)), key=lambda r: r[1])
    np.testing.assert_allclose(huge, full, atol=1e-6)
    assert huge_s < 5 * full_s + 0.2, (huge_s, full_s)  # before the bound: 4.6 s against ~20 ms


TEI_CLIENT = """
import json, sys
import numpy as np
from huggingface_hub import InferenceClient
client = InferenceClient(model=sys.argv[1])
one = client.feature_extraction("embeddings for everyone")
two = client.feature_extraction(["one", "two"])
print(json.dumps({"one": np.asarray(one).tolist(), "two_shape": list(np.asarray(two).shape)}))
"""


def test_tei_clients_work_unchanged(default_server, reference):
    """huggingface_hub's InferenceClient, as a user runs it (its own process, no HF_HUB_OFFLINE: it
    refuses every URL offline, loopback too), posts to the URL it is given: TEI serves its task at /."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    out = subprocess.run([sys.executable, "-c", TEI_CLIENT, default_server.http], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["two_shape"] == [2, 384]
    assert np.abs(np.array(got["one"]) - reference.embed(["embeddings for everyone"])).max() <= 1e-5


def test_tokenizer_threads_are_never_held_by_a_long_text(default_server):
    """Many huge texts at once still leave room for a short request."""
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(default_server.target))
    huge = "x" * (1 << 20)
    results = []
    threads = [threading.Thread(target=lambda: results.append(stub.Embed(pb.EmbedRequest(texts=[huge] * 4), timeout=60)))
               for _ in range(4)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    stub.Embed(pb.EmbedRequest(texts=["short"]), timeout=60)
    short_s = time.perf_counter() - t0
    for t in threads:
        t.join()
    assert len(results) == 4 and short_s < 10
