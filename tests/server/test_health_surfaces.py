"""A terminal failure turns every health surface, in one process and behind front ends: HTTP
/health (503, degraded), the HealthCheck RPC (degraded, not accepting) and grpc.health.v1
(NOT_SERVING, what a Kubernetes gRPC liveness probe reads). The model's server runs in the
test's own process so that a fault can be put into it (a bug in the batcher, the model worker's
thread ending: no request can cause either); the transports, and in the FRONTENDS case the
front-end process and its link, are the real ones."""

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.__main__ import FrontEnds
from embedserve.app import Server
from embedserve.config import Settings
from embedserve.frontends.door import ModelDoor
from embedserve.errors import NotReady
from embedserve.admission.gate import Caller
from tests.conftest import free_port
from tests.server.frontends.test_frontend import kill_front_ends
from tests.server.test_reliability import CAPS


def http_health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


@pytest.fixture
async def served(request, monkeypatch, tmp_path):
    """→ (the model's Server, gRPC target, HTTP URL). Ports and model from the environment, as
    `python -m embedserve` reads them (a front end inherits it)."""
    env = {"MODEL_PATH": "sim:50000", "BATCH_CAPS": CAPS, "BIND_HOST": "127.0.0.1", "GRPC_PORT": str(free_port()),
           "HTTP_HEALTH_PORT": str(free_port()), "METRICS_PORT": str(free_port()), "MAX_DRAIN_TIME_MS": "600000"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = Settings.from_env()
    target, url = f"127.0.0.1:{settings.grpc_port}", f"http://127.0.0.1:{settings.http_port}"
    if request.param == 1:
        server = Server(settings)
        await server.start()
        try:
            yield server, target, url
        finally:
            await server.stop(grace=0)
        return
    server = Server(settings, listen=False)  # as __main__ wires FRONTENDS > 1
    door = ModelDoor(server, str(tmp_path / "model.ipc"))
    door.start()
    fronts = FrontEnds(request.param, str(tmp_path / "model.ipc"))
    fronts.start()
    try:
        await server.start()

        async def healthy():
            try:
                return (await asyncio.to_thread(http_health, url))[0] == 200
            except OSError:
                return False

        await until(healthy, "the front ends did not serve")
        yield server, target, url
    finally:
        await fronts.stop(5)
        kill_front_ends([p.pid for p in fronts.procs])
        await server.stop(grace=0)
        await door.close()


def bug(*_):
    raise RuntimeError("a bug")


async def break_batcher(server) -> None:
    server.engine.queues.views = bug  # the batcher's next look fails


async def end_worker(server) -> None:
    await asyncio.to_thread(server.engine.worker.stop, 5)  # its thread ends (its stop sentinel)


@pytest.mark.parametrize("served, fault, message", [
    (1, break_batcher, "batcher failed"),
    (1, end_worker, "model worker stopped"),
    (2, break_batcher, "batcher failed"),
], ids=["one process, batcher", "one process, worker", "FRONTENDS=2, batcher"], indirect=["served"])
async def test_a_terminal_failure_turns_every_health_surface(served, fault, message):
    """What waited was never computed: it fails UNAVAILABLE, which the Client retries on another
    pod (a batcher's bug had failed it INTERNAL, which it does not retry)."""
    server, target, url = served
    async with grpc.aio.insecure_channel(target) as channel:
        stub, health = pb_grpc.InferenceStub(channel), health_pb2_grpc.HealthStub(channel)

        async def liveness():
            return (await health.Check(health_pb2.HealthCheckRequest(service=""))).status

        async def serving():
            return await liveness() == health_pb2.HealthCheckResponse.SERVING

        # The fixture waited for one front end's HTTP; this connection may reach the other one
        # (SO_REUSEPORT), which may still be starting.
        await until(serving, "grpc.health.v1 never said SERVING")
        assert (await stub.Embed(pb.EmbedRequest(texts=["fine"]), timeout=10)).shape == [1, 384]

        await fault(server)
        with pytest.raises(grpc.aio.AioRpcError) as e:  # what waited fails, not left hanging
            await stub.Embed(pb.EmbedRequest(texts=["on a server that just failed"]), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and message in e.value.details()

        async def not_serving():
            return await liveness() == health_pb2.HealthCheckResponse.NOT_SERVING

        await until(not_serving, "grpc.health.v1 still says SERVING on a server that serves nothing")
        code, fields = await asyncio.to_thread(http_health, url)
        assert code == 503 and fields["status"] == "degraded" and not fields["accepting_requests"]
        check = await stub.HealthCheck(pb.HealthCheckRequest())
        assert check.status == "degraded" and not check.accepting_requests
        with pytest.raises(grpc.aio.AioRpcError) as e:  # refused at once, retryable elsewhere
            await stub.Embed(pb.EmbedRequest(texts=["anyone there?"]), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and message in e.value.details()


@pytest.mark.parametrize("fault", [break_batcher, end_worker], ids=["batcher", "worker"])
async def test_callers_held_for_their_room_are_refused_as_soon_as_the_server_is_lost(fault, monkeypatch):
    """A caller held for its booked room (embedfleet-queue: wait) resumes when a batch makes room
    or at its moment, up to RESERVATION_HORIZON_MS away; on a server that computes nothing more
    neither comes. It is refused UNAVAILABLE (retried on another pod) as soon as the server is
    lost, not a minute later. The gate lives in the model's process in both modes."""
    monkeypatch.setenv("MODEL_PATH", "sim:50000")
    monkeypatch.setenv("BATCH_CAPS", CAPS)
    monkeypatch.setenv("RESERVATION_HORIZON_MS", "120000")
    server = Server(Settings.from_env(), listen=False)
    await server.start()
    try:
        # A minute of work ahead, standing in for a burst: a new caller is booked a minute out.
        server.estimator.enqueued(int(60 * server.estimator.snapshot().service_rate))
        held = asyncio.ensure_future(server.service.embed_texts(["held"], Caller(waits=True)))
        while not server.service.gate._held:
            assert not held.done(), held
            await asyncio.sleep(0.01)
        await fault(server)
        server.engine.look_soon()  # the batcher's next look (the worker's end: the watchdog's next tick)
        with pytest.raises(NotReady, match="this server will be restarted"):
            await asyncio.wait_for(held, 10)
    finally:
        await server.stop(grace=0)
