"""Traces and logs on real processes, in one process and with FRONTENDS=2 alike: the real OTLP/HTTP
exporter sends to a receiver on loopback (bench.otlp_sink, which decodes the OTLP protobufs), real
gRPC and HTTP clients (the openai client) send a W3C traceparent, and the server's own stderr,
LOG_FORMAT=json, is read back line by line.

What a trace must show: the request span (SERVER) is the caller's span's child, in the caller's
trace; admission, tokenization, queue wait, each batch, and the answer are its children, inside it
and in the order the request passed them; a refused request is an error span. What the log must
show: every line a JSON object; a refused request one line with its status, reason and trace id;
a served one a line only because ACCESS_LOG is on."""

from __future__ import annotations

import json
import secrets
import socket
import time

import grpc
import openai
import pytest

from bench.otlp_sink import Sink
from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.server.frontends.test_frontend import children, kill_front_ends
from tests.server.test_reliability import CAPS

MODES = {"one process": {}, "FRONTENDS=2": {"FRONTENDS": "2"}}
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
ERROR = 2  # Status.STATUS_CODE_ERROR
REFUSAL = "embedfleet.refusal"
STAGES = ["admission", "tokenization", "queue wait", "batch", "answer"]


@pytest.fixture(scope="module")
def sink():
    receiver = Sink()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module", params=list(MODES))
def server(request, sink):
    server = ServerProcess({
        "MODEL_PATH": "sim:50000", "BATCH_CAPS": CAPS, "MAX_DRAIN_TIME_MS": "600000",
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
        "LOG_FORMAT": "json", "ACCESS_LOG": "true", **MODES[request.param],
    }).wait_ready()
    fronts = children(server.proc.pid)
    server.mode = request.param
    yield server
    server.stop()
    kill_front_ends(fronts)


def caller_context(sampled: bool = True) -> tuple[str, str, str]:
    """(trace id, the caller's span id, its traceparent header)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def request_span(sink: Sink, trace_id: str, children: int):
    """The trace's request span and its children, once the exporter has sent them all."""
    def complete(s):
        spans = s.trace(trace_id)
        roots = [x for x in spans if x.kind == SERVER_KIND]
        return roots and len(spans) >= 1 + children and (roots[0], [x for x in spans if x is not roots[0]])

    return sink.wait_for(complete, what=f"a request span and {children} children in trace {trace_id}")


def log_lines(server: ServerProcess) -> list[dict]:
    """Every line the server (and its front ends) wrote, each of them JSON."""
    lines = [line for line in server.log().splitlines() if line.strip()]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"a line that is not JSON: {line[:300]}") from None
    return parsed


def request_lines(server: ServerProcess, trace_id: str) -> list[dict]:
    return [line for line in log_lines(server) if line.get("trace_id") == trace_id]


def assert_children_of(root, kids, trace_id: str) -> dict:
    """Each child's parent is the request span, in its trace, inside its time; → name → spans."""
    by_name: dict = {}
    for kid in kids:
        assert (kid.trace_id, kid.parent_span_id) == (trace_id, root.span_id), kid
        assert root.start_ns <= kid.start_ns <= kid.end_ns <= root.end_ns, (kid.name, kid, root)
        by_name.setdefault(kid.name, []).append(kid)
    return by_name


def test_a_grpc_request_continues_the_callers_trace_through_every_stage(server, sink):
    trace_id, parent, header = caller_context()
    texts = ["what is a bucket queue", "the second text of the request"]
    with grpc.insecure_channel(server.target) as channel:
        reply = pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=texts), metadata=(("traceparent", header),))
    assert list(reply.shape) == [2, 384]

    root, kids = request_span(sink, trace_id, children=len(STAGES))
    assert root.name == "embedfleet.v1.Inference/Embed" and root.parent_span_id == parent
    assert root.attributes["rpc.grpc.status_code"] == 0 and root.status_code != ERROR
    assert root.resource["service.name"] == "embedserve"
    assert root.resource["service.instance.id"] == socket.gethostname()  # in Kubernetes, the pod's name
    stages = assert_children_of(root, kids, trace_id)
    assert sorted(stages) == sorted(STAGES), sorted(stages)
    admission, tokenization, queue, answer = (stages[n][0] for n in ("admission", "tokenization", "queue wait", "answer"))
    batches = sorted(stages["batch"], key=lambda b: b.start_ns)
    assert admission.attributes["embedfleet.admission.decision"] == "admitted"
    assert admission.attributes["embedfleet.admission.held_ms"] == 0
    # The order the request passed them: a front end tokenizes before the model process admits
    # the real tokens; one process admits on an estimate, then tokenizes.
    first, second = (admission, tokenization) if server.mode == "one process" else (tokenization, admission)
    assert first.end_ns <= second.start_ns and second.end_ns <= queue.start_ns
    assert queue.end_ns == batches[0].start_ns  # the queue wait ends when its first batch is formed
    assert batches[-1].end_ns <= answer.start_ns
    assert sum(b.attributes["embedfleet.batch.request_rows"] for b in batches) == len(texts)
    for b in batches:
        a = b.attributes
        assert a["embedfleet.batch.id"] >= 1 and a["embedfleet.batch.rows"] >= a["embedfleet.batch.request_rows"]
        assert 0 < a["embedfleet.batch.real_tokens"] <= a["embedfleet.batch.padded_tokens"]
        assert 0 < a["embedfleet.batch.device_ms"] <= b.duration_ms


