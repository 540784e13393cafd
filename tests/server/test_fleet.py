"""Two server processes behind one name, as pods behind a headless Service: a real DNS server on
loopback answers the name with each "pod"'s address (127.0.0.2, 127.0.0.3, same port), and the
library Client, with its defaults, is the in-cluster client. What a cluster does and a single-pod
test cannot see: long-lived HTTP/2 connections, scale-up, and a pod going away under load."""

import asyncio
import signal
import time

import grpc
import pytest

from embedserve.client import Client
from tests.conftest import ONE_ROW_CAPS, ServerProcess, counter, free_port, rejections

SIM = {"MODEL_PATH": "sim:20000", "BATCH_CAPS": "16:8,32:8,64:4,128:2,256:1,512:1"}
NAME = "pods.test"
AGE_S = 2.0


def served(server) -> float:
    return counter(server.http, "embedfleet_requests_total", code="OK", rpc="Embed")


async def steady_load(client: Client, stop: asyncio.Event, callers: int = 4) -> list:
    """`callers` loops, each sending its next request when the last ends; → every outcome."""
    outcomes = []

    async def caller(k):
        i = 0
        while not stop.is_set():
            i += 1
            try:
                await client.embed([f"caller {k} request {i}"])
                outcomes.append("OK")
            except Exception as e:  # noqa: BLE001 - every failure is counted, none hidden
                outcomes.append(repr(e))

    await asyncio.gather(*(caller(k) for k in range(callers)))
    return outcomes


@pytest.fixture
def port():
    return free_port()


def pod(host: str, port: int, **env) -> ServerProcess:
    return ServerProcess({**SIM, "BIND_HOST": host, "GRPC_PORT": str(port),
                          "MAX_CONNECTION_AGE_S": str(AGE_S), **env})


async def test_a_client_connected_before_a_scale_up_sends_the_new_pod_its_share(dns, port):
    # The new pod's process starts with the first (the client knows pods only through DNS: the
    # scale-up, as it sees it, is the new endpoint's arrival there).
    first, second = pod("127.0.0.2", port), pod("127.0.0.3", port)
    try:
        first.wait_ready()
        second.wait_ready()
        dns.records[NAME] = ["127.0.0.2"]
        async with Client(dns.target(NAME, port)) as client:
            stop = asyncio.Event()
            load = asyncio.ensure_future(steady_load(client, stop))
            while served(first) < 10:  # connected, serving through the first pod only
                await asyncio.sleep(0.05)
            assert served(second) == 0
            dns.records[NAME] = ["127.0.0.2", "127.0.0.3"]  # the headless Service's new endpoint
            await asyncio.sleep(2 * AGE_S)  # within two connection ages the client has re-resolved
            before = served(first), served(second)
            await asyncio.sleep(2.0)
            after = served(first), served(second)
            stop.set()
            outcomes = await load
        assert set(outcomes) == {"OK"}
        new_share = (after[1] - before[1]) / (after[0] - before[0] + after[1] - before[1])
        assert 0.3 <= new_share <= 0.7, (before, after)  # a fair share: about half
    finally:
        for server in (first, second):
            server.stop()


