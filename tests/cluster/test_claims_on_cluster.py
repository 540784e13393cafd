"""A model cache's claim on a real cluster (no server image needed: nothing here must run): its
access mode reported (ModelCacheShared, naming the claim and the mode; never refused), no fill Job
before the claim exists, and a claim deleted and made again under its name (a new uid: a new,
empty volume) filled again rather than trusted. The fill Job's pods are kept off every node (a
nodeSelector no node has), so none binds or holds a claim: the storage-object-in-use protection
waits only for scheduled pods, and kind's local-path binds on first use."""

from __future__ import annotations

from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

NOWHERE = {"embedfleet.dev/test-no-such-node": "true"}
SPEC = {"model": "org/m", "resources": {"gpu": 0, "cpu": "50m", "memory": "64Mi"}, "autoscaling": {"mode": "off"},
        "replicas": 1, "nodeSelector": NOWHERE}


def claim(emulator, ns, name, modes=("ReadWriteOnce",)) -> dict:
    return emulator.request("POST", f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": "1Gi"}}}})


def condition(emulator, ns, name, type_) -> dict:
    cr = emulator.get(service_path(ns, name)) or {}
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def fill_jobs(emulator, ns, service) -> dict[str, dict]:
    return {j["metadata"]["name"]: j for j in emulator.get(f"/apis/batch/v1/namespaces/{ns}/jobs")["items"]
            if j["metadata"]["name"].startswith(f"{service}-fill-")}


def test_a_read_write_once_claim_is_reported_not_refused(emulator, namespace, operator):
    ns = namespace
    for modes, reason in ((("ReadWriteOnce",), "ReadWriteOnce"), (("ReadWriteOncePod",), "ReadWriteOncePod")):
        name = reason.lower()
        claim(emulator, ns, f"{name}-models", modes)
        emulator.request("POST", service_path(ns), new_service(name, {**SPEC, "modelCache": {"claimName": f"{name}-models"}},
                                                               ns))
        c = eventually(lambda: condition(emulator, ns, name, "ModelCacheShared"), timeout=60)
        assert (c["status"], c["reason"]) == ("False", reason) and f"{name}-models" in c["message"]
        assert emulator.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")


def test_no_fill_before_the_claim_and_a_claim_made_again_is_filled_again(emulator, namespace, operator):
    ns, name, claims = namespace, "again", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims"
    emulator.request("POST", service_path(ns), new_service(name, {
        **SPEC, "modelCache": {"claimName": "again-models", "prefill": True}}, ns))
    eventually(lambda: "again-models does not exist" in condition(emulator, ns, name, "Progressing").get("message", ""),
               timeout=60)
    assert not fill_jobs(emulator, ns, name)
    first = claim(emulator, ns, "again-models")
    (j1,) = eventually(lambda: fill_jobs(emulator, ns, name), timeout=60)  # at the service's next periodic check
    emulator.request("DELETE", f"{claims}/again-models")
    eventually(lambda: emulator.get(f"{claims}/again-models") is None, timeout=60)  # no scheduled pod holds it
    second = claim(emulator, ns, "again-models")
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    j2 = eventually(lambda: next(iter(set(fill_jobs(emulator, ns, name)) - {j1}), None), timeout=60)
    labels = {j: fill_jobs(emulator, ns, name)[j]["metadata"]["labels"]["embedfleet.dev/model-cache-fill"] for j in (j1, j2)}
    assert labels[j1] != labels[j2]
    assert emulator.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}") is None  # never rolled onto an empty claim
