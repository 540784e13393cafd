"""Mode keda, the loop on this machine: the real operator process, the emulated API server (with
KEDA's CRDs), and a stand-in for KEDA and its HPA (tests/operator/keda_double.py) that reads the
operator's external scaler over real gRPC, as KEDA does, and writes the Deployment's count through
the scale subresource, as KEDA's HPA does. The scaler answers each mode keda service's decision
(another mode's: UNAVAILABLE); a service idle for its idleSeconds is taken to zero and is Ready
False, ScaledToZero. (With pods and load, the decision's rules are mode operator's, checked over
traces in test_scaler.py; KEDA itself: tests/cluster/.)"""

import socket

import grpc
import pytest

from embedop import externalscaler_pb2 as pb
from embedop import externalscaler_pb2_grpc as pb_grpc
from embedop import scaler

from tests.conftest import free_port
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import Emulator, new_service, service_path
from tests.operator.keda_double import Keda

NS = "default"
ADDRESS = "embedop-scaler.embedfleet-system.svc:9090"  # what the ScaledObjects name (in-cluster)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    port = free_port()
    with Emulator(keda=True) as e:
        d = tmp_path_factory.mktemp("keda-loop")
        op = OperatorProcess(e.kubeconfig(d / "kubeconfig"), d / "operator.log",
                             env={"EMBEDOP_SCALER_PORT": str(port), "EMBEDOP_SCALER_ADDRESS": ADDRESS})
        keda = Keda(e, NS, f"127.0.0.1:{port}", ADDRESS)
        keda.start()
        try:
            yield e, op, keda
        finally:
            keda.stop()
            op.stop()