def test_an_http_request_from_the_openai_client_continues_the_callers_trace(server, sink):
    trace_id, parent, header = caller_context()
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", default_headers={"traceparent": header})
    reply = client.embeddings.create(model="sim:50000", input=["an http request, traced"])
    assert len(reply.data) == 1

    root, kids = request_span(sink, trace_id, children=len(STAGES))
    assert root.name == "POST /v1/embeddings" and root.parent_span_id == parent and root.kind == SERVER_KIND
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["http.route"] == "/v1/embeddings"
    assert sorted(assert_children_of(root, kids, trace_id)) == sorted(STAGES)
    # ACCESS_LOG: one line for the served request, with the caller's trace id.
    line = sink.wait_for(lambda _: request_lines(server, trace_id), what="its access line")[0]
    assert (line["level"], line["method"], line["route"], line["status"]) == ("INFO", "POST", "/v1/embeddings", 200)
    assert line["duration_ms"] > 0 and line["reason"] == ""


async def test_our_client_continues_the_callers_current_trace(server, sink):
    """Our Client injects the caller's current OpenTelemetry context (the API's propagate.inject:
    a span current in the caller's own tracer, no global provider set), and a call's own
    `metadata=` reaches the server: an explicit traceparent there is the caller's word."""
    from opentelemetry.sdk.trace import TracerProvider

    from embedserve.client import Client

    with TracerProvider().get_tracer("the caller").start_as_current_span("caller's work") as span:
        async with Client(server.target) as client:
            assert (await client.embed(["traced by our client"])).shape == (1, 384)
    context = span.get_span_context()
    trace_id, parent = format(context.trace_id, "032x"), format(context.span_id, "016x")
    root, kids = request_span(sink, trace_id, children=len(STAGES))
    assert root.name == "embedfleet.v1.Inference/Embed" and root.parent_span_id == parent
    assert sorted(assert_children_of(root, kids, trace_id)) == sorted(STAGES)

    explicit, parent, header = caller_context()
    async with Client(server.target) as client:
        assert (await client.embed(["traced by the call's metadata"], metadata={"traceparent": header})).shape == (1, 384)
    root, _ = request_span(sink, explicit, children=len(STAGES))
    assert root.parent_span_id == parent


def test_refused_requests_are_spans_with_their_reason_and_one_log_line_each(server, sink):
    trace_id, _, header = caller_context()
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=["fine", " "]), metadata=(("traceparent", header),))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", default_headers={"traceparent": header},
                           max_retries=0)
    with pytest.raises(openai.NotFoundError):  # an error the route answers itself
        client.embeddings.create(model="not-this-one", input="text")
    with pytest.raises(openai.UnprocessableEntityError):  # the schema's
        client.embeddings.create(model="sim:50000", input=[" "])

    spans = sink.wait_for(lambda s: len([x for x in s.trace(trace_id) if x.kind == SERVER_KIND]) == 3
                          and s.trace(trace_id), what="three refused request spans")
    roots = {x.name + f" {x.attributes.get('http.response.status_code', '')}": x for x in spans if x.kind == SERVER_KIND}
    assert sorted(roots) == ["POST /v1/embeddings 404", "POST /v1/embeddings 422", "embedfleet.v1.Inference/Embed "]
    # Refusals, not the server's failures (OpenTelemetry's conventions): no error status, the reason an attribute.
    assert all(x.status_code != ERROR for x in roots.values())
    assert "texts[1] is empty or whitespace only" in roots["embedfleet.v1.Inference/Embed "].attributes[REFUSAL]
    assert "model 'not-this-one' is not served here" in roots["POST /v1/embeddings 404"].attributes[REFUSAL]
    assert roots["embedfleet.v1.Inference/Embed "].attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]

    lines = sink.wait_for(lambda _: len(request_lines(server, trace_id)) >= 3 and request_lines(server, trace_id),
                          what="three refusal lines")
    assert len(lines) == 3  # one line each, no more
    by_status = {line["status"]: line for line in lines}
    assert by_status["INVALID_ARGUMENT"]["rpc"] == "Embed"
    assert "texts[1] is empty or whitespace only" in by_status["INVALID_ARGUMENT"]["reason"]
    assert (by_status[404]["route"], by_status[422]["route"]) == ("/v1/embeddings", "/v1/embeddings")
    assert "is not served here" in by_status[404]["reason"] and "input" in by_status[422]["reason"]
    assert all(line["level"] == "INFO" for line in lines)  # refusals: INFO (failures WARNING)


