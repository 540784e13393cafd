"""The real operator process against kmock's Kubernetes emulator, driven only through the API.

The emulator has no controllers: where a real cluster's Deployment controller would write
Deployment status, the test writes it, as that controller would."""

import pytest

from tests.operator.conftest import eventually
from tests.operator.emulator import new_service, service_path



class Paths:
    def __init__(self, ns):
        self.ns = ns
        self.deploy = f"/apis/apps/v1/namespaces/{ns}/deployments"
        self.services = f"/api/v1/namespaces/{ns}/services"
        self.pdb = f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets"
        self.events = f"/api/v1/namespaces/{ns}/events"

    def cr(self, name=""):
        return service_path(self.ns, name)


@pytest.fixture(scope="module")
def p(namespace):
    return Paths(namespace)


def env_of(deployment):
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def condition(cr, type_):
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


@pytest.fixture(scope="module")
def svc(emulator, operator, p):
    body = new_service("alpha", {"model": "org/model-a", "replicas": 2, "autoscaling": {"mode": "off"},
                                 "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}}, p.ns)
    return emulator.request("POST", p.cr(), body)


def test_create_makes_the_owned_objects(emulator, svc, p):
    uid = svc["metadata"]["uid"]
    d = eventually(lambda: emulator.get(f"{p.deploy}/alpha"))
    for path in (f"{p.services}/alpha", f"{p.services}/alpha-headless", f"{p.pdb}/alpha"):
        obj = eventually(lambda: emulator.get(path))
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    assert d["metadata"]["ownerReferences"][0] == {
        "apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingService", "name": "alpha", "uid": uid,
        "controller": True, "blockOwnerDeletion": True}
    assert env_of(d)["MODEL_PATH"] == "org/model-a" and d["spec"]["replicas"] == 2
    assert d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "100m", "memory": "256Mi"}
    cr = eventually(lambda: emulator.get(p.cr("alpha")).get("status", {}).get("selector") and emulator.get(p.cr("alpha")))
    assert cr["status"]["selector"] == "app.kubernetes.io/name=embedserve,embedfleet.dev/service=alpha"
    assert "embedfleet.dev/finalizer" in cr["metadata"]["finalizers"]


def test_deployment_status_flows_into_the_service_status(emulator, svc, p, controllers_are_emulated):
    if not controllers_are_emulated:
        pytest.skip("a real Deployment controller owns Deployment status")
    eventually(lambda: emulator.get(f"{p.deploy}/alpha"))
    emulator.merge_patch(f"{p.deploy}/alpha/status", {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}})
    cr = eventually(lambda: (c := emulator.get(p.cr("alpha"))) and c["status"].get("readyReplicas") == 2 and c)
    assert cr["status"]["replicas"] == 2
    assert condition(cr, "Ready")["status"] == "True" and condition(cr, "Degraded")["status"] == "False"
    emulator.merge_patch(f"{p.deploy}/alpha/status", {"status": {"readyReplicas": 1}})
    cr = eventually(lambda: (c := emulator.get(p.cr("alpha"))) and condition(c, "Ready").get("status") == "False" and c)
    assert condition(cr, "Ready")["message"] == "1/2 replicas ready"


def test_model_change_rolls_the_deployment(emulator, svc, p):
    eventually(lambda: emulator.get(f"{p.deploy}/alpha"))
    emulator.merge_patch(p.cr("alpha"), {"spec": {"model": "org/model-b"}})
    d = eventually(lambda: (d := emulator.get(f"{p.deploy}/alpha")) and env_of(d)["MODEL_PATH"] == "org/model-b" and d)
    assert env_of(d)["MODEL_PATH"] == "org/model-b"
    emulator.merge_patch(p.cr("alpha"), {"spec": {"batching": {"maxBatchSize": 64}}})
    eventually(lambda: env_of(emulator.get(f"{p.deploy}/alpha"))["MAX_BATCH_SIZE"] == "64")


