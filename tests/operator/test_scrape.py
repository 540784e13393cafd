"""The autoscaler's scrape: Prometheus expositions as prometheus_client writes them, parsed with its
parser; pods scraped concurrently over HTTP (aiohttp) with a timeout, failures reported per pod."""

import asyncio
import dataclasses
import http.server
import socket
import threading

import aiohttp
import aiohttp.web
import prometheus_client
import pytest

from bench.operator_load import serve_metrics
from embedop import autoscale, scrape
from embedop.scrape import Reader
from tests.conftest import free_port


def exposition(**values) -> str:
    """What a server exports, written by prometheus_client itself (HELP, TYPE, _total, labels)."""
    reg = prometheus_client.CollectorRegistry()
    prometheus_client.Gauge("embedfleet_service_rate_tokens_per_second", "capacity", registry=reg).set(values["rate"])
    prometheus_client.Gauge("embedfleet_arrival_rate_tokens_per_second", "offered", registry=reg).set(values["arrival"])
    prometheus_client.Gauge("embedfleet_queued_tokens", "queued", registry=reg).set(values["queued"])
    prometheus_client.Counter("embedfleet_offered_tokens", "offered total", registry=reg).inc(values["offered"])
    prometheus_client.Gauge("embedfleet_admission_backlog_limit_seconds", "limit", registry=reg).set(values["limit"])
    # Noise the parser must step over: labels, histograms, an info metric, other names.
    prometheus_client.Counter("embedfleet_requests", "requests", ["rpc", "code"], registry=reg).labels("Embed", "OK").inc(3)
    prometheus_client.Histogram("embedfleet_request_duration_seconds", "latency", ["rpc"], registry=reg).labels("Embed").observe(0.1)
    prometheus_client.Info("embedfleet_model", "model", registry=reg).info({"model": "m", "device": "cpu"})
    return prometheus_client.generate_latest(reg).decode()


def test_parse_metrics_maps_the_shared_signal_to_pod_sample_fields():
    got = scrape.parse_metrics(exposition(rate=1500.5, arrival=900, queued=12, offered=34567, limit=0.4))
    assert got == {"service_rate": 1500.5, "arrival_rate": 900.0, "queued_tokens": 12.0, "offered_total": 34567.0,
                   "backlog_limit_s": 0.4}


def test_every_mapped_metric_is_a_pod_sample_field():
    fields = {f.name for f in dataclasses.fields(autoscale.PodSample)}
    assert set(scrape.METRICS.values()) <= fields


def test_the_served_task_is_the_task_label_of_model_info():
    """The server's info metric, as prometheus_client's Info writes it, with and without the label."""
    def with_info(labels: dict) -> str:
        reg = prometheus_client.CollectorRegistry()
        prometheus_client.Gauge("embedfleet_queued_tokens", "queued", registry=reg).set(2)
        prometheus_client.Info("embedfleet_model", "model", registry=reg).info(labels)
        return prometheus_client.generate_latest(reg).decode()
    assert scrape.read_exposition(with_info({"model": "m", "task": "rerank"})) == ({"queued_tokens": 2.0}, "rerank")
    assert scrape.read_exposition(with_info({"model": "m", "device": "cpu"}))[1] is None
    assert scrape.read_exposition(exposition(rate=1, arrival=1, queued=0, offered=1, limit=1))[1] is None


GUARDS = {"none": {}, "auth": {"auth": {"apiKeySecretRef": {"name": "k"}}}, "tls": {"tls": {"secretRef": {"name": "t"}}},
          "networkPolicy": {"networkPolicy": {"enabled": True}}}


async def test_a_real_server_is_scraped_where_ports_says_and_its_metrics_say_its_task():
    """The contract with the server: `python -m embedserve` on the packaged model, bound as the
    operator renders it (the API on 8001, at a pod's address of its own; METRICS_PORT), exports the
    shared signal and the task label the operator reads (status.task) on the port the autoscaler
    scrapes first for each kind of spec: the metrics port."""
    from embedop import render, spec as specs
    from tests.conftest import ServerProcess, pod_addresses

    (ip,) = pod_addresses(render.HTTP_PORT)
    server = ServerProcess({"BIND_HOST": ip, "HTTP_HEALTH_PORT": str(render.HTTP_PORT)}).wait_ready(300)
    ports = {}
    try:
        for guard, fields in GUARDS.items():
            async with Reader() as reader:
                tried = scrape.ports(specs.defaulted({"model": "m", **fields}), server.metrics_port)
                errors = {}
                (sample,) = await reader.scrape([kubelet_pod(ip=ip)], tried, 10, errors)
                assert sample.scraped, (guard, errors)
                assert sample.task == "embed", guard  # scraped: the shared signal was there (REQUIRED)
                ports[guard] = reader.ports["p"]
    finally:
        server.stop()
    # Every guard on the metrics port, and none without one too (the API port only for a server
    # that refuses it: test_a_pod_of_an_older_image_is_read_on_the_api_port).
    assert ports == {"none": server.metrics_port, "auth": server.metrics_port, "tls": server.metrics_port,
                     "networkPolicy": server.metrics_port}


