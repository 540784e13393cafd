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

from embedop import autoscale, autoscaler
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
    got = autoscaler.parse_metrics(exposition(rate=1500.5, arrival=900, queued=12, offered=34567, limit=0.4))
    assert got == {"service_rate": 1500.5, "arrival_rate": 900.0, "queued_tokens": 12.0, "offered_total": 34567.0,
                   "backlog_limit_s": 0.4}


def test_every_mapped_metric_is_a_pod_sample_field():
    fields = {f.name for f in dataclasses.fields(autoscale.PodSample)}
    assert set(autoscaler.METRICS.values()) <= fields


def test_the_served_task_is_the_task_label_of_model_info():
    """The server's info metric, as prometheus_client's Info writes it, with and without the label."""
    def with_info(labels: dict) -> str:
        reg = prometheus_client.CollectorRegistry()
        prometheus_client.Gauge("embedfleet_queued_tokens", "queued", registry=reg).set(2)
        prometheus_client.Info("embedfleet_model", "model", registry=reg).info(labels)
        return prometheus_client.generate_latest(reg).decode()
    assert autoscaler.read_exposition(with_info({"model": "m", "task": "rerank"})) == ({"queued_tokens": 2.0}, "rerank")
    assert autoscaler.read_exposition(with_info({"model": "m", "device": "cpu"}))[1] is None
    assert autoscaler.read_exposition(exposition(rate=1, arrival=1, queued=0, offered=1, limit=1))[1] is None


def test_a_real_servers_metrics_say_its_task(default_server):
    """The contract with the server: `python -m embedserve` on the packaged model (the session's
    server) exports the shared signal and the task label the operator reads (status.task)."""
    import urllib.request

    text = urllib.request.urlopen(default_server.http + "/metrics", timeout=10).read().decode()
    values, task = autoscaler.read_exposition(text)
    assert set(autoscaler.REQUIRED) <= set(values)
    assert task == "embed"


def test_a_missing_metric_is_left_out():
    text = "# TYPE embedfleet_queued_tokens gauge\nembedfleet_queued_tokens 3\n"
    assert autoscaler.parse_metrics(text) == {"queued_tokens": 3.0}


def pod(name, ip, ready=True):
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                                    "lastTransitionTime": "2026-01-01T00:01:30Z"}]}}


IPS = {"ok": "127.0.0.21", "slow": "127.0.0.22", "broken": "127.0.0.23"}  # "pods" on one port


@pytest.fixture
async def pods_server():
    """A server per pod address (loopback 127.0.0.x), all on one port, as pods share theirs."""
    def app(kind):
        async def metrics(request):
            if kind == "slow":
                await asyncio.sleep(2)
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
    for runner in runners:
        await runner.cleanup()


async def test_scrape_reads_ready_pods_concurrently_and_reports_failures(pods_server):
    pods = [pod(name, ip) for name, ip in IPS.items()] + [
        pod("starting", "127.0.0.24", ready=False), pod("refused", "127.0.0.25")]
    async with aiohttp.ClientSession() as session:
        start = asyncio.get_running_loop().time()
        errors = {}
        samples = {s.name: s for s in await autoscaler.scrape(session, pods, port=pods_server, timeout=0.5,
                                                              errors=errors)}
        took = asyncio.get_running_loop().time() - start
    assert took < 1.5  # concurrent, and the slow pod is cut off at the timeout
    assert samples["ok"].scraped and samples["ok"].service_rate == 1000 and samples["ok"].startup_s == 90
    assert samples["slow"].ready and not samples["slow"].scraped
    assert samples["broken"].ready and not samples["broken"].scraped
    assert samples["refused"].ready and not samples["refused"].scraped
    assert not samples["starting"].ready and not samples["starting"].scraped
    # Each failure's error, by pod, for the MetricsUnavailable condition.
    assert set(errors) == {"slow", "broken", "refused"}
    assert "0.5 s" in errors["slow"] and "500" in errors["broken"] and "127.0.0.25" in errors["refused"], errors


def test_no_ready_pod_scraped_says_why_and_a_single_success_clears_it():
    failed = [autoscale.PodSample("b", True, False), autoscale.PodSample("a", True, False),
              autoscale.PodSample("starting", False, False)]
    why = autoscaler.unscraped(failed, {"a": "ClientConnectorError: refused", "b": "x"}, 8001)
    assert why and "2 ready pod(s)" in why and "a: ClientConnectorError: refused" in why and "8001" in why
    assert autoscaler.unscraped(failed + [autoscale.PodSample("c", True, True)], {}, 8001) is None
    assert autoscaler.unscraped([autoscale.PodSample("starting", False, False)], {}, 8001) is None  # none ready


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
    view = autoscaler.pod_view(pod)
    assert (view.ready, view.served) == (False, served)


def test_a_pod_being_deleted_or_failed_for_good_leaves_the_fleet():
    """Deleted, or evicted (phase Failed, kept until the pod garbage collector's threshold): it
    must neither count nor hold the fleet as a blind one would."""
    assert autoscaler.pod_view(kubelet_pod(deleting=True)) is None
    assert autoscaler.pod_view(kubelet_pod(ready=False, phase="Failed", ready_at="2026-01-01T01:00:00Z")) is None


def test_start_up_is_creation_to_the_first_ready():
    assert autoscaler.pod_view(kubelet_pod()).startup_s == 90
    # A flap an hour later: Ready's transition is the flap's, not the start-up's.
    assert autoscaler.pod_view(kubelet_pod(ready_at="2026-01-01T01:00:00Z")).startup_s is None
    assert autoscaler.pod_view(kubelet_pod(restarts=1)).startup_s is None  # a restarted container's


async def test_unready_pods_that_served_are_scraped_and_starting_ones_are_not(pods_server):
    pods = [kubelet_pod("serving", ready=False, started=True, ip=IPS["ok"]),
            kubelet_pod("new", ready=False, started=False, ready_at="2026-01-01T00:00:02Z", ip=IPS["ok"])]
    async with aiohttp.ClientSession() as session:
        samples = {s.name: s for s in await autoscaler.scrape(session, pods, port=pods_server, timeout=1)}
    assert samples["serving"].scraped and samples["serving"].was_ready and samples["serving"].arrival_rate == 500
    assert not samples["new"].scraped and not samples["new"].was_ready


def test_an_ipv6_pod_address_is_bracketed():
    assert autoscaler.metrics_url("::1", 8001) == "http://[::1]:8001/metrics"
    assert autoscaler.metrics_url("fd00:10:244::5", 8001) == "http://[fd00:10:244::5]:8001/metrics"
    assert autoscaler.metrics_url("10.244.0.5", 8001) == "http://10.244.0.5:8001/metrics"


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
    async with aiohttp.ClientSession() as session:
        errors = {}
        (sample,) = await autoscaler.scrape(session, [kubelet_pod(ip="::1")], port=ipv6_pod, timeout=2, errors=errors)
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
        async with aiohttp.ClientSession() as session:
            errors = {}
            (sample,) = await autoscaler.scrape(session, [kubelet_pod("other", ip="127.0.0.26")], port, 1, errors)
    finally:
        await runner.cleanup()
    assert not sample.scraped and "embedfleet_service_rate_tokens_per_second" in errors["other"]
    decision = autoscale.decide([sample], 4, autoscale.Policy(1, 8, 0.7, 1.0, 0, 0), autoscale.History(capacity=100), 0)
    assert decision.desired == 4  # held, not scaled down to min on "no demand"
