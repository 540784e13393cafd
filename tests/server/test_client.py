"""The library client: retries that honour retry-after-ms, and round-robin across pods."""

import asyncio
import re
import urllib.request

import grpc
import pytest

from embedserve.client import Client, retry_after_s
from embedserve.grpc_server import is_retry
from tests.conftest import ServerProcess, free_port

SIM = {"MODEL_PATH": "sim:2000", "BATCH_CAPS": "16:8,32:8,64:4,128:2,256:1,512:1"}


def counter(http, name, **labels):
    text = urllib.request.urlopen(http + "/metrics").read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    labelled = rf"\{{{re.escape(want)}\}}" if want else ""
    m = re.search(rf"^{name}{labelled} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize(
    "metadata, retry",
    [((), False), ((("embedfleet-attempt", "1"),), False), ((("embedfleet-attempt", "2"),), True),
     ((("grpc-previous-rpc-attempts", "1"),), True), ((("grpc-previous-rpc-attempts", "0"),), False)],
)
def test_retries_are_recognised(metadata, retry):
    assert is_retry(metadata) is retry


async def test_overloaded_burst_succeeds_through_retries():
    server = ServerProcess({**SIM, "MAX_DRAIN_TIME_MS": "150"}).wait_ready()
    try:
        async with Client(server.target, max_attempts=30, max_backoff_s=0.5) as client:
            results = await asyncio.gather(*(client.embed([f"burst request number {i}"]) for i in range(150)))
        assert all(r.shape == (1, 384) for r in results)
        assert counter(server.http, "embedfleet_rejected_requests_total", reason="drain_time") > 0
        assert counter(server.http, "embedfleet_requests_total", code="OK", rpc="Embed") == 150
    finally:
        server.stop()


async def test_client_gives_up_after_max_attempts():
    server = ServerProcess({**SIM, "MAX_DRAIN_TIME_MS": "1"}).wait_ready()
    try:
        async with Client(server.target, max_attempts=2, max_backoff_s=0.01) as client:
            outcomes = await asyncio.gather(*(client.embed(["x " * 40]) for _ in range(40)), return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
        assert errors and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors)
        assert all(retry_after_s(e) > 0 for e in errors)
    finally:
        server.stop()


async def test_round_robin_across_pods():
    port = free_port()  # the same port on two addresses, as pods behind a headless Service
    pods = [ServerProcess({**SIM, "BIND_HOST": host, "GRPC_PORT": str(port)}) for host in ("127.0.0.1", "127.0.0.2")]
    try:
        for p in pods:
            p.wait_ready()
        async with Client(f"ipv4:127.0.0.1:{port},127.0.0.2:{port}") as client:
            for i in range(40):
                await client.embed([f"balanced {i}"])
        served = [counter(p.http, "embedfleet_requests_total", code="OK", rpc="Embed") for p in pods]
        assert sum(served) == 40 and min(served) >= 15, served
    finally:
        for p in pods:
            p.stop()