async def test_sigterm_to_one_of_two_pods_under_steady_load_loses_no_request(dns, port):
    pods = [pod(host, port) for host in ("127.0.0.2", "127.0.0.3")]
    try:
        for p in pods:
            p.wait_ready()
        dns.records[NAME] = ["127.0.0.2", "127.0.0.3"]
        async with Client(dns.target(NAME, port)) as client:
            stop = asyncio.Event()
            load = asyncio.ensure_future(steady_load(client, stop, callers=8))
            await asyncio.sleep(1.5)
            before = served(pods[0])
            assert before > 0  # the victim was taking traffic
            # Kubernetes: SIGTERM, and the endpoint leaves the Service a little later.
            code = asyncio.to_thread(pods[0].stop)
            await asyncio.sleep(0.5)
            dns.records[NAME] = ["127.0.0.3"]
            assert await code == 0
            t0 = time.monotonic()
            await asyncio.sleep(1.5)  # the survivor serves everything now
            stop.set()
            outcomes = await load
        failures = [o for o in outcomes if o != "OK"]
        assert failures == [], failures[:5]
        assert len(outcomes) > 50 and time.monotonic() - t0 >= 1.5
    finally:
        for p in pods:
            p.stop()


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
async def test_a_pod_that_freezes_or_dies_under_load_stalls_no_caller(dns, port, sig):
    """Two pods, 16 callers in a closed loop with the Client's defaults (30 s deadline); one pod
    freezes (SIGSTOP: a hung node, a partition, a wedged driver) or dies (SIGKILL), and leaves DNS
    2 s later. A frozen pod closes nothing: round robin keeps its connection READY, and without
    keepalive every caller landed there in turn and waited out its deadline (the issue: all 16
    calls DEADLINE_EXCEEDED, 11 calls in the next 20 s, the healthy pod idle). With it the dead
    connection is noticed within seconds and its calls retried on the healthy pod. A killed pod's
    kernel closes its connections at once; that must stay as harmless as it was."""
    # The default connection age, as in a cluster: no connection ages out during the test, so
    # nothing but keepalive can tell the client that a frozen pod's connection is dead.
    victim, healthy = pods = [pod(host, port, MAX_CONNECTION_AGE_S="30") for host in ("127.0.0.2", "127.0.0.3")]
    calls: list[tuple[float, float, str]] = []  # (start, end, outcome) of every finished call
    in_flight: dict[int, float] = {}  # caller -> start of its call now in flight
    window_s = 16.0  # from the signal to the end: a call stuck since the signal is past the 15 s bound
    try:
        for p in pods:
            p.wait_ready()
        dns.records[NAME] = ["127.0.0.2", "127.0.0.3"]
        async with Client(dns.target(NAME, port)) as client:
            stop = asyncio.Event()

            async def caller(k):
                i = 0
                while not stop.is_set():
                    i += 1
                    in_flight[k] = start = time.monotonic()
                    try:
                        await client.embed([f"caller {k} request {i}"])
                        outcome = "OK"
                    except Exception as e:  # noqa: BLE001 - every failure is counted, none hidden
                        outcome = repr(e)
                    del in_flight[k]
                    calls.append((start, time.monotonic(), outcome))

            load = [asyncio.ensure_future(caller(k)) for k in range(16)]
            while min(served(p) for p in pods) < 50:  # both pods in use
                await asyncio.sleep(0.05)
            shared = served(healthy)
            await asyncio.sleep(2.0)  # the healthy pod's rate while the two share the load
            shared = (served(healthy) - shared) / 2.0
            victim.proc.send_signal(sig)
            t_signal = time.monotonic()
            await asyncio.sleep(2.0)  # the scenario: the endpoint leaves DNS 2 s later
            dns.records[NAME] = ["127.0.0.3"]
            await asyncio.sleep(window_s - 4.0)  # every call the victim held ends in here
            alone = served(healthy)
            await asyncio.sleep(2.0)  # the healthy pod's rate at the end, alone
            alone = (served(healthy) - alone) / 2.0
            stop.set()
            _, stuck = await asyncio.wait(load, timeout=2.0)  # the healthy pod answers in milliseconds
            still_waiting = [time.monotonic() - start for start in in_flight.values()]
            for task in stuck:
                task.cancel()
        failures = [o for _, _, o in calls if o != "OK"]
        longest = max([end - start for start, end, _ in calls] + still_waiting)
        after_signal = sum(1 for _, end, _ in calls if end >= t_signal)
        print(f"{signal.Signals(sig).name}: {len(calls)} calls, {after_signal} after the signal, "
              f"{len(failures)} failed, {len(still_waiting)} still waiting, longest {longest:.2f} s; "
              f"healthy pod {shared:.0f} calls/s sharing the load, {alone:.0f} calls/s alone at the end")
        assert failures == [] and still_waiting == [], (failures[:3], still_waiting)
        assert longest <= 15.0, longest
        # Throughput recovers on the healthy pod: it serves the callers the victim left (the
        # callers' demand is unchanged, so alone it works at least as hard as before; half, for
        # this shared 2-core host), rather than idling while they wait on a dead connection.
        assert alone >= 0.5 * shared, (shared, alone)
    finally:
        victim.proc.send_signal(signal.SIGCONT)  # a stopped process acts on no SIGTERM
        for p in pods:
            p.stop()