def test_a_request_without_a_traceparent_starts_a_trace_its_log_line_names(server, sink):
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError):
            pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=["", "untraced caller"]))
    line = sink.wait_for(lambda _: [x for x in log_lines(server) if x.get("rpc") == "Embed" and "texts[0]" in x["reason"]],
                         what="the refusal's line")[0]
    assert len(line["trace_id"]) == 32
    root = sink.wait_for(lambda s: [x for x in s.trace(line["trace_id"]) if x.kind == SERVER_KIND],
                         what="the span its line names")[0]
    assert root.parent_span_id == "" and "texts[0]" in root.attributes[REFUSAL]  # a root: the trace starts here


def test_a_caller_that_samples_out_gets_no_spans_and_its_line_keeps_its_trace_id(server, sink):
    """A caller's traceparent without the sampled flag: the default sampler (parent-based)
    records nothing here, and a refusal's line still names the caller's trace (read from its
    header: no span is made)."""
    trace_id, _, header = caller_context(sampled=False)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        stub.Embed(pb.EmbedRequest(texts=["sampled out"]), metadata=(("traceparent", header),))
        with pytest.raises(grpc.RpcError):
            stub.Embed(pb.EmbedRequest(texts=[" "]), metadata=(("traceparent", header),))
    lines = sink.wait_for(lambda _: len(request_lines(server, trace_id)) >= 2 and request_lines(server, trace_id),
                          what="its two lines")
    assert sorted(line["status"] for line in lines) == ["INVALID_ARGUMENT", "OK"]
    # A traced request sent after it has been exported: so would its spans have been.
    later, _, traced = caller_context()
    with grpc.insecure_channel(server.target) as channel:
        pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=["traced"]), metadata=(("traceparent", traced),))
    request_span(sink, later, children=len(STAGES))
    assert sink.trace(trace_id) == []


def test_every_line_of_the_server_is_json(server):
    lines = log_lines(server)
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    assert any(line["message"].startswith("ready: dimension") for line in lines)
    if server.mode != "one process":
        assert any(line.get("process") == "frontend" for line in lines)


def test_a_collector_that_does_not_answer_costs_requests_nothing_and_the_stop_two_seconds():
    """Spans for a collector that is not there: requests are served as ever (exports fail on
    the exporter's thread, and spans past its queue are dropped), and SIGTERM still exits 0
    promptly: the last flush is bounded (the SDK's own waits out its retries, ~10 s, and at exit
    up to 30 s)."""
    from tests.conftest import free_port

    server = ServerProcess({"MODEL_PATH": "sim:50000", "BATCH_CAPS": CAPS, "SHUTDOWN_GRACE_S": "1",
                            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"}).wait_ready()
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            for i in range(20):
                assert list(stub.Embed(pb.EmbedRequest(texts=[f"text {i}"]), timeout=10).shape) == [1, 384]
    finally:
        t0 = time.monotonic()
        code = server.stop()
    assert code == 0 and time.monotonic() - t0 < 1 + 2 + 3, server.log()[-2000:]  # grace, flush, the rest
    assert "spans not exported within 2 s of the stop are dropped" in server.log()


def test_a_method_outside_http_is_other_in_its_span(server, sink):
    """OpenTelemetry's HTTP conventions: a caller's own method token names no span."""
    import http.client
    import urllib.parse

    trace_id, _, header = caller_context()
    url = urllib.parse.urlsplit(server.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("BREW", "/v1/embeddings", headers={"traceparent": header})
    assert conn.getresponse().status == 405
    conn.close()
    spans = sink.wait_for(lambda s: [x for x in s.trace(trace_id) if x.kind == SERVER_KIND], what="the request span")
    assert spans[0].name == "HTTP /v1/embeddings"
    assert spans[0].attributes["http.request.method"] == "_OTHER"
    assert spans[0].attributes["http.request.method_original"] == "BREW"
