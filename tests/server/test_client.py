"""The library client and the openai client against a real server: bursts are scheduled and\ncomplete, deadlines are honoured, calls balance across pods."""

import asyncio
import signal
import time

import grpc
import numpy as np
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import CHANNEL_OPTIONS, KEEPALIVE_TIMEOUT_MS, Client
from embedserve.client_retries import is_final, retry_after_s, spends_budget
from embedserve.transports.grpc_server import is_retry
from tests.conftest import ServerProcess, counter, free_port, make_text, rejections
from tests.server.test_client_metadata import EmbedStub

SIM = {"MODEL_PATH": "sim:2000", "BATCH_CAPS": "16:8,32:8,64:4,128:2,256:1,512:1"}


@pytest.mark.parametrize(
    "metadata, retry",
    [((), False), ((("embedfleet-attempt", "1"),), False), ((("embedfleet-attempt", "2"),), True),
     ((("grpc-previous-rpc-attempts", "1"),), True), ((("grpc-previous-rpc-attempts", "0"),), False)],
)
def test_retries_are_recognised(metadata, retry):
    assert is_retry(metadata) is retry


def burst_texts(n: int, seed: int = 0) -> list[list[str]]:
    """n requests of 1-4 texts of 5-30 words."""
    rng = np.random.default_rng(seed)
    return [[make_text(rng, int(w)) for w in rng.integers(5, 30, size=int(k))] for k in rng.integers(1, 5, size=n)]


async def test_a_burst_through_the_client_with_defaults_is_scheduled_not_dropped():
    """300 requests at once, far beyond the drain budget: each waits on the server for the room
    booked for it and is served; the burst ends close to the server's own compute time."""
    server = ServerProcess(SIM).wait_ready()
    try:
        requests = burst_texts(300)
        async with Client(server.target) as client:  # a server that has seen traffic has learned
            for texts in burst_texts(20, seed=9):   # its characters per token (offered tokens are
                await client.embed(texts)           # estimated before tokenizing)
        busy0 = counter(server.http, "embedfleet_model_busy_seconds_total")
        offered0 = counter(server.http, "embedfleet_offered_tokens_total")
        computed0 = counter(server.http, "embedfleet_tokens_total", kind="real")
        t0 = time.perf_counter()
        async with Client(server.target) as client:
            results = await asyncio.gather(*(client.embed(texts) for texts in requests))
        elapsed = time.perf_counter() - t0
        compute_s = counter(server.http, "embedfleet_model_busy_seconds_total") - busy0
        assert [r.shape for r in results] == [(len(t), 384) for t in requests]
        assert counter(server.http, "embedfleet_held_requests_total") > 100  # a real burst, held, not refused
        assert rejections(server.http) == 0
        assert elapsed <= 1.5 * compute_s, (elapsed, compute_s)
        # Each request is demand once, however often it came back.
        offered = counter(server.http, "embedfleet_offered_tokens_total") - offered0
        computed = counter(server.http, "embedfleet_tokens_total", kind="real") - computed0
        assert offered == pytest.approx(computed, rel=0.15)
        assert server.health()[1]["reserved_tokens"] == 0
    finally:
        server.stop()


async def test_a_burst_through_the_openai_client_with_its_defaults_completes():
    """The openai client retries a 429 twice, waiting exactly retry-after-ms: one wait is enough,
    since the server books the room for the retry."""
    from openai import AsyncOpenAI

    server = ServerProcess(SIM).wait_ready()
    try:
        requests = burst_texts(100, seed=1)
        client = AsyncOpenAI(base_url=server.http + "/v1", api_key="unused")
        results = await asyncio.gather(*(client.embeddings.create(model="sim:2000", input=texts)
                                         for texts in requests))
        await client.close()
        assert [len(r.data) for r in results] == [len(t) for t in requests]
        assert counter(server.http, "embedfleet_rejected_requests_total", reason="drain_time") > 30
    finally:
        server.stop()