async def test_a_pod_killed_with_64_calls_in_flight_fails_none_of_them(dns, port):
    """A pod SIGKILLed (OOM, a node lost) while it holds 64 of this process's calls: each one ends
    UNAVAILABLE and is retried at once on the other pod, the retry budget untouched (it holds 10
    retries at once: charging these failed all but 10 of them). Every call answers."""
    # Slow pods (2,000 tokens/s), so that calls of ~100 tokens queue there: 80 of them are 4 s of
    # a pod's compute, all 160 on the survivor 8 s, within the 30 s deadline.
    victim, healthy = pods = [pod(host, port, MODEL_PATH="sim:2000", MAX_DRAIN_TIME_MS="600000")
                              for host in ("127.0.0.2", "127.0.0.3")]
    text = "word " * 100
    try:
        for p in pods:
            p.wait_ready()
        dns.records[NAME] = ["127.0.0.2", "127.0.0.3"]
        async with Client(dns.target(NAME, port)) as client:
            while len(client.pods.pods) < 2 or any(p.latency is None for p in client.pods.pods.values()):
                await client.embed(["both pods connected and answering"])
            calls = [asyncio.ensure_future(client.embed([f"call {i}: {text}"])) for i in range(160)]

            def held_by_victim() -> float:
                return sum(counter(victim.http, f"embedfleet_{kind}_requests") for kind in ("queued", "running"))

            while await asyncio.to_thread(held_by_victim) < 64:  # on the victim, not merely sent
                assert not all(c.done() for c in calls), "the calls ended before the victim held 64"
            victim.proc.send_signal(signal.SIGKILL)
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
        failures = [repr(o) for o in outcomes if isinstance(o, BaseException)]
        assert failures == [], (len(failures), failures[:3])
        assert counter(healthy.http, "embedfleet_requests_total", code="OK", rpc="Embed") >= 64
    finally:
        for p in pods:
            p.stop()


async def test_a_burst_across_two_pods_is_held_where_it_lands(dns, port):
    """A round-robin client's retry lands on another pod, where nothing is booked for it: the
    Client waits where its call landed instead, so a burst over a fleet completes in about the
    fleet's compute time, refused nowhere."""
    from tests.server.test_client import burst_texts

    # Connections that outlive the burst: this test is about holds, not ageing. A burst sent the
    # moment a channel opens all goes to whichever pod's connection is up first (gRPC's round
    # robin picks among READY subchannels), ~8 s of one pod's compute, and what lies past the
    # reservation horizon is refused: so the burst goes out once the client has reached both.
    pods = [pod(host, port, MODEL_PATH="sim:4000", MAX_CONNECTION_AGE_S="120") for host in ("127.0.0.2", "127.0.0.3")]
    try:
        for p in pods:
            p.wait_ready()
        dns.records[NAME] = ["127.0.0.2", "127.0.0.3"]
        async with Client(dns.target(NAME, port)) as client:
            warm = iter(burst_texts(200, seed=9))  # pods that have seen traffic (chars per token)
            while min(counter(p.http, "embedfleet_requests_total", code="OK", rpc="Embed") for p in pods) < 5:
                await client.embed(next(warm))
            # ~4 s of each pod's compute, inside the 10 s reservation horizon: nothing need be refused
            requests = burst_texts(600, seed=3)
            busy0 = [counter(p.http, "embedfleet_model_busy_seconds_total") for p in pods]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(client.embed(t) for t in requests))
            elapsed = time.perf_counter() - t0
        busy = [counter(p.http, "embedfleet_model_busy_seconds_total") - b for p, b in zip(pods, busy0)]
        assert [r.shape[0] for r in results] == [len(t) for t in requests]
        # Waited where they landed.
        assert sum(counter(p.http, "embedfleet_held_requests_total") for p in pods) > 100
        refused = sum(rejections(p.http) for p in pods)
        assert refused == 0, (refused, busy)
        assert elapsed <= 2 * max(busy), (elapsed, busy)  # the fleet's compute time, with room for this 2-core host
    finally:
        for p in pods:
            p.stop()


