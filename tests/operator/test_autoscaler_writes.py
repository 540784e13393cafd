"""What the autoscaler writes besides the count, with the real operator process, kmock as the API
server and one Pod whose /metrics the test serves (or does not): a Warning condition and Event when
no ready pod can be scraped, cleared when one can; the count it scales to written into the
service's spec.replicas, so that a switch to mode off alone keeps the fleet.

The emulator runs no controllers: the Pod is posted by the test, ready, at an address of its own
(a loopback address); nothing listens there until the test serves the shared signal on it. Where:
the ports scrape.ports names, the metrics port (EMBEDOP_METRICS_PORT) and, for a service without
keys, TLS or a NetworkPolicy, the API port after it (a server image from before the metrics port
refuses that)."""

from __future__ import annotations

import pytest

from bench.operator_load import exposition, serve_metrics
from embedop import render
from tests.conftest import free_port, pod_addresses
from tests.operator import emulator as em
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

NS, NAME = "default", "signal"
PORT = free_port()  # the operator's metrics port (EMBEDOP_METRICS_PORT)
POD_IP, REFUSED_IP, GUARDED_IP = pod_addresses(render.HTTP_PORT, 3)
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"
# One pod offered 4000 tokens/s with a capacity of 1000: ceil(4000 / (1000 × 0.7)) = 6 replicas.
EXPOSITION = exposition(service_rate=1000, arrival_rate=4000)


@pytest.fixture(scope="module")
def operator_(emulator, tmp_path_factory):
    d = tmp_path_factory.mktemp("signal")
    op = OperatorProcess(emulator.kubeconfig(d / "kubeconfig"), d / "operator.log",
                         env={"EMBEDOP_METRICS_PORT": str(PORT), "EMBEDOP_SCRAPE_TIMEOUT_S": "1"})
    yield op
    op.stop()


@pytest.fixture(scope="module")
def pod_metrics():
    """→ start(): serve the pod's /metrics on the API port from then on, as a server image from
    before the metrics port does (nothing listens on that)."""
    servers = []

    def start():
        servers.append(serve_metrics(POD_IP, render.HTTP_PORT, EXPOSITION))

    yield start
    for server in servers:
        server.shutdown()


def condition(emulator, type_) -> dict:
    cr = emulator.get(service_path(NS, NAME))
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def warnings(emulator, reason, name=NAME) -> list[dict]:
    return [e for e in emulator.get(f"/api/v1/namespaces/{NS}/events")["items"]
            if e.get("involvedObject", {}).get("name") == name and e.get("reason") == reason]