async def test_under_sustained_overload_both_clients_fail_at_once_without_retrying():
    """Once the reservation horizon is full (1 ms here: any wait fills it) and demand has exceeded
    capacity for as long, a refusal says not to retry: the openai client raises at that 429
    (`x-should-retry: false`) rather than spending its retries, and the Client tries the
    next pod once (here the same one) rather than retrying until its 30 s deadline (it reads
    gRPC's standard negative `grpc-retry-pushback-ms`)."""
    from openai import AsyncOpenAI, RateLimitError

    server = ServerProcess({**SIM, "MODEL_PATH": "sim:300", "RESERVATION_HORIZON_MS": "1"}).wait_ready()

    async def timed(call):
        t0 = time.perf_counter()
        try:
            await call
            return None, time.perf_counter() - t0
        except (RateLimitError, grpc.aio.AioRpcError) as e:
            return e, time.perf_counter() - t0

    try:
        client = AsyncOpenAI(base_url=server.http + "/v1", api_key="unused")
        outcomes = await asyncio.gather(*(timed(client.embeddings.create(model="sim:300", input=texts))
                                          for texts in burst_texts(60, seed=2)))
        await client.close()
        refused = [e for e, _ in outcomes if isinstance(e, RateLimitError)]
        assert len(refused) > 10 and all(e is None or isinstance(e, RateLimitError) for e, _ in outcomes)
        assert server.health()[1]["sustained_overload"]
        for e in refused:
            # It stopped with retries left: at the first refusal that said so (an earlier one may
            # have been a burst's, before the overload read as sustained).
            assert e.response.headers["x-should-retry"] == "false"
            assert int(e.response.request.headers["x-stainless-retry-count"]) < 2
            assert int(e.response.headers["Retry-After"]) >= 1  # a back-off for clients that retry anyway
            assert "reservation horizon" in e.message

        async with Client(server.target) as client:
            outcomes = await asyncio.gather(*(timed(client.embed(texts)) for texts in burst_texts(60, seed=3)))
        refused = [(e, s) for e, s in outcomes if e is not None]
        assert len(refused) > 10
        for e, seconds in refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and is_final(e)
            assert ("grpc-retry-pushback-ms", "-1") in tuple(e.trailing_metadata())
            assert seconds < 2.0  # against a 30 s deadline
        assert counter(server.http, "embedfleet_rejected_requests_total", reason="sustained") > 20
    finally:
        server.stop()


async def test_a_held_call_joins_when_a_batch_leaves_room_not_at_its_booked_moment():
    """Refused callers that never come back leave bookings standing for seconds; a call held
    behind them joins as soon as the queue has room (the server wakes held callers after each
    batch), not at the moment computed behind the no-shows."""
    server = ServerProcess(SIM).wait_ready()
    long_text = "word " * 300
    try:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            work = asyncio.ensure_future(stub.Embed(pb.EmbedRequest(texts=[long_text] * 8)))
            await until_queued(server)
            # Refused, never retried: each books room for a retry that will not come.
            for _ in range(45):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Embed(pb.EmbedRequest(texts=[long_text]))
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            moment_s = retry_after_s(refused.value)  # what the call below is booked behind
            held0 = counter(server.http, "embedfleet_held_requests_total")
            t0 = time.perf_counter()
            async with Client(server.target) as client:
                await client.embed(["a short text"])
            elapsed = time.perf_counter() - t0
            await work
        assert counter(server.http, "embedfleet_held_requests_total") == held0 + 1
        assert moment_s > 3 and elapsed < moment_s / 2, (elapsed, moment_s)
    finally:
        server.stop()


async def until_queued(server: ServerProcess) -> None:
    while server.health()[1]["queued_tokens"] == 0:
        await asyncio.sleep(0.01)


async def test_the_client_fails_fast_when_its_deadline_cannot_be_met():
    """A slow device and a short deadline: what cannot be served in time fails at once (no
    waiting out the deadline), and the server books nothing it would hold for nobody."""
    # Its text: 42 tokens, bucket 64, at SIM's cap; one row in the others (the largest batch, the
    # reorder window's, is still 256 tokens): at 300 tokens/s the warm-up slept ~3 s more on them.
    server = ServerProcess({**SIM, "MODEL_PATH": "sim:300", "BATCH_CAPS": "16:1,32:1,64:4,128:1,256:1,512:1"}).wait_ready()

    async def timed(client):
        t0 = time.perf_counter()
        try:
            await client.embed(["x " * 40])
            return "OK", time.perf_counter() - t0, None
        except grpc.aio.AioRpcError as e:
            return e.code().name, time.perf_counter() - t0, e

    try:
        async with Client(server.target, timeout_s=1.0) as client:
            outcomes = await asyncio.gather(*(timed(client) for _ in range(40)))
        refused = [(s, e) for code, s, e in outcomes if code == "RESOURCE_EXHAUSTED"]
        assert len(refused) > 20, [c for c, _, _ in outcomes]
        assert all(s < 0.5 and retry_after_s(e) > 0 for s, e in refused)  # told at once
        assert {c for c, _, _ in outcomes} <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
        assert server.health()[1]["reserved_tokens"] == 0
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