class KubeProxy:
    """A test double for kube-proxy in front of a ClusterIP Service: each new TCP connection goes
    to one of the Service's present endpoints (round robin), and an open connection is never
    moved. What it lacks (endpoints that leave as a pod terminates, preStop, IPVS) a real cluster
    has: tests/cluster/test_fleet_on_cluster.py."""

    def __init__(self, endpoints: list[tuple[str, int]]):
        self.endpoints, self._next = endpoints, 0
        self.connections: list[tuple[str, int]] = []  # the endpoint each connection went to

    async def __aenter__(self) -> "KubeProxy":
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _connect(self, reader, writer) -> None:
        self._next += 1
        endpoint = self.endpoints[self._next % len(self.endpoints)]
        self.connections.append(endpoint)
        try:
            up_reader, up_writer = await asyncio.open_connection(*endpoint)
        except OSError:
            writer.close()  # as a connection to a gone endpoint: refused, not left hanging
            return

        async def copy(source, sink):
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            finally:
                sink.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer), return_exceptions=True)


def draining_answer(server: ServerProcess) -> tuple[int, str | None, str | None]:
    """(status, Connection, retry-after-ms) of an embeddings request sent straight to a server."""
    import http.client

    conn = http.client.HTTPConnection(server.host, server.http_port, timeout=5)
    try:
        conn.request("POST", "/v1/embeddings", '{"model": "m", "input": ["x"]}', {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status, r.getheader("connection"), r.getheader("retry-after-ms")
    finally:
        conn.close()


async def test_an_http_client_retrying_a_draining_pod_reaches_another():
    """Behind a ClusterIP Service an HTTP client's keep-alive connection is one pod. A draining
    pod's 503 says `Connection: close` and `retry-after-ms: 100`, so the openai client's retry
    (its defaults: 2 retries, honouring retry-after-ms) opens a new connection at once, which
    kube-proxy sends to a pod still in the Service. Without the close, the retries go down the same connection to the same pod until
    its queue has drained (seconds here) and the request fails."""
    from openai import AsyncOpenAI

    from embedfleet.v1 import inference_pb2 as pb
    from embedfleet.v1 import inference_pb2_grpc as pb_grpc
    from tests.server.test_client import until_queued

    one_service = {**SIM, "SERVED_MODEL_NAME": "m"}
    # Slow: its queue (8 rows cut to 256 tokens, one a batch) takes seconds to drain. One row in
    # the other buckets too (SIM's are 256 tokens at most): at 500 tokens/s the warm-up slept
    # ~2 s more through SIM's caps there.
    leaving = ServerProcess({**one_service, "MODEL_PATH": "sim:500", "BATCH_CAPS": ONE_ROW_CAPS})
    staying = ServerProcess(one_service)
    try:
        for p in (leaving, staying):
            p.wait_ready()
        async with KubeProxy([(leaving.host, leaving.http_port)]) as service:
            client = AsyncOpenAI(base_url=service.url + "/v1", api_key="unused")
            try:
                await client.embeddings.create(model="m", input=["kept alive"])  # the pooled connection: `leaving`
                async with grpc.aio.insecure_channel(leaving.target) as channel:
                    work = asyncio.ensure_future(
                        pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=["word " * 300] * 8)))
                    await until_queued(leaving)
                    leaving.proc.send_signal(signal.SIGTERM)
                    while leaving.health()[0] != 503:  # draining: its queue still runs
                        await asyncio.sleep(0.02)
                    assert draining_answer(leaving) == (503, "close", "100")  # go elsewhere, now
                    service.endpoints[:] = [(staying.host, staying.http_port)]  # the endpoint leaves the Service
                    answer = await client.embeddings.create(model="m", input=["after the SIGTERM"])
                    # The draining pod answered the first try (so the kept-alive connection was used) ...
                    refused = counter(leaving.http, "embedfleet_requests_total", rpc="HTTP /v1/embeddings", code="503")
                    drained = await work
            finally:
                await client.close()
        assert len(answer.data) == 1 and drained.shape[0] == 8  # nothing lost on either pod
        assert refused == 2  # the look above, and the client's first try
        # ... and its retry took one new connection, to the pod still in the Service.
        assert service.connections == [(leaving.host, leaving.http_port), (staying.host, staying.http_port)]
        assert counter(staying.http, "embedfleet_requests_total", rpc="HTTP /v1/embeddings", code="200") == 1
        assert leaving.proc.wait(30) == 0
    finally:
        for p in (leaving, staying):
            p.stop()


