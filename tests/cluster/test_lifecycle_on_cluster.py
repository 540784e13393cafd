"""Deleting an EmbeddingService garbage-collects everything it owns (the ownerReferences the
operator sets; the emulator has no garbage collector), in the foreground too."""

import pytest

from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path


def owned_paths(namespace, name):
    return [f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}",
            f"/api/v1/namespaces/{namespace}/services/{name}",
            f"/api/v1/namespaces/{namespace}/services/{name}-headless",
            f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}"]


@pytest.mark.parametrize("propagation", ["Background", "Foreground"])
def test_deleting_a_service_removes_what_it_owns(emulator, operator, namespace, propagation):
    name = f"gc-{propagation.lower()}"
    emulator.request("POST", service_path(namespace), new_service(name, {
        "model": "m", "replicas": 1, "autoscaling": {"mode": "off"},
        "resources": {"gpu": 0, "cpu": "50m", "memory": "64Mi"}}, namespace))
    for path in owned_paths(namespace, name):
        eventually(lambda path=path: emulator.get(path), timeout=60)
    emulator.request("DELETE", f"{service_path(namespace, name)}?propagationPolicy={propagation}")
    for path in owned_paths(namespace, name):
        eventually(lambda path=path: emulator.get(path) is None, timeout=120)
    pods = f"/api/v1/namespaces/{namespace}/pods?labelSelector=embedfleet.dev/service={name}"
    eventually(lambda: emulator.get(pods)["items"] == [], timeout=120)
    eventually(lambda: emulator.get(service_path(namespace, name)) is None, timeout=60)
