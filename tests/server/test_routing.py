"""Least-drain routing (embedserve.client, the default) over real gRPC: two server processes behind
one name on a real DNS server on loopback, as pods behind a headless Service, one of them slower
(the simulated device at a third of the rate). The faster pod takes most calls; a pod added to
DNS gets calls, a pod removed gets no more, and none is lost; a pod that freezes (SIGSTOP) has
its calls hedged on the other within their deadline, well before keepalive would end them."""

import asyncio
import json
import signal
import time
import urllib.request

import grpc
import pytest

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from embedserve.client import Client
from embedserve.client_calls import HEDGE_MARK
from tests.conftest import ServerProcess, counter, free_port, pod_addresses
from tests.server.test_fleet import steady_load

FAST, SLOW = 12000, 4000  # tokens/s: 3x apart
CAPS = "16:8,32:8,64:4,128:2,256:1,512:1"
NAME = "pods.test"


def served(server) -> float:
    return counter(server.http, "embedfleet_requests_total", code="OK", rpc="Embed")


@pytest.fixture(scope="module")
def pods():
    """(fast, slow), one port at two loopback addresses; connections age out every 2 s, as the
    per-pod channels must survive (a GOAWAY is a reconnect, not a lost pod)."""
    port = free_port()
    hosts = pod_addresses(port, 2)
    started = [ServerProcess({"MODEL_PATH": f"sim:{rate}", "BATCH_CAPS": CAPS, "BIND_HOST": host,
                              "GRPC_PORT": str(port), "MAX_CONNECTION_AGE_S": "2", "MAX_DRAIN_TIME_MS": "600000"})
               for host, rate in zip(hosts, (FAST, SLOW))]
    try:
        for p in started:
            p.wait_ready()
        yield started
    finally:
        for p in started:
            p.proc.send_signal(signal.SIGCONT)  # a stopped process acts on no SIGTERM
            p.stop()


def offered_by(server, hedge: bool) -> float:
    """Offered tokens a server counts for one gRPC call and one HTTP request, plain or marked as
    hedges (each the second try of a request another pod already has)."""
    before = counter(server.http, "embedfleet_offered_tokens_total")
    mark = (HEDGE_MARK,) if hedge else ()
    with grpc.insecure_channel(server.target) as channel:
        pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=["a hedge or not"]), metadata=mark, timeout=10)
    request = urllib.request.Request(server.http + "/embed", json.dumps({"inputs": ["a hedge or not"]}).encode(),
                                     {"Content-Type": "application/json", **dict(mark)})
    urllib.request.urlopen(request, timeout=10).read()
    return counter(server.http, "embedfleet_offered_tokens_total") - before


def test_a_hedge_is_not_counted_as_new_demand(pods):
    """A hedge duplicates demand the first pod already counted: it must not raise this pod's
    arrival rate and offered tokens (admission, the autoscaler) as a new request would."""
    assert offered_by(pods[0], hedge=False) > 0
    assert offered_by(pods[0], hedge=True) == 0


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.05)


async def share_of_the_fast_pod(dns, pods, routing: str) -> float:
    """12 callers in a closed loop for 3 s: → the fast pod's share of the calls served."""
    fast, slow = pods
    dns.records[NAME] = [fast.host, slow.host]
    texts = iter([f"request {i}: " + "word " * 100 for i in range(100_000)])  # ~100 tokens each
    async with Client(dns.target(NAME, fast.grpc_port), routing=routing) as client:
        before = served(fast), served(slow)
        stop = asyncio.Event()

        async def caller():
            while not stop.is_set():
                await client.embed([next(texts)])

        load = [asyncio.ensure_future(caller()) for _ in range(12)]
        await asyncio.sleep(3.0)
        stop.set()
        await asyncio.gather(*load)  # every call answered: none raised
    to_fast, to_slow = served(fast) - before[0], served(slow) - before[1]
    print(f"{routing}: fast pod {to_fast:.0f} calls, slow pod {to_slow:.0f}; {client.hedges} hedges")
    assert to_fast + to_slow > 100
    return to_fast / (to_fast + to_slow)


async def test_the_faster_pod_takes_most_calls(dns, pods):
    assert await share_of_the_fast_pod(dns, pods, "least-drain") >= 0.62
    assert await share_of_the_fast_pod(dns, pods, "round-robin") <= 0.55  # what it replaces: a half each


