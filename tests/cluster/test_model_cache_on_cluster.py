"""spec.modelCache.prefill on a real cluster: the real Job controller runs the server image's
`python -m embedserve.prefetch` into a real claim, the Deployment appears only once the Job has
succeeded, its pods mount the claim read-only; a model that cannot be fetched fails the Job after
its backoffLimit, and the service is Degraded naming it. Needs EMBEDFLEET_SERVER_IMAGE (loaded into
the cluster) and a default StorageClass (kind's local-path: one node, so ReadWriteOnce serves)."""

import pytest

from tests.cluster.conftest import SERVER_IMAGE
from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

pytestmark = pytest.mark.skipif(not SERVER_IMAGE, reason="needs EMBEDFLEET_SERVER_IMAGE: the Job runs the server image")


def condition(cr, type_):
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def claim(emulator, ns, name):
    emulator.request("POST", f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})


def test_a_prefilled_claim_is_filled_before_the_pods_use_it(emulator, operator, namespace):
    claim(emulator, namespace, "models")
    spec = {"model": "packaged:all-MiniLM-L6-v2", "replicas": 1, "autoscaling": {"mode": "off"},
            "resources": {"gpu": 0, "cpu": "1", "memory": "2Gi"}, "modelCache": {"claimName": "models", "prefill": True}}
    emulator.request("POST", service_path(namespace), new_service("cached", spec, namespace))
    jobs = f"/apis/batch/v1/namespaces/{namespace}/jobs"
    job = eventually(lambda: next(j for j in emulator.get(jobs)["items"] if j["metadata"]["name"].startswith("cached-fill-")), 60)
    name = job["metadata"]["name"]
    eventually(lambda: (emulator.get(f"{jobs}/{name}").get("status") or {}).get("succeeded"), 300)
    d = eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/cached"), 60)
    pod = d["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert [j["metadata"]["name"] for j in emulator.get(jobs)["items"] if j["metadata"]["name"].startswith("cached-fill-")] == [name]


def test_a_fill_that_fails_is_degraded_naming_its_job(emulator, operator, namespace):
    claim(emulator, namespace, "models-bad")
    spec = {"model": "/no/such/model", "replicas": 1, "autoscaling": {"mode": "off"},
            "resources": {"gpu": 0, "cpu": "1", "memory": "2Gi"}, "modelCache": {"claimName": "models-bad", "prefill": True}}
    emulator.request("POST", service_path(namespace), new_service("unfillable", spec, namespace))
    cr = eventually(lambda: condition(c := emulator.get(service_path(namespace, "unfillable")), "Degraded").get("reason")
                    == "ModelCacheFillFailed" and c, 600)
    assert "unfillable-fill-" in condition(cr, "Degraded")["message"]
    assert emulator.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/unfillable") is None
