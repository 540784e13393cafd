"""The shipped autoscaling PromQL, evaluated by a real Prometheus on pods of several models: the
chart's prometheus-adapter rule (mode hpa's per-pod `embedfleet_load_ratio`) and the KEDA query of
docs/operator.md. A pod's utilization is its offered device time (every model's tokens over that
model's own service rate: `embedfleet_offered_busy_seconds_total`) over its capacity (1 per
device), whatever its models; a pod of a server from before those series (one model, no model
label) is read as its offered tokens/s over its service rate. The stand-in pods export what the
servers export; tests/server/test_http_and_metrics.py evaluates the same queries on a real server."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from bench.operator_load import serve_metrics
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not shutil.which("prometheus"), reason="Debian's prometheus package is not installed")

# Each pod's offered device time per second (its utilization), and what it exports.
PODS = {
    # Two models on one device: dense 900 tok/s of 3000 (0.3) + rerank 200 tok/s of 500 (0.4) = 0.7 busy.
    "shared": {"busy": 0.7, "models": {"dense": (900.0, 3000.0), "rerank": (200.0, 500.0)}},
    # One model, labelled: 250 tok/s of 1000 = 0.25 busy.
    "one": {"busy": 0.25, "models": {"minilm": (250.0, 1000.0)}},
    # A server from before the model label and the busy-seconds series: 400 tok/s of 800 = 0.5.
    "old": {"busy": 0.5, "models": {"": (400.0, 800.0)}},
}


def exposition(pod: dict, elapsed: float) -> str:
    """Counters grown for `elapsed` seconds at the pod's rates; gauges as they stand."""
    lines = []
    for model, (offered, rate) in pod["models"].items():
        label = f'{{model="{model}"}}' if model else ""
        lines += [f"embedfleet_offered_tokens_total{label} {offered * elapsed}",
                  f"embedfleet_service_rate_tokens_per_second{label} {rate}",
                  f"embedfleet_arrival_rate_tokens_per_second{label} {offered}"]
    if "" not in pod["models"]:  # a server of this release: the pod's device time
        lines += [f"embedfleet_offered_busy_seconds_total {pod['busy'] * elapsed}",
                  f"embedfleet_demand_busy_seconds_per_second {pod['busy']}",
                  "embedfleet_capacity_busy_seconds_per_second 1"]
    kinds = {"offered_tokens_total": "counter", "service_rate_tokens_per_second": "gauge",
             "arrival_rate_tokens_per_second": "gauge", "offered_busy_seconds_total": "counter",
             "demand_busy_seconds_per_second": "gauge", "capacity_busy_seconds_per_second": "gauge"}
    text = "".join(f"# TYPE embedfleet_{name} {kind}\n" + "".join(
        line + "\n" for line in lines if line.startswith(f"embedfleet_{name}{{") or line.startswith(f"embedfleet_{name} "))
        for name, kind in kinds.items())
    return text


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """A real Prometheus scraping the stand-in pods every SCRAPE_MS, each target labelled as the
    chart's ServiceMonitor labels the servers' series (namespace, service, pod)."""
    tmp = tmp_path_factory.mktemp("prometheus")
    start, servers, targets = time.monotonic(), [], []
    for name, pod in PODS.items():
        port = free_port()
        servers.append(serve_metrics("127.0.0.1", port, lambda pod=pod: exposition(pod, time.monotonic() - start)))
        targets.append(f"{{targets: ['127.0.0.1:{port}'], labels: {{namespace: search, service: stack, pod: {name}}}}}")
    port = free_port()
    (tmp / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {SCRAPE_MS}ms, evaluation_interval: 1s}}\n"
        f"scrape_configs:\n  - job_name: embedfleet\n    static_configs: [{', '.join(targets)}]\n")
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(30)
    for server in servers:
        server.shutdown()


def query(prometheus: str, promql: str) -> dict[str, float] | None:
    """The instant vector, by its pod label ("" for none); None while Prometheus is not up."""
    try:
        with urllib.request.urlopen(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql}), timeout=5) as r:
            body = json.loads(r.read())
    except OSError:
        return None
    return {s["metric"].get("pod", ""): float(s["value"][1]) for s in body["data"]["result"]}


# rate() divides a counter's increase by the whole window, extrapolating at most half a scrape
# interval past the first and last samples: a window the series does not fill yet reads low, and a
# full one by up to an interval. The shipped queries' 1m is shortened to WINDOW, scraped every
# SCRAPE_MS, and a query waits until every pod has been scraped through all of it.
WINDOW, SCRAPE_MS = "5s", 250
SCRAPES = 5000 // SCRAPE_MS  # in a whole window


def settled(prometheus: str, promql: str, count: int, timeout: float = 60.0) -> dict[str, float]:
    """The query's answer (its windows WINDOW) once every pod has been scraped through a whole
    window, and it has `count` series."""
    promql = promql.replace("[1m]", f"[{WINDOW}]")
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        scraped = query(prometheus, f'min(count_over_time(up{{job="embedfleet"}}[{WINDOW}]))')
        last = query(prometheus, promql) if scraped and min(scraped.values()) >= SCRAPES - 1 else None
        if last is not None and len(last) == count:
            return last
        time.sleep(0.5)
    raise AssertionError(f"{promql}: {last}")


def adapter_rule() -> str:
    rule = yaml.safe_load((ROOT / "charts/embedfleet/values.yaml").read_text())["prometheusAdapter"]["rules"][0]
    assert rule["name"]["as"] == "embedfleet_load_ratio"
    # As prometheus-adapter fills it in for the HPA's pods of one service, grouped by pod.
    return rule["metricsQuery"].replace("<<.LabelMatchers>>", 'namespace="search",service="stack"').replace(
        "<<.GroupBy>>", "pod")


def keda_query() -> str:
    guide = (ROOT / "docs" / "operator.md").read_text()
    block = guide[guide.index("query: |") + len("query: |"):guide.index("threshold:")]
    return " ".join(line.split("#")[0].strip() for line in block.splitlines()).replace('service="minilm"', 'service="stack"')


def test_the_adapter_rule_is_each_pods_utilization_whatever_its_models(prometheus):
    ratios = settled(prometheus, adapter_rule(), len(PODS))
    assert ratios == {name: pytest.approx(pod["busy"], rel=0.1) for name, pod in PODS.items()}


def test_the_keda_query_is_the_fleets_device_time_over_the_target(prometheus):
    settled(prometheus, adapter_rule(), len(PODS))  # every pod's rates are there
    (needed,) = settled(prometheus, keda_query(), 1).values()
    assert needed == pytest.approx(sum(pod["busy"] for pod in PODS.values()) / 0.7, rel=0.1)


def test_averaging_the_service_rate_would_mix_the_models(prometheus):
    """What the adapter rule used to say: a pod's offered tokens over its service rates, summed
    over the labels. On the shared pod that is no utilization at all (0.31 for a pod busy 0.7)."""
    old = settled(prometheus, 'sum by (pod) (rate(embedfleet_offered_tokens_total{pod="shared"}[1m])) '
                              '/ sum by (pod) (embedfleet_service_rate_tokens_per_second{pod="shared"})', 1)
    assert old["shared"] == pytest.approx(1100 / 3500, rel=0.1) and old["shared"] < PODS["shared"]["busy"] / 2
