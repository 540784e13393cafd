"""HTTP /health and /metrics on a real process, scraped by a real Prometheus server."""

import json
import pathlib
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedfleet.v1 import inference_pb2 as pb
from embedfleet.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, free_port

HEALTH_FIELDS = {
    "status", "accepting_requests", "queued_tokens", "service_rate_tokens_per_sec",
    "arrival_rate_tokens_per_sec", "estimated_drain_time_ms", "p95_server_side_latency_ms",
    "gpu_queue_depth", "embedding_dimension", "uptime_seconds", "reserved_tokens",
}
METRICS = {
    "embedfleet_service_rate_tokens_per_second": "gauge",
    "embedfleet_arrival_rate_tokens_per_second": "gauge",
    "embedfleet_queued_tokens": "gauge",
    "embedfleet_reserved_tokens": "gauge",
    "embedfleet_estimated_drain_seconds": "gauge",
    "embedfleet_queued_requests": "gauge",
    "embedfleet_running_requests": "gauge",
    "embedfleet_admission_backlog_limit_seconds": "gauge",
    "embedfleet_requests_total": "counter",
    "embedfleet_rejected_requests_total": "counter",
    "embedfleet_request_duration_seconds": "histogram",
    "embedfleet_batch_size": "histogram",
    "embedfleet_batch_padded_tokens": "histogram",
    "embedfleet_tokens_total": "counter",
    "embedfleet_model_busy_seconds_total": "counter",
    "embedfleet_offered_tokens_total": "counter",
    "embedfleet_offered_busy_seconds_total": "counter",
    "embedfleet_demand_busy_seconds_per_second": "gauge",
    "embedfleet_capacity_busy_seconds_per_second": "gauge",
    "embedfleet_model_memory_bytes": "gauge",
    "embedfleet_gpu_memory_bytes": "gauge",
    "embedfleet_model_info": "gauge",
}


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_starting_is_503_and_not_serving_until_warm_up_ends():
    # A slow simulated device makes warm-up take seconds: long enough to look at "starting".
    server = ServerProcess({"MODEL_PATH": "sim:300", "BATCH_CAPS": "16:1,32:1,64:1,128:1,256:1,512:1"})
    try:
        first = None
        deadline = time.monotonic() + 60
        while first is None and time.monotonic() < deadline:
            try:
                first = server.health()
            except OSError:
                time.sleep(0.05)
        code, fields = first
        assert code == 503 and fields["status"] == "starting" and fields["accepting_requests"] is False
        channel = grpc.insecure_channel(server.target)
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.InferenceStub(channel).Embed(pb.EmbedRequest(texts=["too early"]))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in e.value.details()
        server.wait_ready()
        assert server.health()[1]["status"] == "healthy"
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert server.stop() == 0


def test_health_has_every_contract_field(default_server):
    code, fields = default_server.health()
    assert code == 200 and HEALTH_FIELDS <= set(fields)
    grpc_fields = pb.HealthCheckResponse.DESCRIPTOR.fields_by_name
    assert HEALTH_FIELDS <= set(grpc_fields)


def parse_families(text):
    families = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            families[name] = kind
    return families


