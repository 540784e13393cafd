"""`embedfleet-drain-ms` (transports/drain.py) on real processes, in one process and with
FRONTENDS=2: every answer of the API carries the pod's backlog as it is when the answer leaves,
gRPC as trailing metadata and HTTP as a header, refusals included; it grows while a queue builds
on a slow simulated device, and the metrics port does not carry it."""

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.transports.drain import HEADER, drain_ms
from tests.conftest import ServerProcess, make_text
from tests.server.frontends.test_frontend import children, kill_front_ends

MODES = {"one process": {}, "FRONTENDS=2": {"FRONTENDS": "2"}}
SIM_RATE = 4000  # tokens/s: a burst of long texts is a queue of a second or more
CAPS = "16:8,32:8,64:8,128:4,256:2,512:1"
MAX_DRAIN_MS = 1000  # a burst past it is refused: refusals carry the estimate too


@pytest.fixture(scope="module", params=list(MODES))
def server(request):
    server = ServerProcess({"MODEL_PATH": f"sim:{SIM_RATE}", "BATCH_CAPS": CAPS, "MAX_DRAIN_TIME_MS": str(MAX_DRAIN_MS),
                            **MODES[request.param]}).wait_ready()
    fronts = children(server.proc.pid)
    yield server
    server.stop()
    kill_front_ends(fronts)


def drain_of(metadata) -> float:
    values = [v for k, v in metadata or () if k == HEADER]
    assert len(values) == 1, metadata
    return float(values[0])


def http(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def test_the_value_is_milliseconds_with_one_decimal_and_unknown_is_capped():
    assert drain_ms(0.0) == "0.0" and drain_ms(0.01234) == "12.3"
    assert drain_ms(float("inf")) == "1000000000.0" and drain_ms(5e6) == "1000000000.0"


async def test_every_grpc_answer_carries_it_refusals_and_health_included(server):
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        call = stub.Embed(pb.EmbedRequest(texts=["an idle pod"]))
        await call
        assert drain_of(await call.trailing_metadata()) == 0.0  # nothing queued ahead of an idle pod's answer
        call = stub.HealthCheck(pb.HealthCheckRequest())
        await call
        drain_of(await call.trailing_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Embed(pb.EmbedRequest(texts=["x"], encoding=99))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        drain_of(refused.value.trailing_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as wrong_task:
            await stub.Rerank(pb.RerankRequest(query="q", texts=["t"]))
        assert wrong_task.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        drain_of(wrong_task.value.trailing_metadata())


def test_every_http_api_answer_carries_it_and_the_metrics_port_does_not(server):
    status, headers = http(server.http + "/v1/embeddings", {"model": f"sim:{SIM_RATE}", "input": ["an idle pod"]})
    assert status == 200 and float(headers[HEADER]) == 0.0
    for path, body in (("/v1/embeddings", {"model": f"sim:{SIM_RATE}", "input": []}), ("/embed", {"inputs": 7})):
        status, headers = http(server.http + path, body)
        assert status in (400, 422) and HEADER in headers, (path, status, headers)
    assert HEADER in http(server.http + "/v1/models")[1]
    assert HEADER not in http(server.metrics + "/health")[1]
    assert HEADER not in http(server.metrics + "/metrics")[1]


async def test_it_grows_while_a_queue_builds_and_overload_refusals_carry_it(server):
    """A burst of long texts, ~2.5 s of the device's time, sent at once by callers that do not wait
    for booked room: some are admitted (the queue a refusal reports), the rest refused. While it
    drains, an answer the server gives at once (an invalid request) says how much is queued ahead;
    once drained, 0 again."""
    rng = np.random.default_rng(0)
    texts = [make_text(rng, 120) for _ in range(80)]
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one(text):
            call = stub.Embed(pb.EmbedRequest(texts=[text]), timeout=30)
            try:
                await call
                return "OK", drain_of(await call.trailing_metadata())
            except grpc.aio.AioRpcError as e:
                return e.code().name, drain_of(e.trailing_metadata())

        async def probe() -> float:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Embed(pb.EmbedRequest(texts=["x"], encoding=99))
            return drain_of(refused.value.trailing_metadata())

        # Probed all the while the burst is served, not once when /health first shows a queue:
        # on a loaded VM that one probe could land as the queue emptied (or, with FRONTENDS=2,
        # before the front end's view of the backlog caught up), and read 0.
        burst = asyncio.ensure_future(asyncio.gather(*(one(t) for t in texts)))
        during = []
        while not burst.done():
            during.append(await probe())
            await asyncio.sleep(0.02)  # the probes' pace, not a wait for anything
        outcomes = await burst
        after = await probe()
    assert max(during) > 50, during  # tens of long texts ahead at 4,000 tokens/s: hundreds of ms
    assert after == 0.0
    refusals = [ms for code, ms in outcomes if code == "RESOURCE_EXHAUSTED"]
    assert refusals and min(refusals) > 0, outcomes  # refused because the queue was long: it says how long
    assert any(code == "OK" for code, _ in outcomes)
    status, headers = http(server.http + "/v1/embeddings", {"model": f"sim:{SIM_RATE}", "input": ["after"]})
    assert status == 200 and float(headers[HEADER]) == 0.0