def deploy(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"


def replicas(e, name: str) -> int:
    return int(((e.get(deploy(name)) or {}).get("spec") or {}).get("replicas") or 0)


def test_the_operator_serves_its_decision_to_keda(cluster):
    """The scaler in the operator process answers each mode keda service's decision, as KEDA
    asks it (no pod has served yet: the count held within [minReplicas, maxReplicas]); a service
    in another mode has none (UNAVAILABLE: KEDA's HPA keeps its count)."""
    e, op, keda = cluster
    spec = {"model": "m", "resources": {"gpu": 0}, "autoscaling": {"mode": "keda", "minReplicas": 2, "maxReplicas": 4,
                                                                    "intervalSeconds": 1}}
    e.request("POST", service_path(NS), new_service("held", spec, NS))
    e.request("POST", service_path(NS), new_service("other", {"model": "m", "resources": {"gpu": 0}}, NS))
    ref = pb.ScaledObjectRef(name="held", namespace=NS, scalerMetadata={"scalerAddress": ADDRESS})

    def metric():
        try:
            return keda.stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref, metricName=scaler.METRIC))
        except grpc.RpcError:
            return None

    value = eventually(metric, timeout=60).metricValues[0]
    assert (value.metricName, value.metricValueFloat) == (scaler.METRIC, 2.0) and keda.stub.IsActive(ref).result
    assert replicas(e, "held") == 2
    eventually(lambda: replicas(e, "other") == 1, timeout=60)
    with pytest.raises(grpc.RpcError) as error:
        keda.stub.IsActive(pb.ScaledObjectRef(name="other", namespace=NS))
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def test_an_idle_service_goes_to_zero_after_its_idle_window(cluster):
    e, op, keda = cluster
    spec = {"model": "m", "resources": {"gpu": 0}, "autoscaling": {"mode": "keda", "minReplicas": 0, "maxReplicas": 2,
                                                                    "intervalSeconds": 1, "idleSeconds": 3}}
    e.request("POST", service_path(NS), new_service("idle", spec, NS))
    eventually(lambda: e.get(f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects/idle"), timeout=60)
    # The first decision counts as demand where pods run (an operator that just started has not
    # seen the past): active, then idle 3 s later; KEDA's cooldown (idleSeconds) then takes it to zero.
    eventually(lambda: ("idle", 0) in keda.writes and replicas(e, "idle") == 0, timeout=60)
    ready = eventually(lambda: next((c for c in (e.get(service_path(NS, "idle")).get("status") or {}).get("conditions", [])
                                     if c["type"] == "Ready" and c["reason"] == "ScaledToZero"), None), timeout=60)
    assert ready["status"] == "False"


def test_an_hpa_built_without_the_operators_metric_is_built_again(cluster):
    """KEDA builds its HPA from the triggers that answer then and leaves a silent one out: built
    while the operator's scaler was silent (a leader changing), it counted the HTTP add-on's
    pending requests alone, for good. The operator sees its metric missing, says so (Degraded,
    KedaMetricMissing, and an Event), and asks KEDA to build it again (an annotation on the HPA,
    which KEDA's controller watches); the HPA then has it."""
    e, op, keda = cluster
    spec = {"model": "m", "resources": {"gpu": 0}, "autoscaling": {"mode": "keda", "minReplicas": 0, "maxReplicas": 2,
                                                                    "intervalSeconds": 1, "idleSeconds": 600}}
    keda.silent_once.add("rebuilt")
    e.request("POST", service_path(NS), new_service("rebuilt", spec, NS))
    hpa = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/keda-hpa-rebuilt"

    def metrics():
        return {m["external"]["metric"]["name"] for m in ((e.get(hpa) or {}).get("spec") or {}).get("metrics", [])}

    eventually(lambda: "s0-" + scaler.METRIC in metrics(), timeout=60)
    assert "s1-rebuilt-http" in metrics()  # the add-on's, in both builds
    assert not keda.silent_once  # the first build did leave it out
    # Said (kopf posts Events from a queue of its own: they may come after the rebuild).
    said = eventually(lambda: [ev for ev in (e.get(f"/api/v1/namespaces/{NS}/events") or {}).get("items", [])
                               if ev.get("reason") == "KedaMetricMissing" and ev["involvedObject"]["name"] == "rebuilt"],
                      timeout=30)
    assert "keda-hpa-rebuilt" in said[0]["message"]
    eventually(lambda: not any(c["type"] == "Degraded" and c["status"] == "True" and c["reason"] == "KedaMetricMissing"
                               for c in (e.get(service_path(NS, "rebuilt")).get("status") or {}).get("conditions", [])),
               timeout=60)


def test_the_leader_labels_its_pod_for_its_term_and_closes_kedas_connection_at_its_end(tmp_path):
    """The scaler's Service selects the pod labelled leader: the operator that takes the lease
    labels its own pod and serves; at its term's end (here: a clean stop, which hands the lease
    over) the label goes and its server closes, KEDA's open stream with it, so KEDA reconnects
    through the Service to the next leader. A former leader's label left on a pod that runs on
    (its removal failed) is taken off: the Service must not send KEDA to a follower. Another
    release's leader in the namespace keeps its own."""
    release = {"app.kubernetes.io/instance": "a"}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator-a", "namespace": NS, "labels": release},
           "spec": {"containers": [{"name": "operator", "image": "embedop"}]}}
    former = {**pod, "metadata": {"name": "operator-old", "namespace": NS,
                                  "labels": {**release, scaler.LEADER_LABEL: "leader"}}}
    other = {**pod, "metadata": {"name": "release-b-operator", "namespace": NS,
                                 "labels": {"app.kubernetes.io/instance": "b", scaler.LEADER_LABEL: "leader"}}}
    spec = {"model": "m", "resources": {"gpu": 0}, "autoscaling": {"mode": "keda", "intervalSeconds": 1}}
    port = free_port()
    with Emulator(keda=True) as e, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        e.request("POST", f"/api/v1/namespaces/{NS}/pods", pod)
        e.request("POST", f"/api/v1/namespaces/{NS}/pods", former)
        e.request("POST", f"/api/v1/namespaces/{NS}/pods", other)
        e.request("POST", service_path(NS), new_service("s", spec, NS))
        a = OperatorProcess(e.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator-a.log",
                            env={"EMBEDOP_SCALER_PORT": str(port), "POD_NAME": "operator-a", "EMBEDOP_POD_NAMESPACE": NS,
                                 "EMBEDOP_POD_LABELS": "app.kubernetes.io/instance=a"})
        labels = lambda: e.get(f"/api/v1/namespaces/{NS}/pods/operator-a")["metadata"].get("labels") or {}  # noqa: E731
        stub, ref = pb_grpc.ExternalScalerStub(channel), pb.ScaledObjectRef(name="s", namespace=NS)
        try:
            eventually(lambda: labels().get(scaler.LEADER_LABEL) == "leader", timeout=30)
            eventually(lambda: scaler.LEADER_LABEL not in (e.get(f"/api/v1/namespaces/{NS}/pods/operator-old")
                                                           ["metadata"].get("labels") or {}), timeout=30)
            assert e.get(f"/api/v1/namespaces/{NS}/pods/release-b-operator")["metadata"]["labels"][scaler.LEADER_LABEL]

            def active():
                try:
                    return stub.IsActive(ref).result
                except grpc.RpcError:
                    return None

            assert eventually(active, timeout=30) is True
            stream = stub.StreamIsActive(ref)
            assert next(stream).result is True  # KEDA's stream, open on the leader
        finally:
            a.stop()
        assert scaler.LEADER_LABEL not in labels()
        with pytest.raises((grpc.RpcError, StopIteration)):  # ended with the term, not left open on a follower
            next(stream)


def test_a_scaler_that_cannot_start_keeps_no_service_from_its_reconcile(tmp_path):
    """Its port taken (another process, no SO_REUSEPORT): said, and every service is reconciled
    all the same (the leader used to wait for the scaler before starting any loop)."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as taken, Emulator(keda=True) as e:
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        e.request("POST", service_path(NS), new_service("served", {"model": "m", "resources": {"gpu": 0}}, NS))
        with OperatorProcess(e.kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log",
                             env={"EMBEDOP_SCALER_PORT": str(port)}).running() as op:
            eventually(lambda: e.get(deploy("served")), timeout=60)
            assert f"the KEDA external scaler could not start on :{port}" in op.log()