def test_http_keep_alive_connections_are_closed_after_their_age():
    """Behind a ClusterIP Service a keep-alive connection is one pod for as long as it lives: the
    server ends it after MAX_CONNECTION_AGE_S, at a response boundary, so no request is cut."""
    import http.client

    server = ServerProcess({**SIM, "MAX_CONNECTION_AGE_S": "1"}).wait_ready()
    try:
        conn = http.client.HTTPConnection(server.host, server.http_port, timeout=5)
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        conn.request("GET", "/health")  # kept alive: the same socket
        second = conn.getresponse()
        second.read()
        assert conn.sock is sock and second.getheader("connection") != "close"
        time.sleep(1.1)  # the connection's age passes (the subject of the test, not a wait for it)
        conn.request("GET", "/health")
        aged = conn.getresponse()
        assert aged.status == 200 and aged.getheader("connection") == "close"
        aged.read()
        conn.request("GET", "/health")  # http.client reconnects: a new connection, a new pod
        assert conn.getresponse().status == 200 and conn.sock is not sock
    finally:
        server.stop()


async def test_connection_age_forgets_connections_in_constant_time():
    """Clients without keep-alive open a connection per request: what the middleware remembers
    stays bounded by the connections of the last two ages, each request costing O(1)."""
    from embedserve.transports.http_server import ConnectionAge

    now = [0.0]
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    age = ConnectionAge(app, max_age_s=1.0, clock=lambda: now[0])
    for i in range(10_000):  # 10,000 one-request connections over 10 s
        now[0] = i / 1000
        await age({"type": "http", "client": ("10.0.0.1", 20_000 + i)}, None, send)
    assert len(age._born) <= 2001  # two ages' worth at 1,000 connections/s
    assert all((b"connection", b"close") not in m["headers"] for m in sent)
    now[0] = 20.0
    await age({"type": "http", "client": ("10.0.0.2", 1)}, None, send)
    now[0] = 21.5  # the same connection, past its age: told to close
    await age({"type": "http", "client": ("10.0.0.2", 1)}, None, send)
    assert sent[-1]["headers"] == [(b"connection", b"close")]


async def test_a_call_to_a_name_with_no_pod_waits_for_one_within_its_deadline(dns, port):
    """A service at zero, or whose pods all start: its name answers nothing. A call waits within
    its deadline while the name is asked again, and goes to the first pod that appears (a scale
    from zero); with none before the deadline it ends UNAVAILABLE naming the target, at the
    deadline, not at once."""
    first = pod("127.0.0.2", port)
    try:
        first.wait_ready()
        async with Client(dns.target(NAME, port), timeout_s=1.5) as client:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.embed(["nobody home"])
            waited = time.monotonic() - started
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no pod resolved" in e.value.details()
            assert waited >= 1.0, waited  # it waited for a pod, up to its deadline
        async with Client(dns.target(NAME, port), timeout_s=30) as client:
            call = asyncio.ensure_future(client.embed(["woken"]))
            await asyncio.sleep(1.0)  # the call is waiting: the name has no pod yet
            assert not call.done()
            dns.records[NAME] = ["127.0.0.2"]  # the first pod is Ready: its endpoint appears
            out = await call
        assert out.shape[0] == 1 and served(first) == 1
    finally:
        first.stop()