async def test_an_idle_clients_keepalive_is_accepted_and_notices_a_frozen_server():
    """The Client pings its connections even between calls (a pod that froze while the Client was
    idle is dropped before a call lands there), and the server accepts those pings: a default gRPC
    server closes a connection pinged without calls with GOAWAY too_many_pings at the 4th ping.
    (The frozen pod under load: test_fleet.py.)"""
    server = ServerProcess(SIM).wait_ready()
    # The Client's options, pinging every 1.2 s rather than 5 s: the 4 pings that would earn the
    # GOAWAY take 5 s, not 20. The server accepts pings every second (gRPC's own floor).
    ping_s = 1.2
    options = [(k, int(ping_s * 1000) if k == "grpc.keepalive_time_ms" else v) for k, v in CHANNEL_OPTIONS]
    try:
        async with grpc.aio.insecure_channel(server.target, options=options) as channel:
            await pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=["connected"]))
            ready = channel.get_state()
            assert ready == grpc.ChannelConnectivity.READY
            # Idle and pinged 5 times: a refused ping would close the connection.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(channel.wait_for_state_change(ready), 5.5 * ping_s)
            server.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            # The next ping goes unanswered: the connection is closed when it times out (1 s of
            # slack for this shared host).
            await asyncio.wait_for(channel.wait_for_state_change(ready), ping_s + KEEPALIVE_TIMEOUT_MS / 1000 + 1.0)
            print(f"a frozen server's connection closed {time.monotonic() - t0:.2f} s after the freeze")
    finally:
        server.proc.send_signal(signal.SIGCONT)  # a stopped process acts on no SIGTERM
        server.stop()


def refusal(code: grpc.StatusCode, *trailing: tuple[str, str]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), "")


def test_only_retries_that_multiply_load_spend_the_budget():
    """Free: the first retry after a pod said go elsewhere, and a retry onto booked room. Charged:
    a backed-off retry, the one after negative pushback."""
    unavailable, cancelled = refusal(grpc.StatusCode.UNAVAILABLE), refusal(grpc.StatusCode.CANCELLED)
    assert not spends_budget(unavailable, 1) and not spends_budget(cancelled, 1)
    assert spends_budget(unavailable, 2) and spends_budget(cancelled, 3)
    booked = refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, ("retry-after-ms", "120"), ("grpc-retry-pushback-ms", "120"))
    assert not spends_budget(booked, 0)
    final = refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, ("retry-after-ms", "10000"), ("grpc-retry-pushback-ms", "-1"))
    assert spends_budget(final, 0)


class Unavailable(EmbedStub):
    """What a fleet with no pod left looks like from the Client: a proxy (Envoy, a mesh) with no
    healthy upstream answers every call UNAVAILABLE. Counts the calls it was sent."""

    def __init__(self):
        self.calls = 0

    async def embed(self, request, context):
        self.calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy upstream")


@pytest.mark.parametrize("routing", ["least-drain", "round-robin"])
async def test_clients_made_per_call_share_one_retry_budget_per_target(routing):
    """Code that makes a Client per call: each one started with a full budget of its own and
    retried every failure (here each call until its deadline). One budget per target for the
    process: each call's first retry at once is free (a pod that said go elsewhere answered
    nothing), its backed-off retries spend the budget: the first calls spend half of it (10
    retries), later ones fail at their second answer, and no retry is earned back by failing."""
    from embedserve.client_routing import MAX_TOKENS

    async with Unavailable() as fleet:
        for _ in range(30):
            async with Client(fleet.target, timeout_s=1.0, routing=routing) as client:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await client.embed(["a text"])
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert fleet.calls == 30 * 2 + MAX_TOKENS / 2
        assert client.retry_budget is Client(fleet.target).retry_budget  # one per target
