"""The autoscaler at its edges, with the real operator process, kmock as the API server and Pods
the test posts, ready, at loopback addresses of their own, whose /metrics it serves on the
metrics port (EMBEDOP_METRICS_PORT):

- a fleet too busy to answer its scrapes (each takes the connection, none answers) grows by the
  usual step, where it used to hold;
- before a scale-down, the pods to remove (the idlest) get the lowest deletion cost, once the
  Deployment read fresh still has the count decided on, so the ReplicaSet removes those; marks a
  dropped decision left are cleared at a later step;
- a Deployment deleted between its copy's read and the scale subresource's call (404) does not
  end the service's loop: the Deployment is made again.

The emulator runs no controllers: a count raised in the Deployment makes no Pods, so the pods a
step adds stay "starting" (capacity on its way) for the rest of a test."""

from __future__ import annotations

import http.server
import threading

import pytest

from bench.operator_load import exposition
from embedop import autoscale, render
from tests.conftest import free_port, pod_addresses
from tests.operator import emulator as em
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

NS = "default"
PORT = free_port()  # the operator's metrics port (EMBEDOP_METRICS_PORT)
PODS = f"/api/v1/namespaces/{NS}/pods"


@pytest.fixture(scope="module")
def operator_(emulator, tmp_path_factory):
    d = tmp_path_factory.mktemp("edges")
    op = OperatorProcess(emulator.kubeconfig(d / "kubeconfig"), d / "operator.log",
                         env={"EMBEDOP_METRICS_PORT": str(PORT), "EMBEDOP_SCRAPE_TIMEOUT_S": "0.5"})
    yield op
    op.stop()