def test_unscrapable_then_scraped_then_scaled_and_switched_off(emulator, operator_, pod_metrics):
    """One service through three stages, in order (each needs the one before): no pod can be
    scraped (a condition and a Warning, the count held); a pod serves its signal (the condition
    clears); the autoscaler grows the fleet and a switch of the mode alone to off keeps it."""
    # 1. No scrapable pod is a condition and a warning.
    emulator.request("POST", service_path(NS), new_service(NAME, {
        "model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 6, "intervalSeconds": 1}}))
    eventually(lambda: emulator.get(DEPLOY))
    emulator.request("POST", f"/api/v1/namespaces/{NS}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{NAME}-0", "namespace": NS, "labels": render.labels(NAME)},
        "spec": {"containers": [{"name": "server", "image": "embedserve"}]},
        "status": {"phase": "Running", "podIP": POD_IP, "conditions": [{"type": "Ready", "status": "True"}]}})
    # Nothing listens on either port an unguarded service is read on (scrape.ports).
    c = eventually(lambda: (c := condition(emulator, "MetricsUnavailable")).get("status") == "True" and c, timeout=30)
    assert c["reason"] == "ScrapeFailed" and f"{NAME}-0" in c["message"], c
    assert f"on port {PORT} or {render.HTTP_PORT} /metrics" in c["message"], c
    assert "held" in c["message"]
    (event,) = eventually(lambda: warnings(emulator, "MetricsUnavailable"))
    assert event["type"] == "Warning" and f"{NAME}-0" in event["message"]
    assert emulator.get(DEPLOY)["spec"]["replicas"] == 1  # the count is held

    # 2. The condition clears once a pod can be scraped: an older server, on the API port.
    pod_metrics()
    eventually(lambda: condition(emulator, "MetricsUnavailable").get("status") == "False", timeout=30)
    assert condition(emulator, "MetricsUnavailable")["reason"] == "Scraped"

    # 3. The autoscaler's count is written into spec.replicas and kept by a switch to off (the
    # reported bug: spec.replicas 1, the autoscaler grows the fleet to 6, a patch of the mode
    # alone to off applied spec.replicas (1), killing five pods).
    eventually(lambda: emulator.get(DEPLOY)["spec"]["replicas"] == 6, timeout=60)
    eventually(lambda: emulator.get(service_path(NS, NAME))["spec"]["replicas"] == 6)
    mark = len(em.applies)
    emulator.merge_patch(service_path(NS, NAME), {"spec": {"autoscaling": {"mode": "off"}}})

    def caught_up():  # the reconcile has applied the switch (or found nothing to change)
        cr = emulator.get(service_path(NS, NAME))
        return cr["status"].get("observedGeneration") == cr["metadata"]["generation"] and cr
    cr = eventually(caught_up)
    counts = [a["body"]["spec"].get("replicas") for a in em.applies[mark:] if a["kind"] == "Deployment" and a["name"] == NAME]
    assert set(counts) <= {6} and emulator.get(DEPLOY)["spec"]["replicas"] == 6, counts
    assert cr["status"]["desiredReplicas"] == 6


def test_the_count_changes_while_admission_refuses_the_rest_of_the_spec(emulator, operator_):
    """A policy (Kyverno, Gatekeeper) refuses the Deployment after a spec edit: the autoscaler still
    changes the count, through the scale subresource (which such webhooks do not judge), and the
    refusal shows as a condition. Once the policy allows it, one apply brings the spec and takes
    the count back, never dropping it, and then nothing more is applied."""
    name, ip = "refused", REFUSED_IP
    deploy = f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"
    emulator.request("POST", service_path(NS), new_service(name, {
        "model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 6, "intervalSeconds": 1}}))
    eventually(lambda: emulator.get(deploy))

    def debug_logging(obj):
        env = (obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}])[0].get("env") or []
        if obj.get("kind") == "Deployment" and {"name": "LOG_LEVEL", "value": "DEBUG"} in env:
            return "policy no-debug-logs: LOG_LEVEL=DEBUG is not allowed"
    em.policies.append(debug_logging)
    try:
        emulator.merge_patch(service_path(NS, name), {"spec": {"env": [{"name": "LOG_LEVEL", "value": "DEBUG"}]}})
        c = eventually(lambda: (c := condition_of(emulator, name, "Degraded")).get("reason") == "RejectedByAPI" and c)
        assert "no-debug-logs" in c["message"]
        # Demand for 6 replicas arrives: the count changes all the same.
        server = serve_metrics(ip, render.HTTP_PORT, EXPOSITION)
        emulator.request("POST", f"/api/v1/namespaces/{NS}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-0", "namespace": NS, "labels": render.labels(name)},
            "spec": {"containers": [{"name": "server", "image": "embedserve"}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})
        eventually(lambda: emulator.get(deploy)["spec"]["replicas"] == 6, timeout=30)
        mark = len(em.applies)  # every apply from here on (refused or not) must carry the count
        assert "LOG_LEVEL" not in {e["name"] for e in emulator.get(deploy)["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert ("apps", "deployments/scale", "patch") in em.recorded["operator"]
        assert eventually(lambda: warnings(emulator, "RejectedByAPI", name))
    finally:
        em.policies.remove(debug_logging)
    # The policy is lifted: the spec goes through, the count stays, and the fleet settles.
    eventually(lambda: {"name": "LOG_LEVEL", "value": "DEBUG"} in
               emulator.get(deploy)["spec"]["template"]["spec"]["containers"][0]["env"], timeout=30)
    counts = [a["body"]["spec"].get("replicas") for a in em.applies[mark:] if a["kind"] == "Deployment" and a["name"] == name]
    assert counts and set(counts) == {6} and emulator.get(deploy)["spec"]["replicas"] == 6, counts
    eventually(lambda: condition_of(emulator, name, "Degraded").get("status") == "False")
    settled = len([a for a in em.applies if a["name"] == name])
    log_mark = len(operator_.log())
    eventually(lambda: operator_.log()[log_mark:].count(f"{NS}/{name}: periodic check done") >= 3, timeout=30)
    assert len([a for a in em.applies if a["name"] == name]) == settled  # no re-apply loop
    server.shutdown()


def condition_of(emulator, name, type_) -> dict:
    cr = emulator.get(service_path(NS, name))
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def test_a_guarded_service_is_read_on_the_metrics_port(emulator, operator_):
    """API keys on: the operator scrapes the plain metrics port (EMBEDOP_METRICS_PORT), where no
    key is needed, and never the API port, which would want one (nothing answers there here)."""
    name, deploy = "keyed", f"/apis/apps/v1/namespaces/{NS}/deployments/keyed"
    spec = {"model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
            "auth": {"apiKeySecretRef": {"name": "keyed-keys"}},
            "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 6, "intervalSeconds": 1}}
    assert render.health_port(spec, PORT) == PORT
    server = serve_metrics(GUARDED_IP, PORT, EXPOSITION)
    try:
        emulator.request("POST", service_path(NS), new_service(name, spec))
        eventually(lambda: emulator.get(deploy))
        emulator.request("POST", f"/api/v1/namespaces/{NS}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-0", "namespace": NS, "labels": render.labels(name)},
            "spec": {"containers": [{"name": "server", "image": "embedserve"}]},
            "status": {"phase": "Running", "podIP": GUARDED_IP, "conditions": [{"type": "Ready", "status": "True"}]}})
        eventually(lambda: emulator.get(deploy)["spec"]["replicas"] == 6, timeout=60)
        assert condition_of(emulator, name, "MetricsUnavailable")["reason"] == "Scraped"
    finally:
        server.shutdown()
