"""The Gateway API Inference Extension's two model-server gauges on real processes, in one
process and with FRONTENDS=2 alike: embedfleet_queued_requests and embedfleet_running_requests,
scraped from the metrics port (where an endpoint picker reads them) while a slow simulated device
computes one request at a time."""

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess

MODES = {"one process": {}, "FRONTENDS=2": {"FRONTENDS": "2"}}
# One bucket of one row: each batch is one request's one text of ~60 tokens, ~0.25 s on a device
# of 250 tokens/s (the warm-up, one bucket at its fixed cap, sleeps two of those). Admission never
# refuses (a 600 s budget): every request sent is queued.
ENV = {"MODEL_PATH": "sim:250", "BUCKETS": "64", "BATCH_CAPS": "64:1", "MAX_DRAIN_TIME_MS": "600000"}
N = 5
GAUGES = ("embedfleet_queued_requests", "embedfleet_running_requests")


@pytest.fixture(scope="module", params=list(MODES), ids=list(MODES))
def server(request):
    server = ServerProcess({**ENV, **MODES[request.param]}).wait_ready()
    yield server
    server.stop()


def gauges(server) -> tuple[float, float]:
    """(queued, running) from one scrape of the metrics port, with prometheus_client's parser."""
    text = urllib.request.urlopen(server.metrics + "/metrics", timeout=10).read().decode()
    found = {s.name: s.value for f in text_string_to_metric_families(text) if f.name in GAUGES for s in f.samples}
    assert set(found) == set(GAUGES), f"missing from /metrics: {set(GAUGES) - set(found)}"
    assert all(f.type == "gauge" for f in text_string_to_metric_families(text) if f.name in GAUGES)
    return found["embedfleet_queued_requests"], found["embedfleet_running_requests"]


async def test_running_is_the_request_on_the_device_and_queued_the_rest(server):
    assert gauges(server) == (0, 0)  # idle
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        calls = [asyncio.ensure_future(stub.Embed(pb.EmbedRequest(texts=[f"gauge {i} " + "token " * 55]), timeout=60))
                 for i in range(N)]
        samples = []  # (answered before the scrape, queued, running, answered after it)
        while not all(c.done() for c in calls):
            before = sum(c.done() for c in calls)
            queued, running = await asyncio.to_thread(gauges, server)
            samples.append((before, queued, running, sum(c.done() for c in calls)))
        for call in calls:
            assert tuple(call.result().shape)[0] == 1
    for before, queued, running, _ in samples:
        # One row a batch, one text a request: at most one request is computed at a time, and the
        # server counts no request its caller already has the answer to.
        assert running in (0, 1) and 0 <= queued and queued + running <= N - before, samples
    # While a batch ran and no answer arrived around the scrape: one running, all the rest queued.
    steady = [(queued, running, N - before) for before, queued, running, after in samples if before == after]
    assert any(running == 1 and queued == waiting - 1 >= 1 for queued, running, waiting in steady), samples
    # Every answer left the model process after its request was counted off: idle again at once.
    assert gauges(server) == (0, 0)
