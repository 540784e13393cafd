"""Mode keda on a real cluster with KEDA installed (opt-in: EMBEDFLEET_KEDA=1, besides the
cluster's own switch), the operator running here as the other scenarios run it: KEDA, in the
cluster, must reach this machine's scaler, so EMBEDFLEET_SCALER_ADDRESS says where (host:port as
seen from the cluster, e.g. kind's docker gateway 172.18.0.1:PORT) and EMBEDFLEET_SCALER_PORT
which port to serve here. What the emulator and tests/operator/keda_double.py cannot judge: that
KEDA accepts the ScaledObject (its admission webhook, its own validation), makes its HPA with
the rendered behavior, reads the count from the operator's scaler through its metrics adapter,
and takes an idle service to zero, where Ready is False, ScaledToZero. The HTTP add-on's wake-up
(EMBEDFLEET_KEDA_HTTP=1, the add-on installed): a request through its interceptor brings a pod."""

import os
from pathlib import Path

import pytest

from tests.cluster.conftest import operator_env
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

pytestmark = pytest.mark.skipif(os.environ.get("EMBEDFLEET_KEDA") != "1" or not os.environ.get("EMBEDFLEET_SCALER_ADDRESS"),
                                reason="needs KEDA in the cluster: EMBEDFLEET_KEDA=1 and EMBEDFLEET_SCALER_ADDRESS")
PORT = os.environ.get("EMBEDFLEET_SCALER_PORT", "9090")


@pytest.fixture(scope="module")
def keda_operator(emulator, namespace, tmp_path_factory):
    d = tmp_path_factory.mktemp("keda-operator")
    env = operator_env(namespace, EMBEDOP_SCALER_PORT=PORT, EMBEDOP_SCALER_ADDRESS=os.environ["EMBEDFLEET_SCALER_ADDRESS"])
    op = OperatorProcess(Path(os.environ["KUBECONFIG"]), d / "operator.log", namespace=namespace, env=env)
    yield op
    op.stop()


def ready(obj: dict | None, kind: str = "Ready") -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def test_keda_takes_the_count_from_the_operators_scaler(emulator, keda_operator, namespace):
    spec = {"model": "m", "resources": {"gpu": 0, "cpu": "50m", "memory": "64Mi"},
            "autoscaling": {"mode": "keda", "minReplicas": 1, "maxReplicas": 3, "intervalSeconds": 5}}
    emulator.request("POST", service_path(namespace), new_service("kept", spec, namespace))
    so = f"/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects/kept"
    eventually(lambda: ready(emulator.get(so)).get("status") == "True", timeout=180)  # KEDA took it
    path = f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/keda-hpa-kept"
    hpa = eventually(lambda: emulator.get(path), timeout=120)
    assert hpa["spec"]["scaleTargetRef"]["name"] == "kept"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 0
    # No pod serves (or none could pull the image): the decision holds at minReplicas, and the
    # HPA's metric is the operator's count.
    metrics = eventually(lambda: ((emulator.get(path) or {}).get("status") or {}).get("currentMetrics"), timeout=180)
    assert metrics[0]["external"]["current"]["averageValue"] in ("1", "1000m")  # the decided count, 1 per replica
    assert emulator.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/kept")["spec"]["replicas"] == 1


def test_an_idle_service_goes_to_zero(emulator, keda_operator, namespace):
    spec = {"model": "m", "resources": {"gpu": 0, "cpu": "50m", "memory": "64Mi"},
            "autoscaling": {"mode": "keda", "minReplicas": 0, "maxReplicas": 2, "intervalSeconds": 5, "idleSeconds": 30}}
    emulator.request("POST", service_path(namespace), new_service("idle", spec, namespace))
    deploy = f"/apis/apps/v1/namespaces/{namespace}/deployments/idle"
    eventually(lambda: (emulator.get(deploy) or {}).get("spec", {}).get("replicas") == 0, timeout=300)
    condition = eventually(lambda: ready(emulator.get(service_path(namespace, "idle"))).get("reason") == "ScaledToZero"
                           and ready(emulator.get(service_path(namespace, "idle"))), timeout=120)
    assert condition["status"] == "False"
