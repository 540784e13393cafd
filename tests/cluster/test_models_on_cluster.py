"""spec.models on a real cluster: the API server runs the CRD's rules on model and models (CEL
within its cost budget, the list keyed by name), and a pod whose models do not fit its device is
read from the termination message the kubelet keeps (the server writes it to
/dev/termination-log before exiting 1; the container's terminationMessagePolicy is the default,
File): the service is Degraded, reason ModelsDoNotFit, with the numbers. The emulator runs no
kubelet: tests/operator/test_autoscale_models.py posts such a pod's status itself. The second test
needs the server image (EMBEDFLEET_SERVER_IMAGE): two simulated models of 3 GiB each on a
simulated device of 4 GiB."""

import pytest
import yaml

from embedop import crd, status
from tests.cluster.conftest import ROOT, SERVER_IMAGE
from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path
from tests.operator.test_models import MODEL_CASES


@pytest.mark.parametrize("case", range(len(MODEL_CASES)))
def test_the_api_server_refuses_what_the_model_rules_refuse(emulator, namespace, case):
    spec, message, _ = MODEL_CASES[case]
    name = f"bad-models-{case}"
    code, reply = emulator.attempt("POST", service_path(namespace), new_service(name, spec, namespace))
    if code == 201:  # wrongly accepted: leave nothing behind for the next case
        emulator.request("DELETE", service_path(namespace, name))
    assert code == 422, reply
    # A name given twice: the list is keyed by name, so the API server may say so before the rule does.
    assert message in reply or (message == crd.UNIQUE_MODELS_RULE and "Duplicate value" in reply), reply


def test_the_retrieval_stack_is_accepted_as_written(emulator, namespace):
    example = yaml.safe_load((ROOT / "crds" / "examples" / "retrieval-stack.yaml").read_text())
    created = emulator.request("POST", service_path(namespace), new_service("stack", example["spec"], namespace))
    try:
        assert [m["name"] for m in created["spec"]["models"]] == ["dense", "sparse", "rerank"]
        assert "model" not in created["spec"]
    finally:
        emulator.request("DELETE", service_path(namespace, "stack"))


@pytest.mark.skipif(not SERVER_IMAGE, reason="needs EMBEDFLEET_SERVER_IMAGE: the server refuses models that do not fit")
@pytest.mark.timeout(900)
def test_models_that_do_not_fit_the_device_make_the_service_degraded(emulator, operator, namespace):
    name = "too-big"
    emulator.request("POST", service_path(namespace), new_service(name, {
        "models": [{"name": "a", "model": "sim:20000@3GiB"}, {"name": "b", "model": "sim:20000@3GiB"}],
        "replicas": 1, "autoscaling": {"mode": "off"}, "resources": {"gpu": 0, "cpu": "250m", "memory": "1Gi"},
        "env": [{"name": "DEVICE_MEMORY_BYTES", "value": str(4 * 2**30)}]}, namespace))
    try:
        def degraded():
            conditions = (emulator.get(service_path(namespace, name)).get("status") or {}).get("conditions") or []
            return next((c for c in conditions if c["type"] == "Degraded"), {})
        c = eventually(lambda: (c := degraded()).get("reason") == status.MISFIT and c, timeout=600)
        assert c["status"] == "True" and c["message"].startswith(status.MISFIT_PREFIX), c
        assert "GiB" in c["message"] and "> device 4.00 GiB" in c["message"], c
        events = emulator.get(f"/api/v1/namespaces/{namespace}/events")["items"]
        assert any(e.get("reason") == status.MISFIT and e["involvedObject"].get("name") == name for e in events)
    finally:
        emulator.request("DELETE", service_path(namespace, name))