async def test_a_pod_added_to_dns_gets_calls_and_one_removed_gets_none_and_none_is_lost(dns, pods):
    first, second = pods
    dns.records[NAME] = [first.host]
    async with Client(dns.target(NAME, first.grpc_port)) as client:
        stop = asyncio.Event()
        load = asyncio.ensure_future(steady_load(client, stop, callers=6))
        await until(lambda: served(second) > 0 or served(first) > 20)
        base = served(second)
        dns.records[NAME] = [first.host, second.host]  # the scale-up's new endpoint
        # Resolved again at the next connection's age-out (2 s here), at the latest RESOLVE_EVERY_S.
        await until(lambda: served(second) >= base + 20, timeout_s=8.0)
        dns.records[NAME] = [second.host]  # the first pod leaves the Service
        # Resolved again, its last calls answered: the client has closed its channel.
        await until(lambda: first.host not in client.pods.pods, timeout_s=8.0)
        gone = served(first)
        await asyncio.sleep(1.0)
        stop.set()
        outcomes = await load
    assert served(first) == gone  # no call for a pod DNS no longer names
    assert set(outcomes) == {"OK"} and len(outcomes) > 50, [o for o in outcomes if o != "OK"][:3]


async def test_a_frozen_pods_calls_are_hedged_within_their_deadline(dns, pods):
    """A frozen pod closes nothing and answers nothing: without a hedge its calls waited for
    keepalive (~10 s) or their deadline. Here they are sent to the other pod a quarter second
    after the frozen one's (idle) estimate, and all end well within a 3 s deadline."""
    frozen, healthy = pods
    dns.records[NAME] = [frozen.host, healthy.host]
    async with Client(dns.target(NAME, frozen.grpc_port), timeout_s=3.0) as client:
        for i in range(10):  # both pods known and connected
            await client.embed([f"warm {i}"])
        frozen.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            durations = []

            async def one(i):
                start = time.monotonic()
                await client.embed([f"frozen {i}: " + "word " * 20])
                durations.append(time.monotonic() - start)

            await asyncio.gather(*(one(i) for i in range(8)))
            elapsed = time.monotonic() - t0
        finally:
            frozen.proc.send_signal(signal.SIGCONT)
    print(f"8 calls with one pod frozen: {elapsed:.2f} s, longest {max(durations):.2f} s, {client.hedges} hedges")
    assert client.hedges >= 1
    assert max(durations) < 2.0, durations


async def test_a_frozen_pod_left_in_dns_fails_no_call_after_the_first_seconds(dns, pods):
    """A frozen pod stays in DNS (Kubernetes keeps it there until its readiness probe fails, 30 s
    and more), under load: 16 callers in a closed loop, 3 s deadline, for 15 s. Its calls
    there go unanswered, then keepalive closes its connection and the reconnect hangs in
    CONNECTING (the kernel accepts TCP, HTTP/2 never answers). Least-drain must stop sending to it
    once its calls there wait, and never send to a connection that is not READY while another is:
    before, an estimate that faded to "unknown" counted as idle, and the calls sent to its
    CONNECTING channel waited out their deadline (59 of 869 failed, all through the 15 s)."""
    frozen, healthy = pods
    dns.records[NAME] = [frozen.host, healthy.host]
    calls: list[tuple[float, str]] = []  # (start after the freeze, outcome)
    async with Client(dns.target(NAME, frozen.grpc_port), timeout_s=3.0) as client:
        for i in range(20):  # both pods known and connected
            await client.embed([f"warm {i}"])
        frozen.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            stop = t0 + 15.0

            async def caller(k):
                i = 0
                while time.monotonic() < stop:
                    start = time.monotonic()
                    try:
                        await client.embed([f"caller {k} call {i} " + "word " * 60])
                        outcome = "OK"
                    except Exception as e:  # noqa: BLE001 - every failure is counted, none hidden
                        outcome = getattr(e, "code", lambda: type(e).__name__)()
                    calls.append((start - t0, str(outcome)))
                    i += 1

            await asyncio.gather(*(caller(k) for k in range(16)))
        finally:
            frozen.proc.send_signal(signal.SIGCONT)
    failed = [(round(t, 2), o) for t, o in calls if o != "OK"]
    late = [(t, o) for t, o in failed if t >= 3.0]
    print(f"one pod frozen, 15 s of load: {len(calls)} calls, {len(failed)} failed (first at "
          f"{failed[0][0] if failed else '-'} s, last at {failed[-1][0] if failed else '-'} s), {client.hedges} hedges")
    assert sum(1 for t, _ in calls if t >= 10.0) > 100  # past keepalive's verdict the healthy pod serves on
    assert not late, late[:5]