def test_a_missing_metric_is_left_out():
    text = "# TYPE embedfleet_queued_tokens gauge\nembedfleet_queued_tokens 3\n"
    assert scrape.parse_metrics(text) == {"queued_tokens": 3.0}


def pod(name, ip, ready=True):
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                                    "lastTransitionTime": "2026-01-01T00:01:30Z"}]}}


IPS = {"ok": "127.0.0.21", "slow": "127.0.0.22", "broken": "127.0.0.23"}  # "pods" on one port


@pytest.fixture
async def pods_server():
    """A server per pod address (loopback 127.0.0.x), all on one port, as pods share theirs. The
    ok pod answers only once the slow one has been asked (so only a concurrent scrape reads it);
    the slow one never answers."""
    slow_asked, done = asyncio.Event(), asyncio.Event()

    def app(kind):
        async def metrics(request):
            if kind == "slow":
                slow_asked.set()
                await done.wait()
            if kind == "ok":
                await slow_asked.wait()
            if kind == "broken":
                return aiohttp.web.Response(status=500)
            return aiohttp.web.Response(text=exposition(rate=1000, arrival=500, queued=0, offered=10, limit=0.45),
                                        content_type="text/plain")

        a = aiohttp.web.Application()
        a.router.add_get("/metrics", metrics)
        return a

    port = free_port()
    runners = []
    for kind, ip in IPS.items():
        runner = aiohttp.web.AppRunner(app(kind))
        await runner.setup()
        await aiohttp.web.TCPSite(runner, ip, port).start()
        runners.append(runner)
    yield port
    done.set()
    for runner in runners:
        await runner.cleanup()


async def test_scrape_reads_ready_pods_concurrently_and_reports_failures(pods_server):
    """Concurrently: the ok pod, listed first, answers only once the slow one has been asked."""
    pods = [pod(name, ip) for name, ip in IPS.items()] + [
        pod("starting", "127.0.0.24", ready=False), pod("refused", "127.0.0.25")]
    async with Reader() as reader:
        errors = {}
        samples = {s.name: s for s in await reader.scrape(pods, (pods_server,), timeout=2, errors=errors)}
    assert samples["ok"].scraped and samples["ok"].service_rate == 1000 and samples["ok"].startup_s == 90, errors
    assert samples["slow"].ready and not samples["slow"].scraped and samples["slow"].timed_out
    assert samples["broken"].ready and not samples["broken"].scraped and not samples["broken"].timed_out
    assert samples["refused"].ready and not samples["refused"].scraped and not samples["refused"].timed_out
    assert not samples["starting"].ready and not samples["starting"].scraped
    # Each failure's error, by pod, for the MetricsUnavailable condition.
    assert set(errors) == {"slow", "broken", "refused"}
    assert "2 s" in errors["slow"] and "500" in errors["broken"] and "127.0.0.25" in errors["refused"], errors


def test_no_ready_pod_scraped_says_why_and_a_single_success_clears_it():
    failed = [autoscale.PodSample("b", True, False), autoscale.PodSample("a", True, False),
              autoscale.PodSample("starting", False, False)]
    why = scrape.unscraped(failed, {"a": "ClientConnectorError: refused", "b": "x"}, (8002, 8001))
    assert why and "2 ready pod(s)" in why and "a: ClientConnectorError: refused" in why and "8002 or 8001" in why
    assert scrape.unscraped(failed + [autoscale.PodSample("c", True, True)], {}, (8001,)) is None
    assert scrape.unscraped([autoscale.PodSample("starting", False, False)], {}, (8001,)) is None  # none ready


