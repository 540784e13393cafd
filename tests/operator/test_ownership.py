"""What the operator will not take: an object of an owned kind and name that someone else made (a
Service, a PodDisruptionBudget, an HPA, a Deployment) is never applied over (server-side apply would
take it over, rewrite its selector, and garbage-collect it with the service); the service reports
it instead. And what it clears: the autoscaler's conditions and measurements, once a service
leaves mode operator, rather than leaving them to go stale. The real operator process against the
emulator."""

from __future__ import annotations

import pytest

from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path

SERVICES, HPAS, DEPLOYMENTS = ("/api/v1/namespaces/{}/services", "/apis/autoscaling/v2/namespaces/{}/horizontalpodautoscalers",
                                "/apis/apps/v1/namespaces/{}/deployments")


def condition(emulator, name, type_, ns) -> dict:
    cr = emulator.get(service_path(ns, name)) or {}
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def degraded_not_owned(emulator, name, ns):
    c = condition(emulator, name, "Degraded", ns)
    return c.get("reason") == "NotOwned" and c


SPEC = {"model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}}


@pytest.mark.parametrize("collection, obj", [
    (SERVICES, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "taken"},
                "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}}),
    (DEPLOYMENTS, {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "taken"},
                   "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "theirs"}}, "template": {
                       "metadata": {"labels": {"app": "theirs"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}}),
], ids=["Service", "Deployment"])
def test_someone_elses_object_of_the_same_name_is_not_taken_over(emulator, operator, namespace, collection, obj):
    ns, collection = namespace, collection.format(namespace)
    name = f"taken-{obj['kind'].lower()}"
    obj = {**obj, "metadata": {"name": name, "namespace": ns}}
    emulator.request("POST", collection, obj)
    before = emulator.get(f"{collection}/{name}")
    emulator.request("POST", service_path(ns), new_service(name, SPEC, ns))
    c = eventually(lambda: degraded_not_owned(emulator, name, ns), timeout=30)
    assert f"{obj['kind']}/{name}" in c["message"] and c["status"] == "True"
    after = emulator.get(f"{collection}/{name}")
    assert after["spec"]["selector"] == before["spec"]["selector"] and not after["metadata"].get("ownerReferences")
    # What is not someone else's is made as usual (a foreign Deployment: nothing is scaled or mirrored).
    if obj["kind"] == "Service":
        eventually(lambda: emulator.get(f"{DEPLOYMENTS.format(ns)}/{name}"))
        eventually(lambda: emulator.get(f"{SERVICES.format(ns)}/{name}-headless"))
    else:
        assert emulator.get(f"{collection}/{name}")["spec"]["replicas"] == 2
    # Once it is gone (renamed, deleted), the service gets its own.
    emulator.request("DELETE", f"{collection}/{name}")
    eventually(lambda: (o := emulator.get(f"{collection}/{name}")) and o["metadata"].get("ownerReferences"), timeout=30)
    eventually(lambda: condition(emulator, name, "Degraded", ns).get("reason") != "NotOwned")


def test_someone_elses_hpa_is_not_applied_over_in_mode_hpa(emulator, operator, namespace):
    ns, hpas = namespace, HPAS.format(namespace)
    theirs = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
              "metadata": {"name": "scaled", "namespace": ns},
              "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "other"},
                       "minReplicas": 1, "maxReplicas": 3}}
    emulator.request("POST", hpas, theirs)
    emulator.request("POST", service_path(ns), new_service("scaled", {**SPEC, "autoscaling": {"mode": "hpa"}}, ns))
    c = eventually(lambda: degraded_not_owned(emulator, "scaled", ns), timeout=30)
    assert "HorizontalPodAutoscaler/scaled" in c["message"]
    hpa = emulator.get(f"{hpas}/scaled")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "other" and not hpa["metadata"].get("ownerReferences")


def test_the_autoscalers_status_is_cleared_when_the_service_leaves_mode_operator(emulator, operator, namespace):
    """Its conditions and measured rates would otherwise stand, stale, for as long as the service lives."""
    ns = namespace
    emulator.request("POST", service_path(ns), new_service("switched", {**SPEC, "autoscaling": {"intervalSeconds": 1}}, ns))
    eventually(lambda: condition(emulator, "switched", "MetricsUnavailable", ns), timeout=30)
    assert "serviceRateTokensPerSecond" in emulator.get(service_path(ns, "switched"))["status"]
    emulator.merge_patch(service_path(ns, "switched"), {"spec": {"autoscaling": {"mode": "off"}}})

    def cleared():
        st = emulator.get(service_path(ns, "switched"))["status"]
        types = {c["type"] for c in st["conditions"]}
        reconciles = {"Ready", "Progressing", "Degraded", "FieldNotPersisted"}
        return types == reconciles and "serviceRateTokensPerSecond" not in st and st

    st = eventually(cleared, timeout=30)
    assert st["desiredReplicas"] == 1  # mode off: spec.replicas
