"""spec.routing gateway on a real API server: first without the InferencePool CRD (most clusters),
where the operator serves every other service and reports the one asking for a pool Degraded,
naming the CRD; then with the real CRD installed (the vendored file, tests/operator/fixtures),
picked up without a restart: the API server (its schema and CEL rules) accepts the rendered pool,
which is owned, deleted when routing goes back to service, and garbage-collected with its service.
A cluster that already has the CRD skips the first half and keeps its CRD."""

import yaml

from tests.operator import inference_pool_schema as schema
from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{schema.CRD['metadata']['name']}"
SPEC = {"model": "sim:20000", "resources": {"gpu": 0, "cpu": "250m", "memory": "1Gi"}, "autoscaling": {"mode": "off"},
        "replicas": 0, "routing": "gateway"}


def degraded(emulator, ns, name) -> list[dict]:
    conditions = (emulator.get(service_path(ns, name)).get("status") or {}).get("conditions") or []
    return [c for c in conditions if c["type"] == "Degraded" and c["status"] == "True"]


def test_a_pool_without_and_with_the_crd(emulator, namespace, operator):
    ns = namespace
    pool = f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/routed"
    installed_here = emulator.get(CRD_PATH) is None
    try:
        emulator.request("POST", service_path(ns), new_service("plain", {**SPEC, "routing": "service"}, ns))
        emulator.request("POST", service_path(ns), new_service("routed", SPEC, ns))
        if installed_here:
            (condition,) = eventually(lambda: degraded(emulator, ns, "routed"), timeout=60)
            assert schema.CRD["metadata"]["name"] in condition["message"]
            eventually(lambda: emulator.get(f"/apis/apps/v1/namespaces/{ns}/deployments/routed"), timeout=60)
            assert not degraded(emulator, ns, "plain") and emulator.get(f"/apis/apps/v1/namespaces/{ns}/deployments/plain")
            assert operator.proc.poll() is None
            emulator.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                             yaml.safe_load(schema.CRD_FILE.read_text()))
        # The operator lists the kind again within a minute, and the service's resync applies it.
        made = eventually(lambda: emulator.get(pool), timeout=180)
        (ref,) = made["metadata"]["ownerReferences"]
        assert ref["name"] == "routed" and ref["uid"] == emulator.get(service_path(ns, "routed"))["metadata"]["uid"]
        assert made["spec"]["targetPorts"] == [{"number": 8001}] and made["spec"]["appProtocol"] == "http"
        assert made["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "routed-epp",
                                                     "port": {"number": 9002}, "failureMode": "FailClose"}
        eventually(lambda: not degraded(emulator, ns, "routed"), timeout=60)
        emulator.merge_patch(service_path(ns, "routed"), {"spec": {"routing": "service"}})
        eventually(lambda: emulator.get(pool) is None, timeout=60)
        emulator.merge_patch(service_path(ns, "routed"), {"spec": {"routing": "gateway"}})
        eventually(lambda: emulator.get(pool), timeout=60)
        emulator.request("DELETE", service_path(ns, "routed"))
        eventually(lambda: emulator.get(pool) is None, timeout=120)  # the garbage collector, by ownerReference
    finally:
        for name in ("plain", "routed"):
            if emulator.get(service_path(ns, name)):
                emulator.request("DELETE", service_path(ns, name))
        if installed_here and emulator.get(CRD_PATH):
            emulator.request("DELETE", CRD_PATH)
