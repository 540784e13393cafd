"""embedserve.tracing's parts that need no exporter: the stages a Recorder becomes (the real gate
stamping it: admitted, refused with room booked, held, a retry claiming its booking), the stamps
crossing from the model process to a front end, trace ids from a caller's header, and tracing off
costing no import of the SDK. Spans through a real exporter: test_traces_and_logs.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from embedserve.admission.gate import Caller
from embedserve.errors import Overloaded
from embedserve.tracing import Recorder, stages, traceparent_trace_id
from tests.server.admission.test_gate import gate


def by_name(rec: Recorder, end: float) -> dict:
    return {name: (start, stop, attrs, error) for name, start, stop, attrs, error in stages(rec, end)}


async def admit(g, key: int, caller: Caller) -> None:
    """As the service stamps admission around the gate."""
    caller.trace.admitting()
    await g.admit(key, 100, caller)
    caller.trace.admitted()


async def test_a_refusal_with_room_booked_is_an_admission_span_naming_the_refusal_and_the_booking():
    g, _ = gate()
    rec = Recorder()
    with pytest.raises(Overloaded) as refused:
        await admit(g, 1, Caller(trace=rec))
    start, stop, attrs, error = by_name(rec, end=rec.admission[0] + 0.5)["admission"]
    # Refused: said by its decision, not an error status (OpenTelemetry's server conventions).
    assert not error and attrs["embedfleet.admission.decision"] == "refused"
    assert attrs["embedfleet.admission.booked_ms"] == pytest.approx(refused.value.retry_after_ms)
    assert stop == start + 0.5  # its admission ended with the request


async def test_a_held_caller_and_a_retry_on_its_moment_say_so():
    g, clock = gate()
    held = Recorder()
    await admit(g, 1, Caller(waits=True, trace=held))  # held the booked 0.1 s of real time
    _, _, attrs, error = by_name(held, end=held.admission[1])["admission"]
    assert not error and attrs["embedfleet.admission.decision"] == "held"
    assert attrs["embedfleet.admission.booked_ms"] == pytest.approx(100)
    assert attrs["embedfleet.admission.held_ms"] >= 90

    with pytest.raises(Overloaded):
        await g.admit(2, 100, Caller())
    clock.t += 0.2
    g.estimator.computed(real_tokens=200, busy_s=0.2)
    retry = Recorder()
    await admit(g, 2, Caller(retry=True, trace=retry))
    assert by_name(retry, end=retry.admission[1])["admission"][2]["embedfleet.admission.decision"] == "claimed"


def test_the_model_processs_stamps_cross_to_the_front_end_as_they_were():
    """FRONTENDS > 1: admission, queue and batches are stamped in the model process, sent back as
    JSON with the answer, and become the same spans in the front end; a refused admission is
    closed when the model process answers."""

    class Batch:
        id, rows, real_tokens, padded_tokens, formed, started = 7, 3, 40, 48, 10.0, 10.5

    model = Recorder()
    model.admission = [9.0, 9.5]
    model.queued = 9.6
    model.batch_ran(Batch, rows=2, device_s=0.25)
    model.batch_ran(Batch, rows=1, device_s=0.25)  # a packed batch routes a request's chunks apiece
    front = Recorder(started=8.0)
    front.tokenization = (8.1, 8.9, 1, 0.0)
    front.merge(json.loads(json.dumps(model.to_wire())))
    front.answered()
    spans = by_name(front, end=front.result + 0.01)
    assert list(spans) == ["admission", "tokenization", "queue wait", "batch", "answer"]
    assert spans["queue wait"][:2] == (9.6, 10.0)  # until its batch was formed
    batch = spans["batch"][2]
    assert (batch["embedfleet.batch.id"], batch["embedfleet.batch.request_rows"]) == (7, 3)
    assert (batch["embedfleet.batch.real_tokens"], batch["embedfleet.batch.padded_tokens"]) == (40, 48)
    assert batch["embedfleet.batch.waited_ms"] == pytest.approx(500)  # formed → the device began

    refused = Recorder()
    refused.admitting()
    wire = json.loads(json.dumps(refused.to_wire()))
    assert len(wire["admission"]) == 2 and wire["decision"] == "refused"


@pytest.mark.parametrize("header, trace_id", [
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "4bf92f3577b34da6a3ce929d0e0e4736"),
    ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-00", "4bf92f3577b34da6a3ce929d0e0e4736"),
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", ""),  # all zeros: invalid (W3C)
    ("00-4bf92f3577b34da6-00f067aa0ba902b7-01", ""),
    ("garbage", ""),
    (None, ""),
])
def test_a_callers_trace_id_is_read_from_its_traceparent(header, trace_id):
    assert traceparent_trace_id(header) == trace_id


def test_with_tracing_off_serving_imports_nothing_of_the_sdk():
    """Off (no OTLP endpoint), a server that has answered gRPC and HTTP requests has not imported
    the OpenTelemetry SDK or its exporter (FastAPI imports the API package for telemetry of its
    own, which the server turns off)."""
    script = textwrap.dedent("""
        import asyncio, json, sys, urllib.request
        import grpc
        from embedfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
        from embedserve import tracing
        from embedserve.app import Server
        from embedserve.config import Settings

        async def main():
            settings = Settings.from_env({"MODEL_PATH": "sim:50000", "GRPC_PORT": "0", "HTTP_HEALTH_PORT": "0",
                                          "BIND_HOST": "127.0.0.1", "BATCH_CAPS": "16:8,32:8,64:8,128:4,256:2,512:1",
                                          "WARM_START": "false"})
            assert not tracing.setup(settings)
            server = Server(settings)
            await server.start()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.transports.grpc_port}") as channel:
                await pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=["off"]),
                                                           metadata=(("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),))
            body = json.dumps({"model": "sim:50000", "input": "off"}).encode()
            url = f"http://127.0.0.1:{server.transports.http.port}/v1/embeddings"
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=30).read())
            await server.stop(grace=0)
            print(json.dumps(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")))))

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_only_the_tracing_module_imports_opentelemetry():
    """The stages stamp a Recorder they are handed; none imports OpenTelemetry, so none can put
    it on the request path (tracing.py itself imports it only in setup, begin and finish)."""
    import ast
    from pathlib import Path

    import embedserve

    importers = set()
    for path in Path(embedserve.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "opentelemetry" for n in names):
                importers.add(path.name)
    assert importers == {"tracing.py"}