def test_metrics_expose_every_contract_metric_with_labels(default_server):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(default_server.target))
    stub.Embed(pb.EmbedRequest(texts=["count me"]))
    text = get(default_server.http + "/metrics")
    families = parse_families(text)
    for name, kind in METRICS.items():
        assert families.get(name) == kind, (name, families.get(name))
    # The default server's model is named by SERVED_MODEL_NAME's default: the packaged model's.
    assert 'embedfleet_requests_total{code="OK",model="all-MiniLM-L6-v2",rpc="Embed"}' in text
    assert 'embedfleet_tokens_total{kind="real"}' in text and 'embedfleet_tokens_total{kind="padded"}' in text
    from prometheus_client.parser import text_string_to_metric_families

    info = next(f for f in text_string_to_metric_families(text) if f.name == "embedfleet_model_info").samples[0].labels
    assert {k: info[k] for k in ("device", "dimension", "dtype", "pooling", "normalize", "max_length", "prompts")} == {
        "device": "cpu", "dimension": "384", "dtype": "float32", "pooling": "mean", "normalize": "true",
        "max_length": "256", "prompts": ""}  # all-MiniLM-L6-v2 as it declares itself
    # This server's 600 s budget less the reorder window: at least the 50 ms deadline, at most half
    limit = float(re.search(r'^embedfleet_admission_backlog_limit_seconds\{model="all-MiniLM-L6-v2"} (\S+)$', text,
                            re.M).group(1))
    assert 300 <= limit <= 600 - 0.05
    busy = float(re.search(r'^embedfleet_model_busy_seconds_total\{model="all-MiniLM-L6-v2"} (\S+)$', text,
                           re.M).group(1))
    assert 0 < busy < default_server.health()[1]["uptime_seconds"]  # some model time, less than the uptime


@pytest.mark.skipif(not shutil.which("promtool"), reason="Debian's prometheus package is not installed")
def test_promtool_finds_no_problems(default_server):
    text = get(default_server.http + "/metrics")
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "" and out.stderr.strip() == "", out.stdout + out.stderr


@pytest.fixture
def prometheus(tmp_path, default_server):
    if not shutil.which("prometheus"):
        pytest.skip("Debian's prometheus package is not installed")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: embedfleet\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{default_server.http_port}']}}]\n"
    )
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(30)


def query(prom, promql):
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        body = json.loads(get(url))
    except OSError:
        return None
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError("condition not met in time")


def test_a_real_prometheus_scrapes_the_shared_signal(prometheus, default_server):
    rate = wait_for(lambda: query(prometheus, "embedfleet_service_rate_tokens_per_second > 0"))
    assert rate > 0
    before = query(prometheus, 'embedfleet_tokens_total{kind="real"}') or 0.0
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(default_server.target))
    sent = stub.Embed(pb.EmbedRequest(texts=["prometheus should see these tokens"] * 8))
    assert sent.shape[0] == 8
    after = wait_for(lambda: (v := query(prometheus, 'embedfleet_tokens_total{kind="real"}')) and v > before and v)
    assert after >= before + 8 * 7


def test_the_shipped_autoscaling_promql_reads_offered_load_from_a_real_prometheus(prometheus, default_server):
    """The chart's prometheus-adapter rule and the KEDA query of docs/operator.md, evaluated for real."""
    import yaml  # noqa: PLC0415 - only this test reads the chart

    root = pathlib.Path(__file__).resolve().parents[2]
    rule = yaml.safe_load((root / "charts/embedfleet/values.yaml").read_text())["prometheusAdapter"]["rules"][0]
    adapter = rule["metricsQuery"].replace("<<.LabelMatchers>>", 'job="embedfleet"').replace("<<.GroupBy>>", "job")
    guide = (root / "docs" / "operator.md").read_text()
    keda = guide[guide.index("query: |") + len("query: |"):guide.index("threshold:")]
    keda = " ".join(line.split("#")[0].strip() for line in keda.splitlines()).replace('service="minilm"', 'job="embedfleet"')
    wait_for(lambda: query(prometheus, "embedfleet_service_rate_tokens_per_second > 0"))
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(default_server.target))
    deadline = time.monotonic() + 60
    ratio = None
    while time.monotonic() < deadline and not ratio:
        stub.Embed(pb.EmbedRequest(texts=["offered load for the autoscaler"] * 4))
        ratio = query(prometheus, adapter)
        time.sleep(0.25)
    assert ratio and 0 < ratio < 1  # offered / capacity: some load, far below one replica
    needed = query(prometheus, keda)
    assert needed and needed == pytest.approx(ratio / 0.7, rel=0.5)  # the same signal, over 0.7