def kubelet_pod(name="p", ready=True, started=True, restarts=0, ready_at="2026-01-01T00:01:30Z",
                running_since="2026-01-01T00:00:20Z", ip="10.0.0.1", deleting=False, last_since=None,
                phase="Running") -> dict:
    """A Pod as the kubelet reports it: the Ready condition and the container's status
    (`last_since`: the previous container's start, when it restarted)."""
    meta = {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T01:00:00Z"
    # The kubelet's first sync: startTime, and Ready=False written with it.
    container = {"name": "server", "image": "embedserve", "imageID": "", "ready": ready, "started": started,
                 "restartCount": restarts, "state": {"running": {"startedAt": running_since}}}
    if last_since:
        container["lastState"] = {"terminated": {"startedAt": last_since, "exitCode": 137}}
    return {"metadata": meta, "status": {
        "phase": phase, "podIP": ip, "startTime": "2026-01-01T00:00:01Z",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": ready_at}],
        "containerStatuses": [container]}}


@pytest.mark.parametrize("pod, served", [
    # Overloaded: readiness fails, the container runs on (`started` stays true).
    (kubelet_pod(ready=False, started=True), True),
    # Its kubelet restarted and lost its state: `started` is false again, but Ready turned False
    # an hour after the container started.
    (kubelet_pod(ready=False, started=False, ready_at="2026-01-01T01:00:00Z"), True),
    # It crashed (CUDA OOM) at 00:30 and restarts: Ready turned False while the previous container ran.
    (kubelet_pod(ready=False, started=False, restarts=1, ready_at="2026-01-01T00:30:00Z",
                 running_since="2026-01-01T00:30:05Z", last_since="2026-01-01T00:00:20Z"), True),
    # New: Ready has been False since the kubelet first wrote it, before the container started.
    (kubelet_pod(ready=False, started=False, ready_at="2026-01-01T00:00:02Z"), False),
    # Crash-looping from the start: never Ready, whatever the restarts.
    (kubelet_pod(ready=False, started=False, restarts=4, ready_at="2026-01-01T00:00:02Z",
                 running_since="2026-01-01T00:05:00Z", last_since="2026-01-01T00:03:00Z"), False),
    # Served, then crash-looping: Ready's transition stays the first crash's (00:30), each restart
    # moves the containers' own times past it.
    (kubelet_pod(ready=False, started=False, restarts=5, ready_at="2026-01-01T00:30:00Z",
                 running_since="2026-01-01T00:45:00Z", last_since="2026-01-01T00:40:00Z"), True),
], ids=["overloaded", "kubelet-restarted", "crashed-and-restarting", "new", "crash-looping", "served-then-crash-looping"])
def test_a_pod_that_served_and_turned_unready_is_not_starting(pod, served):
    """Told from what the API keeps, so an operator restart forgets nothing."""
    view = scrape.pod_view(pod)
    assert (view.ready, view.served) == (False, served)


def test_a_pod_being_deleted_or_failed_for_good_leaves_the_fleet():
    """Deleted, or evicted (phase Failed, kept until the pod garbage collector's threshold): it
    must neither count nor hold the fleet as a blind one would."""
    assert scrape.pod_view(kubelet_pod(deleting=True)) is None
    assert scrape.pod_view(kubelet_pod(ready=False, phase="Failed", ready_at="2026-01-01T01:00:00Z")) is None


def test_start_up_is_creation_to_the_first_ready():
    assert scrape.pod_view(kubelet_pod()).startup_s == 90
    # A flap an hour later: Ready's transition is the flap's, not the start-up's.
    assert scrape.pod_view(kubelet_pod(ready_at="2026-01-01T01:00:00Z")).startup_s is None
    assert scrape.pod_view(kubelet_pod(restarts=1)).startup_s is None  # a restarted container's


async def test_unready_pods_that_served_are_scraped_and_starting_ones_are_not():
    ip, port = "127.0.0.38", free_port()
    server = serve_metrics(ip, port, exposition(rate=1000, arrival=500, queued=0, offered=10, limit=0.45))
    pods = [kubelet_pod("serving", ready=False, started=True, ip=ip),
            kubelet_pod("new", ready=False, started=False, ready_at="2026-01-01T00:00:02Z", ip=ip)]
    try:
        async with Reader() as reader:
            samples = {s.name: s for s in await reader.scrape(pods, (port,), timeout=1)}
    finally:
        server.shutdown()
    assert samples["serving"].scraped and samples["serving"].was_ready and samples["serving"].arrival_rate == 500
    assert not samples["new"].scraped and not samples["new"].was_ready


def test_an_ipv6_pod_address_is_bracketed():
    assert scrape.metrics_url("::1", 8001) == "http://[::1]:8001/metrics"
    assert scrape.metrics_url("fd00:10:244::5", 8001) == "http://[fd00:10:244::5]:8001/metrics"
    assert scrape.metrics_url("10.244.0.5", 8001) == "http://10.244.0.5:8001/metrics"


@pytest.fixture
def ipv6_pod():
    """A pod's /metrics on ::1 (IPv6-only and IPv6-first dual-stack clusters give pods such IPs)."""
    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            body = exposition(rate=1000, arrival=700, queued=0, offered=10, limit=0.45).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = Server(("::1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


async def test_an_ipv6_pod_is_scraped(ipv6_pod):
    async with Reader() as reader:
        errors = {}
        (sample,) = await reader.scrape([kubelet_pod(ip="::1")], (ipv6_pod,), timeout=2, errors=errors)
    assert sample.scraped and sample.arrival_rate == 700, errors


async def test_an_answer_without_the_shared_signal_is_blind_not_zero_demand():
    """Another program on the port, or an incompatible server version: 200 with other series."""
    async def other(request):
        return aiohttp.web.Response(text="# TYPE up gauge\nup 1\n", content_type="text/plain")

    app = aiohttp.web.Application()
    app.router.add_get("/metrics", other)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.26", port).start()
    try:
        async with Reader() as reader:
            errors = {}
            (sample,) = await reader.scrape([kubelet_pod("other", ip="127.0.0.26")], (port,), 1, errors)
    finally:
        await runner.cleanup()
    assert not sample.scraped and "embedfleet_service_rate_tokens_per_second" in errors["other"]
    decision = autoscale.decide([sample], 4, autoscale.Policy(1, 8, 0.7, 1.0, 0, 0), autoscale.History(capacity=100), 0)
    assert decision.desired == 4  # held, not scaled down to min on "no demand"


def stalled_listener(ip: str) -> tuple[socket.socket, int, socket.socket]:
    """A port whose kernel lets no connection through: its one-place accept queue is full and
    nobody accepts, so new SYNs go unanswered (as when a NetworkPolicy drops the packets)."""
    listener = socket.socket()
    listener.bind((ip, 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    parked = socket.create_connection((ip, port))
    return listener, port, parked


@pytest.fixture
async def hanging_pod():
    """A pod whose kernel takes the connection and whose server reads the request and never
    answers: an event loop too busy to get to it. → (ip, port)."""
    ip, done = "127.0.0.31", asyncio.Event()

    async def swallow(reader, writer):
        await reader.read(65536)
        await done.wait()
        writer.close()

    server = await asyncio.start_server(swallow, ip, 0)
    yield ip, server.sockets[0].getsockname()[1]
    done.set()
    server.close()


async def test_a_timeout_on_a_taken_connection_is_told_from_one_never_connected(hanging_pod):
    """No answer in time after the pod's kernel took the connection: `timed_out` (the pod is there
    and too busy; with a hot last reading, saturated). Refused, or no connection at all: blind."""
    ip, port = hanging_pod
    listener, stalled, parked = stalled_listener("127.0.0.32")
    pods = [kubelet_pod("busy", ip=ip), kubelet_pod("refused", ip="127.0.0.33"), kubelet_pod("unreachable", ip="127.0.0.32")]
    try:
        async with Reader() as reader:
            errors = {}
            busy, refused = await reader.scrape(pods[:2], (port,), timeout=0.5, errors=errors)
            (unreachable,) = await reader.scrape(pods[2:], (stalled,), timeout=0.5, errors=errors)
    finally:
        parked.close()
        listener.close()
    assert busy.timed_out and not busy.scraped and "no answer within 0.5 s" in errors["busy"], errors
    assert not refused.timed_out and "ClientConnectorError" in errors["refused"], errors
    assert not unreachable.timed_out and "no connection within 0.5 s" in errors["unreachable"], errors


class AnswersOnce:
    """A pod's metrics port that answers its first request (HTTP/1.1, keep-alive) and then reads
    every request and answers none: `connections` counts the connections its kernel handed it."""

    def __init__(self, ip: str):
        self.ip, self.connections, self.answered, self.done = ip, 0, False, asyncio.Event()
        self.server = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, self.ip, 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer):
        self.connections += 1
        while not self.done.is_set():
            request = await reader.readuntil(b"\r\n\r\n")
            if not request or self.answered:
                await self.done.wait()
                break
            self.answered = True
            body = exposition(rate=1000, arrival=900, queued=0, offered=10, limit=0.45).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: keep-alive\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    def stop(self):
        self.done.set()
        self.server.close()


async def test_a_pod_that_answered_and_then_takes_a_new_scrape_without_answering_is_timed_out():
    """The pod answered once, then its loop was too busy: the next scrape's own connection is
    taken by its kernel, and no answer comes. (A new connection each time: see the next test.)"""
    pod = AnswersOnce("127.0.0.34")
    port = await pod.start()
    try:
        async with Reader() as reader:
            (first,) = await reader.scrape([kubelet_pod(ip=pod.ip)], (port,), timeout=0.5)
            (second,) = await reader.scrape([kubelet_pod(ip=pod.ip)], (port,), timeout=0.5)
    finally:
        pod.stop()
    assert first.scraped and not second.scraped and second.timed_out
    assert pod.connections == 2


async def test_a_pod_cut_off_after_it_answered_is_blind_not_saturated():
    """A node that died without a word, or a partition, after the pod answered: no new connection
    gets through. A request written on the connection kept alive from the answer would only have
    been buffered by our own kernel, and read as saturated (a ×4 step on a fleet that lost a
    node); each scrape makes its own connection, so this one is `no connection`: blind."""
    pod = AnswersOnce("127.0.0.38")
    port = await pod.start()
    listener = parked = None
    try:
        async with Reader() as reader:
            errors = {}
            (first,) = await reader.scrape([kubelet_pod(ip=pod.ip)], (port,), timeout=0.5)
            pod.server.close()  # the old connections stay open and silent; new SYNs go unanswered
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((pod.ip, port))
            listener.listen(0)
            parked = socket.create_connection((pod.ip, port))
            (second,) = await reader.scrape([kubelet_pod(ip=pod.ip)], (port,), timeout=0.5, errors=errors)
    finally:
        pod.stop()
        for s in (parked, listener):
            if s is not None:
                s.close()
    assert first.scraped and not second.scraped and not second.timed_out
    assert "no connection within 0.5 s" in errors["p"], errors


async def test_a_pod_of_an_older_image_is_read_on_the_api_port_and_remembered():
    """An unguarded service is read on the metrics port first; a pod whose server predates it
    refuses that port and is read on the API port, which is then the one asked (a pod's image
    never changes): no refused connection at every step."""
    ip, metrics_port, api_port = "127.0.0.35", free_port(), free_port()
    old = serve_metrics(ip, api_port, exposition(rate=1000, arrival=500, queued=0, offered=10, limit=0.45))
    try:
        async with Reader() as reader:
            errors = {}
            (sample,) = await reader.scrape([kubelet_pod("old", ip=ip)], (metrics_port, api_port), 1, errors)
            assert sample.scraped and sample.arrival_rate == 500 and reader.ports == {"old": api_port}, errors
            other = serve_metrics(ip, metrics_port, exposition(rate=1000, arrival=7, queued=0, offered=10, limit=0.45))
            try:
                (again,) = await reader.scrape([kubelet_pod("old", ip=ip)], (metrics_port, api_port), 1)
            finally:
                other.shutdown()
            assert again.arrival_rate == 500
            # A pod gone is forgotten.
            await reader.scrape([], (metrics_port, api_port), 1)
            assert reader.ports == {}
    finally:
        old.shutdown()


async def test_a_port_that_lets_no_connection_through_falls_back_too():
    """A NetworkPolicy of the user's that admits the API port only (written for an operator that
    read it there) drops the metrics port's packets: after a connect timeout, the API port."""
    ip = "127.0.0.36"
    listener, stalled, parked = stalled_listener(ip)
    api_port = free_port()
    api = serve_metrics(ip, api_port, exposition(rate=1000, arrival=500, queued=0, offered=10, limit=0.45))
    try:
        async with Reader() as reader:
            errors = {}
            (sample,) = await reader.scrape([kubelet_pod("walled", ip=ip)], (stalled, api_port), 0.5, errors)
    finally:
        api.shutdown()
        parked.close()
        listener.close()
    assert sample.scraped and reader.ports == {"walled": api_port}, errors


async def test_a_server_that_answers_on_the_metrics_port_is_never_asked_on_the_api_port():
    """Something answering there without the shared signal is not a reason to try the next port:
    a failure other than no connection is the pod's answer."""
    ip, metrics_port, api_port = "127.0.0.37", free_port(), free_port()
    wrong = serve_metrics(ip, metrics_port, "# TYPE up gauge\nup 1\n")
    api = serve_metrics(ip, api_port, exposition(rate=1000, arrival=500, queued=0, offered=10, limit=0.45))
    try:
        async with Reader() as reader:
            (sample,) = await reader.scrape([kubelet_pod("p", ip=ip)], (metrics_port, api_port), 1)
    finally:
        wrong.shutdown()
        api.shutdown()
    assert not sample.scraped and not sample.timed_out