def test_replicas_change_resizes_when_autoscaling_is_off(emulator, svc, p):
    eventually(lambda: emulator.get(f"{p.deploy}/alpha"))
    emulator.merge_patch(p.cr("alpha"), {"spec": {"replicas": 5}})
    eventually(lambda: emulator.get(f"{p.deploy}/alpha")["spec"]["replicas"] == 5)


def test_hand_edits_are_reverted(emulator, svc, p):
    eventually(lambda: emulator.get(f"{p.deploy}/alpha"))
    image = emulator.get(f"{p.deploy}/alpha")["spec"]["template"]["spec"]["containers"][0]["image"]
    d = emulator.get(f"{p.deploy}/alpha")
    d["spec"]["template"]["spec"]["containers"][0]["image"] = "evil/image:latest"
    emulator.merge_patch(f"{p.deploy}/alpha", {"spec": {"template": d["spec"]["template"]}})
    eventually(lambda: emulator.get(f"{p.deploy}/alpha")["spec"]["template"]["spec"]["containers"][0]["image"] == image)
    emulator.merge_patch(f"{p.services}/alpha", {"spec": {"ports": [{"name": "x", "port": 1}]}})
    eventually(lambda: [p["port"] for p in emulator.get(f"{p.services}/alpha")["spec"]["ports"]] == [50051, 8001])
    emulator.request("DELETE", f"{p.pdb}/alpha")  # deleted by hand: recreated by the periodic check
    eventually(lambda: emulator.get(f"{p.pdb}/alpha"), timeout=20)


def test_a_bad_service_is_degraded_with_an_event_and_others_carry_on(emulator, svc, p):
    bad = new_service("broken", {"model": "m", "batching": {"maxTokensPerBatch": 100}}, p.ns)
    emulator.request("POST", p.cr(), bad)
    cr = eventually(lambda: (c := emulator.get(p.cr("broken"))) and condition(c, "Degraded").get("status") == "True" and c)
    assert condition(cr, "Degraded")["reason"] == "InvalidSpec"
    assert "below the largest bucket" in condition(cr, "Degraded")["message"]
    assert emulator.get(f"{p.deploy}/broken") is None  # nothing rendered for it
    events = eventually(lambda: [e for e in emulator.get(p.events)["items"]
                                 if e.get("involvedObject", {}).get("name") == "broken" and e.get("reason") == "InvalidSpec"])
    assert events[0]["type"] == "Warning"
    good = new_service("gamma", {"model": "m", "resources": {"gpu": 0, "cpu": "100m", "memory": "256Mi"}}, p.ns)
    emulator.request("POST", p.cr(), good)
    eventually(lambda: emulator.get(f"{p.deploy}/gamma"))
    # fixing the spec heals it
    emulator.merge_patch(p.cr("broken"), {"spec": {"batching": {"maxTokensPerBatch": 4096}}})
    eventually(lambda: emulator.get(f"{p.deploy}/broken"))
    eventually(lambda: condition(emulator.get(p.cr("broken")), "Degraded").get("reason") != "InvalidSpec")


def test_delete_releases_the_finalizer(emulator, operator, svc, p):
    emulator.request("DELETE", p.cr("gamma"))
    eventually(lambda: emulator.get(p.cr("gamma")) is None)
    # Nothing failed for good; temporary failures are retried by design. (kopf's own event
    # posting may warn: the emulator does not implement generateName for Events.)
    errors = [line for line in operator.log().splitlines()
              if (" ERROR " in line and "failed temporarily" not in line) or "failed permanently" in line]
    assert errors == []


def test_every_api_call_made_is_declared_for_rbac(emulator, operator, svc, p):
    """The calls recorded while the scenarios above ran are all in kube.CALLS, which the chart's
    RBAC is checked against (tests/charts)."""
    from embedop.kube import CALLS
    from tests.operator.emulator import recorded

    assert recorded, "nothing recorded"
    assert recorded <= CALLS, recorded - CALLS
