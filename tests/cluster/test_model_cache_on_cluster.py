"""spec.modelCache.prefill on a real cluster: the real Job controller runs the server image's
`python -m embedserve.prefetch` against a hub (an HF-compatible endpoint in the test's namespace:
tests/server/model/fake_hub.py serving the packaged model's files as repository org/minilm at
revision v1, run in the server image from a ConfigMap) into a real claim; the Deployment appears
only once the Job has succeeded, and its pod becomes Ready reading the claim read-only and offline
(so the Job really wrote the hub layout the server reads). A model that cannot be fetched fails
the Job at once (podFailurePolicy on prefetch's refusal, exit code 3, one pod), and the service is Degraded
naming it. Needs EMBEDFLEET_SERVER_IMAGE (loaded into the cluster) and a default StorageClass
(kind's local-path: one node, so ReadWriteOnce serves; its directories are world-writable, so uid
10001 may write the claim's root)."""

from pathlib import Path

import pytest

from tests.cluster.conftest import SERVER_IMAGE
from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

pytestmark = pytest.mark.skipif(not SERVER_IMAGE, reason="needs EMBEDFLEET_SERVER_IMAGE: the Job runs the server image")

ROOT = Path(__file__).resolve().parents[2]
HUB_PORT = 8080
# Run in the server image: fake_hub.py (from the ConfigMap) bound to every address of the pod,
# serving every file of the packaged model as org/minilm@v1.
HUB_MAIN = f"""
import http.server, sys, time
class Bound(http.server.ThreadingHTTPServer):
    def __init__(self, address, handler):
        super().__init__(("0.0.0.0", {HUB_PORT}), handler)
http.server.ThreadingHTTPServer = Bound
sys.path.insert(0, "/hub")
from fake_hub import FakeHub
from embedserve.model.source import packaged_model_dir
root = packaged_model_dir()
FakeHub("org/minilm", {{"v1": {{str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}}}})
print("serving", flush=True)
while True:
    time.sleep(3600)
"""
RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
              "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}}


def condition(cr, type_):
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def claim(emulator, ns, name):
    emulator.request("POST", f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})


def hub(emulator, ns) -> str:
    """The hub pod and its Service; → HF_ENDPOINT for the service's spec.env."""
    api = f"/api/v1/namespaces/{ns}"
    source = (ROOT / "tests" / "server" / "model" / "fake_hub.py").read_text()
    emulator.request("POST", f"{api}/configmaps", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "hub"},
                                                   "data": {"fake_hub.py": source, "main.py": HUB_MAIN}})
    labels = {"app": "fake-hub"}
    emulator.request("POST", f"{api}/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hub", "labels": labels},
                                             "spec": {"containers": [{
                                                 "name": "hub", "image": SERVER_IMAGE, "imagePullPolicy": "IfNotPresent",
                                                 "command": ["python", "/hub/main.py"], "securityContext": RESTRICTED,
                                                 "ports": [{"containerPort": HUB_PORT}],
                                                 "readinessProbe": {"tcpSocket": {"port": HUB_PORT}, "periodSeconds": 2},
                                                 "volumeMounts": [{"name": "hub", "mountPath": "/hub"}]}],
                                                 "volumes": [{"name": "hub", "configMap": {"name": "hub"}}]}})
    emulator.request("POST", f"{api}/services", {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "hub"},
                                                 "spec": {"selector": labels, "ports": [{"port": HUB_PORT}]}})
    eventually(lambda: any(c["type"] == "Ready" and c["status"] == "True"
                           for c in (emulator.get(f"{api}/pods/hub").get("status") or {}).get("conditions", [])), 300)
    return f"http://hub.{ns}.svc:{HUB_PORT}"


def test_a_prefilled_claim_is_filled_before_the_pods_serve_from_it(emulator, operator, namespace):
    claim(emulator, namespace, "models")
    spec = {"model": "org/minilm", "modelRevision": "v1", "replicas": 1, "autoscaling": {"mode": "off"},
            "resources": {"gpu": 0, "cpu": "1", "memory": "2Gi"}, "modelCache": {"claimName": "models", "prefill": True},
            "env": [{"name": "HF_ENDPOINT", "value": hub(emulator, namespace)}]}
    emulator.request("POST", service_path(namespace), new_service("cached", spec, namespace))
    jobs = f"/apis/batch/v1/namespaces/{namespace}/jobs"
    job = eventually(lambda: next(j for j in emulator.get(jobs)["items"] if j["metadata"]["name"].startswith("cached-fill-")), 60)
    name = job["metadata"]["name"]
    eventually(lambda: (emulator.get(f"{jobs}/{name}").get("status") or {}).get("succeeded"), 300)
    d = eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/cached"), 60)
    pod = d["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert (env["HF_HUB_OFFLINE"], env["MODEL_PATH"], env["MODEL_REVISION"]) == ("1", "org/minilm", "v1")
    # A Ready pod: the server found the revision in the read-only claim, with no download of its own.
    eventually(lambda: (emulator.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/cached").get("status") or {})
               .get("readyReplicas", 0) >= 1, 600)
    cr = eventually(lambda: condition(c := emulator.get(service_path(namespace, "cached")), "Ready").get("status") == "True"
                    and c, 60)
    assert cr["status"]["modelCache"]["filled"] == job["metadata"]["labels"]["embedfleet.dev/model-cache-fill"]
    assert [j["metadata"]["name"] for j in emulator.get(jobs)["items"] if j["metadata"]["name"].startswith("cached-fill-")] == [name]


def test_a_fill_that_fails_is_degraded_naming_its_job(emulator, operator, namespace):
    claim(emulator, namespace, "models-bad")
    spec = {"model": "/no/such/model", "replicas": 1, "autoscaling": {"mode": "off"},
            "resources": {"gpu": 0, "cpu": "1", "memory": "2Gi"}, "modelCache": {"claimName": "models-bad", "prefill": True}}
    emulator.request("POST", service_path(namespace), new_service("unfillable", spec, namespace))
    cr = eventually(lambda: condition(c := emulator.get(service_path(namespace, "unfillable")), "Degraded").get("reason")
                    == "ModelCacheFillFailed" and c, 300)
    message = condition(cr, "Degraded")["message"]
    assert "unfillable-fill-" in message and "PodFailurePolicy" in message  # prefetch's refusal: no retries
    jobs = emulator.get(f"/apis/batch/v1/namespaces/{namespace}/jobs")["items"]
    (job,) = [j for j in jobs if j["metadata"]["name"].startswith("unfillable-fill-")]
    assert job["status"].get("failed") == 1
    assert emulator.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/unfillable") is None
