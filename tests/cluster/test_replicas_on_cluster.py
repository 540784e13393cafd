"""The replica count under a real API server's server-side apply (which the emulator implements
for spec.replicas only): a spec edit at N replicas keeps N, an operator restart keeps N, and mode
switches keep the count, with the field owned as intended (metadata.managedFields). The live count
is written into the service's spec.replicas (scale subresource, which the emulator approximates by
patching the whole object), so a switch of the mode alone to off keeps it; a real HPA controller
moves the count in mode hpa."""

import os
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import operator_env
from tests.operator.conftest import OperatorProcess, eventually
from tests.operator.emulator import new_service, service_path

NAME = "fleet"


def owners(deployment) -> set[str]:
    return {m["manager"] for m in deployment["metadata"].get("managedFields", [])
            if "f:replicas" in (m.get("fieldsV1", {}).get("f:spec") or {})}


def watch_count(emulator, path, seconds: float) -> list[int]:
    """The Deployment's count, polled for a while: a lost count shows as a drop to 1 at once."""
    seen, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append(emulator.get(path)["spec"]["replicas"])
        time.sleep(0.2)
    return seen


@pytest.fixture(scope="module")
def paths(namespace):
    return {"deploy": f"/apis/apps/v1/namespaces/{namespace}/deployments/{NAME}",
            "hpa": f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/{NAME}",
            "cr": service_path(namespace, NAME)}


def test_a_spec_edit_at_n_replicas_keeps_n(emulator, operator, namespace, paths):
    emulator.request("POST", service_path(namespace), new_service(NAME, {
        "model": "m", "resources": {"gpu": 0, "cpu": "50m", "memory": "64Mi"},
        "autoscaling": {"mode": "operator", "minReplicas": 3, "maxReplicas": 6}}, namespace))
    eventually(lambda: emulator.get(paths["deploy"])["spec"]["replicas"] == 3, timeout=60)
    emulator.merge_patch(paths["cr"], {"spec": {"model": "m2", "autoscaling": {"minReplicas": 1}}})
    eventually(lambda: {"name": "MODEL_PATH", "value": "m2"} in
               emulator.get(paths["deploy"])["spec"]["template"]["spec"]["containers"][0]["env"], timeout=60)
    assert set(watch_count(emulator, paths["deploy"], 10)) == {3}
    assert "embedop" in owners(emulator.get(paths["deploy"]))
    eventually(lambda: emulator.get(paths["cr"])["spec"]["replicas"] == 3, timeout=60)  # the live count


def test_an_operator_restart_keeps_n(emulator, operator, namespace, paths, tmp_path):
    operator.stop()
    emulator.merge_patch(paths["cr"], {"spec": {"env": [{"name": "LOG_LEVEL", "value": "DEBUG"}]}})
    fresh = OperatorProcess(Path(os.environ["KUBECONFIG"]), tmp_path / "operator2.log", namespace=namespace,
                            env=operator_env(namespace))
    try:
        eventually(lambda: {"name": "LOG_LEVEL", "value": "DEBUG"} in
                   emulator.get(paths["deploy"])["spec"]["template"]["spec"]["containers"][0]["env"], timeout=60)
        assert set(watch_count(emulator, paths["deploy"], 10)) == {3}
        # Mode switches, with this operator.
        emulator.merge_patch(paths["cr"], {"spec": {"autoscaling": {"mode": "hpa"}}})
        eventually(lambda: emulator.get(paths["hpa"]), timeout=60)
        eventually(lambda: "embedop" not in owners(emulator.get(paths["deploy"])), timeout=60)
        # The count kept an owner through the handover; no metrics reach this HPA, so it holds.
        assert "embedop-handover" in owners(emulator.get(paths["deploy"]))
        assert set(watch_count(emulator, paths["deploy"], 10)) == {3}
        emulator.merge_patch(paths["cr"], {"spec": {"autoscaling": {"mode": "operator"}}})
        eventually(lambda: emulator.get(paths["hpa"]) is None, timeout=60)
        eventually(lambda: "embedop" in owners(emulator.get(paths["deploy"])), timeout=60)
        assert set(watch_count(emulator, paths["deploy"], 10)) == {3}
        # The mode alone to off: spec.replicas was never set (1), but the operator has written the
        # live count there (3), so the fleet stays.
        assert emulator.get(paths["cr"])["spec"]["replicas"] == 3
        emulator.merge_patch(paths["cr"], {"spec": {"autoscaling": {"mode": "off"}}})
        eventually(lambda: emulator.get(paths["cr"])["status"].get("observedGeneration")
                   == emulator.get(paths["cr"])["metadata"]["generation"], timeout=60)
        assert set(watch_count(emulator, paths["deploy"], 10)) == {3}
        assert emulator.get(paths["cr"])["status"].get("desiredReplicas") == 3
        emulator.merge_patch(f"{paths['cr']}/scale", {"spec": {"replicas": 2}})  # kubectl scale embsvc
        eventually(lambda: emulator.get(paths["deploy"])["spec"]["replicas"] == 2, timeout=60)
        # hpa → off: the HPA's controller moves the count (without metrics it still enforces its
        # minReplicas: 2 → 4), the operator writes it into spec.replicas, a switch of the mode
        # alone keeps it.
        emulator.merge_patch(paths["cr"], {"spec": {"autoscaling": {"mode": "hpa", "minReplicas": 4}}})
        eventually(lambda: emulator.get(paths["deploy"])["spec"]["replicas"] == 4, timeout=120)
        eventually(lambda: emulator.get(paths["cr"])["spec"]["replicas"] == 4, timeout=60)
        emulator.merge_patch(paths["cr"], {"spec": {"autoscaling": {"mode": "off"}}})
        eventually(lambda: emulator.get(paths["hpa"]) is None, timeout=60)
        eventually(lambda: "embedop" in owners(emulator.get(paths["deploy"])), timeout=60)
        assert set(watch_count(emulator, paths["deploy"], 10)) == {4}
    finally:
        fresh.stop()


def test_a_service_created_in_mode_hpa_starts_with_its_replicas(emulator, namespace, tmp_path):
    """Not at 1 until the HPA acts (without metrics, this HPA never would: 1 is within its bounds)."""
    name = "born-hpa"
    op = OperatorProcess(Path(os.environ["KUBECONFIG"]), tmp_path / "operator.log", namespace=namespace,
                         env=operator_env(namespace))
    try:
        emulator.request("POST", service_path(namespace), new_service(name, {
            "model": "m", "replicas": 3, "resources": {"gpu": 0, "cpu": "50m", "memory": "64Mi"},
            "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 6}}, namespace))
        path = f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"
        eventually(lambda: emulator.get(path), timeout=60)
        eventually(lambda: "embedop" not in owners(emulator.get(path)), timeout=60)  # handed over
        assert set(watch_count(emulator, path, 10)) == {3}
    finally:
        op.stop()