class Pod:
    """A pod's metrics port: answers `text`, or, once `hang()`ed, takes each scrape and answers
    nothing (an event loop too busy to get to it) until `answer()`."""

    def __init__(self, ip: str, text: str):
        self.text, self.answering = text, threading.Event()
        self.answering.set()
        pod = self

        class Metrics(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server API
                pod.answering.wait()
                body = pod.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # a scrape the operator gave up on
                pass

        self.server = Server((ip, PORT), Metrics)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hang(self) -> None:
        self.answering.clear()

    def answer(self) -> None:
        self.answering.set()

    def stop(self) -> None:
        self.answering.set()
        self.server.shutdown()
        self.server.server_close()


def post_pod(emulator, service: str, name: str, ip: str) -> None:
    emulator.request("POST", PODS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": render.labels(service)},
        "spec": {"containers": [{"name": "server", "image": "embedserve"}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})


def replicas(emulator, name: str) -> int:
    return emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}")["spec"]["replicas"]


def decisions(operator_, name: str, since: int) -> int:
    """The autoscaler's decisions on `name` logged since `since` (a log offset): a step ran."""
    return operator_.log()[since:].count(f"autoscale {name}: ")


def condition(emulator, name: str, type_: str) -> dict:
    cr = emulator.get(service_path(NS, name))
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def test_a_fleet_too_busy_to_answer_grows_by_the_step(emulator, operator_):
    """Two pods at their target (700 of 1,000 tok/s at 0.7); then every scrape is taken and not
    answered. They read as saturated: ×4 (2 → 8), then no more while the six added are starting;
    the condition says why. Held (the old reading of an unanswered scrape), they stayed 2."""
    name = "busy"
    emulator.request("POST", service_path(NS), new_service(name, {
        "model": "m", "replicas": 2, "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 20, "intervalSeconds": 1}}))
    eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"))
    pods = [Pod(ip, exposition(service_rate=1000, arrival_rate=700)) for ip in pod_addresses(PORT, 2)]
    try:
        for i, pod in enumerate(pods):
            post_pod(emulator, name, f"{name}-{i}", pod.server.server_address[0])
        eventually(lambda: condition(emulator, name, "MetricsUnavailable").get("reason") == "Scraped", timeout=30)
        mark = len(operator_.log())
        eventually(lambda: decisions(operator_, name, mark) >= 2, timeout=30)
        assert replicas(emulator, name) == 2  # at target: steady
        for pod in pods:
            pod.hang()
        eventually(lambda: replicas(emulator, name) == 8, timeout=30)
        reason = eventually(lambda: emulator.get(service_path(NS, name))["status"].get("lastScaleReason"))
        assert "2 pod(s) saturated" in reason, reason
        c = eventually(lambda: (c := condition(emulator, name, "MetricsUnavailable")).get("reason") == "Saturated" and c)
        assert c["status"] == "True" and "fleet grows" in c["message"], c
        mark = len(operator_.log())
        eventually(lambda: decisions(operator_, name, mark) >= 3, timeout=30)
        assert replicas(emulator, name) == 8  # the six starting pods are capacity on its way
    finally:
        for pod in pods:
            pod.stop()


def test_the_idlest_pods_are_the_ones_a_scale_down_removes(emulator, operator_):
    """Three pods, 100 tok/s each of 1,000 (one pod's worth), queues of 0, 120 and 300 tokens
    (each within what a pod at its target holds: no backlog): 3 → 1 at once (no window). Before,
    the Deployment is read from the API (its count still 3) and the two idlest pods, and only
    they, get the lowest cost: the one that stays keeps none. Settled (the emulator's Deployment
    removes no pod: a scale-down under way), no pod is written again."""
    name = "trim"
    emulator.request("POST", service_path(NS), new_service(name, {
        "model": "m", "replicas": 3, "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 6, "intervalSeconds": 1,
                        "scaleDownStabilizationSeconds": 0}}))
    eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"))
    ips = pod_addresses(PORT, 3)
    for i, ip in enumerate(ips):  # posted before any answers: unread pods hold the count
        post_pod(emulator, name, f"{name}-{i}", ip)
    mark = len(em.calls)
    pods = [Pod(ip, exposition(service_rate=1000, arrival_rate=100, queued=queued)) for ip, queued in zip(ips, (0, 120, 300))]
    try:
        eventually(lambda: replicas(emulator, name) == 1, timeout=30)
        costs = {i: (emulator.get(f"{PODS}/{name}-{i}")["metadata"].get("annotations") or {}).get(autoscale.DELETION_COST)
                 for i in range(3)}
        assert costs == {0: autoscale.REMOVAL_COST, 1: autoscale.REMOVAL_COST, 2: None}, costs
        calls = em.calls[mark:]
        patched = [c for c in calls if c["resource"] == "pods" and c["verb"] == "patch"]
        assert len(patched) == 2
        scaled = next(i for i, c in enumerate(calls) if c["resource"] == "deployments" and c["verb"] == "patch")
        read = max(i for i, c in enumerate(calls[:scaled]) if (c["resource"], c["verb"], c.get("name"))
                   == ("deployments", "get", name))
        assert all(read < calls.index(c) < scaled for c in patched)  # after the fresh read, before the count went down
        log_mark, calls_mark = len(operator_.log()), len(em.calls)
        eventually(lambda: decisions(operator_, name, log_mark) >= 3, timeout=30)
        assert not [c for c in em.calls[calls_mark:] if c["resource"] == "pods" and c["verb"] != "watch"]
    finally:
        for pod in pods:
            pod.stop()


def test_a_deployment_deleted_before_its_scale_call_is_made_again(emulator, operator_):
    """Admission refuses the Deployment, so the count goes through its scale subresource; the
    Deployment was deleted since its copy was read, and the call answers 404. That used to read
    as "the service went": its loop ended, and the Deployment was never made again until someone
    edited the service. Now, once admission lets it through, it is back."""
    name = "regone"
    deploy = f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"
    emulator.request("POST", service_path(NS), new_service(name, {
        "model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 6, "intervalSeconds": 1}}))
    eventually(lambda: emulator.get(deploy))

    def no_debug_logs(obj):
        env = (obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}])[0].get("env") or []
        if obj.get("kind") == "Deployment" and {"name": "LOG_LEVEL", "value": "DEBUG"} in env:
            return "policy no-debug-logs: LOG_LEVEL=DEBUG is not allowed"
    em.policies.append(no_debug_logs)
    (ip,) = pod_addresses(PORT)
    pod = None
    try:
        emulator.merge_patch(service_path(NS, name), {"spec": {"env": [{"name": "LOG_LEVEL", "value": "DEBUG"}]}})
        eventually(lambda: condition(emulator, name, "Degraded").get("reason") == "RejectedByAPI")
        em.faults[("PATCH", "deployments/scale")] = [em.GONE]
        pod = Pod(ip, exposition(service_rate=1000, arrival_rate=4000))  # 6 replicas' worth
        post_pod(emulator, name, f"{name}-0", ip)
        eventually(lambda: not em.faults[("PATCH", "deployments/scale")] and not emulator.get(deploy), timeout=30)
    finally:
        em.policies.remove(no_debug_logs)
        em.faults.pop(("PATCH", "deployments/scale"), None)
    try:
        d = eventually(lambda: emulator.get(deploy), timeout=30)
        assert {"name": "LOG_LEVEL", "value": "DEBUG"} in d["spec"]["template"]["spec"]["containers"][0]["env"]
        assert f"{NS}/{name}: loop ended" not in operator_.log()
        eventually(lambda: replicas(emulator, name) == 6, timeout=30)  # and it goes on scaling
    finally:
        pod.stop()


def test_a_scale_down_goes_ahead_when_pods_cannot_be_annotated(emulator, operator_):
    """RBAC without patch on pods (a chart from before the call) refuses the deletion cost: the
    scale-down goes ahead all the same, said in the log, the ReplicaSet choosing by itself."""
    name = "trim-forbidden"
    emulator.request("POST", service_path(NS), new_service(name, {
        "model": "m", "replicas": 2, "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 6, "intervalSeconds": 1,
                        "scaleDownStabilizationSeconds": 0}}))
    eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"))
    ips = pod_addresses(PORT, 2)
    for i, ip in enumerate(ips):
        post_pod(emulator, name, f"{name}-{i}", ip)
    em.faults[("PATCH", "pods")] = [(403, 'pods "x" is forbidden: cannot patch resource "pods"')] * 100
    pods = [Pod(ip, exposition(service_rate=1000, arrival_rate=100, queued=queued)) for ip, queued in zip(ips, (0, 200))]
    try:
        eventually(lambda: replicas(emulator, name) == 1, timeout=30)
        assert "deletion cost not set" in operator_.log()
    finally:
        em.faults.pop(("PATCH", "pods"), None)
        for pod in pods:
            pod.stop()


def test_marks_a_dropped_decision_left_are_cleared_once_no_scale_down_is_under_way(emulator, operator_):
    """Two pods marked for removal by a decision that was then dropped (the count had changed):
    the fleet holds at 2 (one pod's worth of demand each), and the marks go at the next step, or a
    later scale-down by anyone (kubectl scale in mode off) would remove them first. Then nothing."""
    name = "unmark"
    emulator.request("POST", service_path(NS), new_service(name, {
        "model": "m", "replicas": 2, "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
        "autoscaling": {"mode": "operator", "minReplicas": 2, "maxReplicas": 6, "intervalSeconds": 1}}))
    eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"))
    ips = pod_addresses(PORT, 2)
    marked = {autoscale.DELETION_COST: autoscale.REMOVAL_COST, autoscale.REMOVAL_MARK: "true", "kept": "yes"}
    for i, ip in enumerate(ips):
        post_pod(emulator, name, f"{name}-{i}", ip)
        emulator.merge_patch(f"{PODS}/{name}-{i}", {"metadata": {"annotations": marked}})
    pods = [Pod(ip, exposition(service_rate=1000, arrival_rate=500)) for ip in ips]
    try:
        eventually(lambda: all(emulator.get(f"{PODS}/{name}-{i}")["metadata"]["annotations"] == {"kept": "yes"}
                               for i in range(2)), timeout=30)
        assert replicas(emulator, name) == 2
        log_mark, calls_mark = len(operator_.log()), len(em.calls)
        eventually(lambda: decisions(operator_, name, log_mark) >= 3, timeout=30)
        assert not [c for c in em.calls[calls_mark:] if c["resource"] == "pods" and c["verb"] == "patch"]
    finally:
        for pod in pods:
            pod.stop()


def test_no_pod_is_marked_when_the_count_changed_since_its_copy_was_read(tmp_path, monkeypatch):
    """The autoscaler decides 3 → 1 on its copy of the Deployment, but the API's has 4 by now
    (kubectl scale, a handover): the read before the marks finds it, and the decision is dropped
    with no pod written (marks written first were left on pods for whatever scale-down came next)."""
    import asyncio

    from embedop import autoscaler, cache, crd, reconcile, render, spec as specs
    from embedop.config import OperatorSettings
    from embedop.kube import Kube
    from embedop.scrape import Reader
    from tests.operator.emulator import Emulator

    name = "moved"
    spec = {"model": "m", "replicas": 3, "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"},
            "autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 6, "scaleDownStabilizationSeconds": 0}}
    settings = OperatorSettings(metrics_port=PORT, scrape_timeout_s=1.0)
    ips = pod_addresses(PORT, 3)
    servers = [Pod(ip, exposition(service_rate=1000, arrival_rate=100, queued=q)) for ip, q in zip(ips, (0, 120, 300))]
    with Emulator(subject="marks-probe") as e:
        monkeypatch.setenv("KUBECONFIG", str(e.kubeconfig(tmp_path / "kubeconfig")))
        body = e.request("POST", service_path(NS), new_service(name, spec, NS))
        owner = reconcile.owner_of(body)
        deployment = render.deployment(owner, specs.defaulted(spec), "embedserve", 3, 45, PORT)
        copy = e.request("POST", f"/apis/apps/v1/namespaces/{NS}/deployments", deployment)  # what the watch last said
        e.merge_patch(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/scale", {"spec": {"replicas": 4}})
        pods = []
        for i, ip in enumerate(ips):
            post_pod(e, name, f"{name}-{i}", ip)
            pods.append(e.get(f"{PODS}/{name}-{i}"))

        async def scenario():
            kube = Kube.connect()
            stores = {kind: cache.Store() for kind in ("Deployment", "Pod", "Job", "PersistentVolumeClaim", crd.KIND)}
            for kind, obj in (("Deployment", copy), (crd.KIND, body), *(("Pod", p) for p in pods)):
                stores[kind].put(obj)
            cluster = cache.Cluster(kube, stores)
            mark = len(em.calls)
            try:
                async with Reader() as reader:
                    step = await autoscaler.step(cluster, settings, reader, NS, name, autoscale.History(), 1000.0)
            finally:
                await kube.close()
            return step, [c for c in em.calls[mark:] if c["subject"] == "marks-probe"]

        try:
            step, calls = asyncio.run(scenario())
        finally:
            for pod in servers:
                pod.stop()
        assert step.current == 3 and step.decision.desired == 3 and "changed meanwhile" in step.decision.reason
        assert not [c for c in calls if c["resource"] == "pods"], calls
        assert e.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}")["spec"]["replicas"] == 4
        assert all(not (e.get(f"{PODS}/{name}-{i}")["metadata"].get("annotations")) for i in range(3))
